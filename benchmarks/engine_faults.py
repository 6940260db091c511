"""Engine-level fault cases (issue 19) against a real SGLang or vLLM server with Foundry, on one GPU.

    python benchmarks/engine_faults.py --engine sglang --out $OUT/faults-sglang-h200.json --logs $OUT/logs

Every case starts real servers (``sglang.launch_server`` / ``vllm serve`` with ``--enable-foundry``,
built by ``benchmarks/engine_run.py``: same command, environment, model directory and requests),
does something unkind to them or to their archive directory, and records a verdict (``pass``,
``fail``, ``inconclusive``, ``skipped``, ``error``) with the checks behind it, timings, each server's
mode and the Foundry lines of its log. First, once, a **base** SAVE (``mode = "auto"``, empty archive
directory) gives the reference outputs (greedy tokens and top-5 logprobs of 4 prompts) and the archive
that the cases needing a complete one start from (a fresh copy each). Cases (``--cases``, default all
but the last):

* ``kill_during_save``: a SAVE SIGKILLed (its whole process group) at each ``--kill-points`` point,
  each restart in auto mode being the next point's target, the last one serving: ``capture`` (the
  engine's first capture progress line), ``persisting`` (the graph archive's scratch directory
  exists: ``fc.save`` is writing), ``published`` (the graph archive is published, the record that
  marks a SAVE finished, ``rank0.sglang.json`` / ``rank0.vllm.json``, is not written yet),
  ``complete`` (that record exists). Pass: each restart SAVEs (LOADs only where the kill came after
  the record was written), the last serves the reference outputs, the directory then holds one
  complete, consistent archive.
* ``disk_full``: the archive directory on a small tmpfs (root and ``mount`` permitted), else the
  servers run under RLIMIT_FSIZE set between the largest file the base SAVE wrote elsewhere and the
  largest member of its graph archive. Auto: serves the reference outputs with a ``SAVE failed``
  warning and leaves no archive; save: stops with a line naming the cause, leaves no archive.
* ``read_only_dir``: the directory read-only (chmod 0555; as root, where that changes nothing, a
  read-only bind mount, else an existing read-only mount, else a path under /proc that cannot be
  created). Auto serves with a warning; save refuses at startup with one line.
* ``two_replicas``: two auto servers spawned together on one empty directory. Pass: both serve the
  reference outputs, exactly one published, the directory holds one consistent archive (checked
  here and with ``python -m foundry_core.cli verify``).
* ``archive_replaced``: while a LOAD server runs (and keeps answering), a save-mode server publishes
  a new archive into its directory; then a next auto start loads the new one (graph and carried
  caches digests differ from the base's).
* ``damaged_cache``: one byte flipped in a member of the carried caches (``rank0.caches``): auto
  LOADs the graphs with a warning naming the reason and compiles as usual; load mode refuses.
* ``sustained_load`` (only when listed): a LOAD server under a request schedule of mixed batch
  sizes for ``--sustain`` seconds (two passes of the schedule at least), each answer compared with
  the base server's answer to the same request, the server's device memory sampled for growth; a
  stock server (no ``--enable-foundry``, the plugins' Inductor pin in its environment) started
  beside it answers two passes of the same schedule, compared with the LOAD's first two and with
  the base's. A base made by a call that did not list ``sustained_load`` (reused by ``--resume``)
  has no answers to the schedule: then stock's two passes are the reference for every LOAD pass
  (``reference: "stock server"``).

Budget: ``--budget`` seconds for everything; a case whose estimate (from the base's measured SAVE
and the LOADs seen so far) does not fit what is left is skipped with the reason. The JSON at
``--out`` is rewritten after every case; ``--resume`` keeps the cases (and the base) of an earlier
call on the same machine (same engine, commit and workdir), so the cases can be spread over several
device calls; ``kill_during_save`` run again keeps the earlier call's kills at the points it does not
run (``--kill-points capture,persisting`` in one call, ``published`` with ``--resume`` in the next).
SAVEs are always cold (Foundry compiles a SAVE into fresh private cache folders); HOME and TMPDIR
are shared by every server and never emptied, and the cases that start from the base archive get
its carried caches, so LOADs are warm. ``--parallel N`` runs up to N cases at once
(each server's KV cache is pinned by ``--kv-cache-gib`` so that servers can share the GPU).

The cases that start from the base archive (``archive_replaced``, ``damaged_cache``,
``sustained_load``) get a fresh copy of it put back at the base's own path, and start with the base's
TOML path (rewritten before each start) and cache root: for vLLM the TOML's absolute path is part of
the archive's fingerprint (vLLM hashes ``additional_config``), and Foundry names a start's private
cache folder after the archive path, so the carried caches whose files name their folder hit. Such
cases never run at the same time. Default model: the 4-layer Qwen3 of ``examples/qwen3-tiny`` with
dummy weights (``--model 1.7b`` for the Qwen3-1.7B shape), graphs up to batch 64 (``--max-bs``).

On the GPU machine: ``benchmarks/run_faults_h200.sh`` (one device call; see its header).

Table mode, anywhere (no GPU, no engine), from the results of earlier calls, one or more per engine:

    python benchmarks/engine_faults.py table --out benchmarks/results/faults-h200.json \
        benchmarks/results/faults-*-h200*.json

writes one row per case of CASES and engine of ENGINES: the case's verdict as ``outcome`` and, derived
from its checks, ``partial_archive_loadable``, ``served_after``, ``outputs_identical`` and
``strict_mode_refused`` (null, with ``notes``, where a field does not apply); sustained_load's row adds
its requests, duration, mismatches and memory growth. Of several results of one engine, each row takes
the newest (by ``date``) in which its case ran, and names that result's file, commit and date. A case
or engine without a result is a row ``not run`` with null fields; ``all_required_rows_passed`` is true
only when every row passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import engine_run as cs  # noqa: E402  (beside this file)
from faults_archive import archive_state  # noqa: E402
from faults_catalog import (  # noqa: E402
    CASES,
    DEFAULT_CASES,
    ENGINES,
    KILL_POINTS,
    MAX_TOKENS,
    MODELS,
    STAGED,
)
from faults_context import MARGIN_S, Ctx  # noqa: E402
from faults_result import assemble, resumed, summary_lines, write_result  # noqa: E402
from faults_runner import adopt_base, run_base, run_case  # noqa: E402
from faults_server import kv_sizes  # noqa: E402
from faults_table import table_main  # noqa: E402

# The method is spread over modules beside this one, each one concern (this file is the command line):
#   faults_catalog    the cases, kill points, models and verdicts
#   faults_log        the server's output: patterns, the log pump, what a log says
#   faults_archive    the archive directory: its state, a staged copy, a flipped byte, file sizes
#   faults_filesystem mounts and writability probes (root), folders left mounted or read-only
#   faults_answers    answers compared with a reference, with each other, by digest
#   faults_verdicts   a case's verdict and the checks cases share
#   faults_context    the benchmark's state (Ctx): options, paths, budget, live servers, mounts
#   faults_server     one engine server: command line, TOML, process group, requests, stop
#   faults_cases      the fault cases and one case's run (CaseRun)
#   faults_sustained  sustained_load: its schedule, memory samples, the case
#   faults_runner     the base SAVE, the budget's estimates, one case run to its verdict
#   faults_result     the result JSON: assembled, summed up, resumed, written
#   faults_table      table mode: one row per case and engine from earlier results

# --- arguments ---------------------------------------------------------------------------------------


def _names(text: str, known: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in known]
    if unknown or len(set(names)) != len(names) or not names:
        p.error(f"{what} takes each of {', '.join(known)} at most once (got {text!r})")
    return [x for x in known if x in names]  # the fixed order is part of the method


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--out", required=True, help="result JSON (rewritten after every case)")
    p.add_argument("--logs", required=True, help="directory for one log per server")
    p.add_argument("--workdir", default=None, help="model, archives, HOME, TMPDIR (default: new temp dir)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--budget", type=float, default=3600.0, help="seconds for everything (base included)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one server may take to be ready")
    p.add_argument(
        "--kill-points",
        default="persisting",
        help=f"kill_during_save: where SAVEs are killed, a chain (comma-separated subset of {KILL_POINTS})",
    )
    p.add_argument("--kill-delay", type=float, default=0.5, help="seconds after the capture's first line")
    p.add_argument(
        "--disk-full-size",
        default="1m",
        help="tmpfs size for disk_full (smaller if the base "
        "archive is small: at most half the base graph archive's bytes)",
    )
    p.add_argument("--sustain", type=float, default=120.0, help="seconds of sustained_load")
    p.add_argument("--sample-every", type=float, default=5.0, help="sustained_load: memory sample interval")
    p.add_argument("--parallel", type=int, default=1, help="cases run at once (staged cases stay serial)")
    p.add_argument("--no-mount", action="store_true", help="never mount (tmpfs, bind): use the fallbacks")
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (examples/qwen3-tiny, 4 layers), 1.7b (the Qwen3-1.7B shape) or a config.json",
    )
    p.add_argument(
        "--weights",
        choices=("dummy", "seeded"),
        default="dummy",
        help="dummy (the engines' own random weights, the path every GPU run so far "
        "took) or seeded (a checkpoint from foundry_tools.weights: outputs that differ more by prompt)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens generated per prompt")
    p.add_argument(
        "--max-bs",
        type=int,
        default=64,
        help="largest decode batch with a graph (SGLang --cuda-graph-max-bs-decode, vLLM --max-num-seqs); "
        "0 keeps engine_run.py's 512",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="KV cache per server (SGLang --max-total-tokens, vLLM --kv-cache-memory-bytes), so that "
        "servers started together size it alike; 0 lets the engines profile memory",
    )
    p.add_argument("--region-size", default="128GiB", help="Foundry region per rank ([region] size)")
    p.add_argument("--resume", action="store_true", help="keep the cases of an earlier call in --out")
    opts = p.parse_args(argv)
    opts.cases = _names(opts.cases, CASES, "--cases", p)
    opts.kill_points = _names(opts.kill_points, KILL_POINTS, "--kill-points", p)
    if opts.model in MODELS:
        opts.model_config = str(MODELS[opts.model]) if MODELS[opts.model] else None
    elif Path(opts.model).is_file():
        opts.model_config = str(Path(opts.model).resolve())
    else:
        p.error(f"--model: {opts.model!r} is neither {', '.join(MODELS)} nor a config.json")
    if opts.parallel < 1:
        p.error("--parallel must be at least 1")
    return opts


def setup_namespace(opts: argparse.Namespace) -> argparse.Namespace:
    """The options engine_run.setup reads."""
    return argparse.Namespace(
        workdir=opts.workdir,
        logs=opts.logs,
        model_config=opts.model_config,
        weights=opts.weights,
        seed=opts.seed,
        region_size=opts.region_size,
        engine=opts.engine,
        out=opts.out,
        keep_global_caches=True,
        profile=False,
        max_tokens=opts.max_tokens,
        sampling=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["table"]:
        return table_main(args[1:])
    opts = parse_args(argv)
    started = time.monotonic()
    out_path = Path(opts.out).resolve()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": cs.commit(),
        "machine": cs.machine(),
        "command": " ".join(sys.argv if argv is None else [sys.argv[0], *argv]),
        "engine": opts.engine,
        "engine_version": cs.engine_version(opts.engine),
        "python": sys.version.split()[0],
        "root": os.geteuid() == 0,
        "cases_requested": opts.cases,
        "options": {k: v for k, v in vars(opts).items() if k not in ("out", "logs")},
        "prompts": cs.PROMPTS,
        "max_tokens": opts.max_tokens,
    }
    base: dict[str, Any] | None = None
    cases: dict[str, Any] = {}
    again: dict[str, Any] = {}
    if opts.resume:
        base, cases, again = resumed(out_path, meta, opts)
        meta["cases_requested"] = [c for c in CASES if c in opts.cases or c in cases]
    write_lock = threading.Lock()

    def flush() -> dict[str, Any]:
        with write_lock:
            meta["elapsed_s"] = round(time.monotonic() - started, 1)
            result = assemble(meta, base, cases)
            write_result(out_path, result)
            return result

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    ctx: Ctx | None = None
    try:
        bench = cs.setup(setup_namespace(opts), meta)
        workdir = bench.workdir
        config = json.loads((bench.model_dir / "config.json").read_text())
        kv_tokens, kv_bytes = kv_sizes(config, opts.kv_cache_gib)
        ctx = Ctx(
            opts=opts,
            bench=bench,
            engine=opts.engine,
            logs=bench.logs,
            workdir=workdir,
            home=workdir / "home",
            tmp=workdir / "tmp",
            started=started,
            base_toml=workdir / "base" / "foundry.toml",
            kv_tokens=kv_tokens,
            kv_bytes=kv_bytes,
            earlier_cases=again,
        )
        for d in (ctx.home, ctx.tmp):
            d.mkdir(parents=True, exist_ok=True)
        meta["kv_cache"] = {"sglang_max_total_tokens": kv_tokens, "vllm_kv_cache_memory_bytes": kv_bytes}
        flush()
        need = ctx.times["save"] + MARGIN_S
        if base and base.get("ok") and archive_state(ctx.pristine, ctx.engine).get("complete"):
            base["reused"] = True
        elif ctx.left() < need:
            base = {
                "ok": False,
                "skipped": f"needs about {need:.0f} s, {ctx.left():.0f} s of the budget left",
            }
        else:
            print(f"[engine_faults] {opts.engine} base SAVE: starting", flush=True)
            base = run_base(ctx)
        adopt_base(ctx, base)
        if base.get("ok") and "sustained_load" in opts.cases and not ctx.sustained_reference:
            why = "the reused base's call did not list it" if base.get("reused") else "none kept by the base"
            print(
                f"[engine_faults] {opts.engine} sustained_load: no base answers to its schedule ({why}): "
                "the stock server's answers are the reference",
                flush=True,
            )
        flush()
        base_ok = bool(base.get("ok"))
        serial = [c for c in opts.cases if c in STAGED or opts.parallel == 1]
        others = [c for c in opts.cases if c not in serial]
        if others:
            with concurrent.futures.ThreadPoolExecutor(max_workers=opts.parallel) as pool:
                futures = [pool.submit(run_case, ctx, c, base_ok, cases, flush) for c in others]
                if serial:
                    futures.append(
                        pool.submit(lambda: [run_case(ctx, c, base_ok, cases, flush) for c in serial])
                    )
                pending = set(futures)
                try:
                    while pending:  # short waits: the main thread must see SIGTERM
                        _done, pending = concurrent.futures.wait(pending, timeout=1.0)
                except BaseException:
                    ctx.shutdown()  # before the pool waits for its threads, which wait for servers
                    raise
                for f in futures:
                    f.result()
        else:
            for c in serial:
                run_case(ctx, c, base_ok, cases, flush)
    except BaseException as e:  # the result is written whatever happens
        meta["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        if ctx is not None:
            ctx.shutdown()
    result = flush()
    print("\n".join(summary_lines(result)), flush=True)
    return 0 if result["all_passed"] and "error" not in meta else 1


if __name__ == "__main__":
    sys.exit(main())
