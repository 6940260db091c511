"""``foundry soak``: long replay of restored graphs, load/unload cycles, and the CPU reliability suite.

One command, three processes that matter (the parent itself never touches the GPU):

* **SAVE** (``python -m foundry_tools.soak save``): builds the embedded model, warms up and captures
  one decode graph per batch size exactly as ``foundry demo`` does, saves the archive, then runs
  the *soak sequence* on the native graphs and records its baseline.
* **LOAD** (``python -m foundry_tools.soak load``, a fresh process that never captured): restores
  the archive, runs the same soak sequence on the restored graphs and compares it with the
  baseline; unloads; then does ``--cycles`` more load/unload cycles in the same process, measuring
  device and host memory after each.
* **CPU suite** (``python -m foundry_tools.soak cpu-suite --tests DIR``, started first, run
  alongside with no GPU visible): the tamper matrix, the damage fuzzing and the SIGKILL crash test,
  with a small pytest plugin that *counts* what ran (matrix rows refused, Hypothesis test cases
  executed, kills performed and what each left behind). Nothing in the result is copied from
  documentation. Those tests live in the repository, not in the installed package, so this phase
  runs only when ``--tests`` names the repository's ``tests/`` folder; without it the phase is
  skipped (with a line saying so) and its criteria are left out of the record.

The soak sequence and why its baseline is sound
-----------------------------------------------
Replay ``i`` (``0 <= i < replays``) uses batch size ``sizes[i % len(sizes)]`` with that size's
fixed inputs (``Workload.set_inputs(bs, 0)``), after ``Workload.reset_state()`` and
``torch.cuda.manual_seed(SOAK_SEED)``. Each graph ends by sampling with Philox random numbers; its
replay publishes the generator's (seed, offset) and advances the offset by the graph's increment,
so the sampled tokens of replay ``i`` depend on every replay before it. Two checks:

* **Tokens, every replay, against a recorded sequence.** SAVE runs the identical sequence (same
  schedule, same seed, same start state) on the native graphs and records all sampled tokens
  (``sum(schedule)`` int64 values, a few MB). LOAD must reproduce each replay's tokens exactly.
* **Logits, every replay, bit for bit.** Logits do not depend on the RNG, and with fixed inputs
  they are the same at every replay of one batch size: the decode step writes the KV entry of each
  row at that row's position and reads only that row's cache, so what a replay reads was written
  by the replay itself, whatever ran before. This is not assumed: SAVE compares every native
  replay's logits with that size's first replay and records the count (``native_logit_mismatches``,
  0 or the method is void and the run fails). SAVE keeps a sha256 of each size's first logits; LOAD
  checks its own first logits against those digests, then compares every later replay's logits on
  the device with its own first ones (bit patterns, so -0.0/+0.0 or NaN payloads count too).

A replay counts as a mismatch if its logits or its tokens differ; ``soak_mismatches`` must be 0.

Load/unload cycles and the pass criteria
----------------------------------------
After the soak's own LOAD is unloaded, cycle ``c = 1..cycles`` loads the archive again, replays
each batch size once from the start state (logits and tokens must equal the soak's first pass:
a reloaded archive must still be right, not merely fit), measures, unloads, and measures again.
Each measurement: ``torch.cuda.memory_allocated`` / ``memory_reserved``, device bytes in use from
``cuMemGetInfo`` (total - free: everything the process holds on the GPU, torch's cache, Foundry's
mapped segments, modules, graph executables and the driver's own), and the process RSS from
``/proc/self/status``. Growth is ``curve[last] - curve[warmup]``: the first ``--warmup-cycles``
cycles (default 1) may settle lazily created driver and allocator state once.

* Device: ``device_mem_growth_bytes`` (cuMemGetInfo, after unload) must be **0**. Physical memory
  is handed out in 2 MiB granules, and a LOAD maps hundreds of MB; anything a cycle kept (a
  segment left mapped, a module left loaded, a graph executable not destroyed) shows as at least
  one granule every cycle, so there is no noise floor to allow for on a GPU this process owns.
* Host: RSS growth after the warm-up must stay under ``--host-growth-limit-mib`` (default 64 MiB).
  Each LOAD reads the whole archive (about 170 MB of code images, plus graph descriptions) into
  host memory; a cycle that kept any of it would add tens of MB per cycle, hundreds over 19. What
  the limit does allow for is allocator noise: glibc and pymalloc keep freed memory for reuse and
  return it to the system in no fixed rhythm.

The run fails (exit 1) if any of these is not met: ``soak_mismatches == 0``,
``native_logit_mismatches == 0``, all cycles completed, ``cycle_mismatches == 0``, device growth 0,
host growth under the limit, every tamper matrix row refused, ``kill_loadable_partial == 0`` and
the CPU suite passed (these last three only where the CPU suite ran).

Where the code lives: this module is the parent (:func:`orchestrate`, the record and its criteria)
and the workers' entry point (:func:`main`); soak_gpu.py holds the SAVE and LOAD workers (the soak
sequence, the cycles, the measurements) and soak_cpu_suite.py the CPU suite (its counting pytest
plugin).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .options import (  # noqa: F401  (re-exported: the soak's defaults and options)
    DEFAULT_CYCLES,
    DEFAULT_HOST_GROWTH_LIMIT_MIB,
    DEFAULT_REPLAYS,
    DEFAULT_WARMUP_CYCLES,
    HelpFormatter,
    add_arguments,
    add_soak_arguments,
    workload_argv,
)
from .soak_cpu_suite import run_cpu_suite
from .soak_gpu import run_load, run_save

RESULT_PREFIX = "FOUNDRY_RESULT "


# ------------------------------------------------------------------------------------------ pure parts


def growth(curve: list[int], warmup: int) -> int | None:
    """``curve[-1] - curve[w - 1]`` with ``w = max(warmup, 1)``: from the end of the warm-up to the last cycle.

    ``curve[k]`` is the value measured after cycle ``k + 1``. None when the curve has no point
    past the warm-up (nothing to compare).
    """
    base = max(int(warmup), 1) - 1
    if len(curve) < base + 2:
        return None
    return int(curve[-1]) - int(curve[base])


def memory_growth(curves: dict[str, list[dict]], warmup: int) -> dict:
    """Growth of every measured quantity on the loaded and unloaded curves."""
    out = {}
    for phase, points in curves.items():
        for key in ("device_used", "torch_allocated", "torch_reserved", "host_rss"):
            out[f"{phase}.{key}"] = growth([p[key] for p in points], warmup)
    return out


def criteria(record: dict, host_limit_bytes: int) -> dict[str, bool]:
    """Each pass criterion, by name (see the module docstring for why each is what it is)."""
    cycles_ok = record.get("cycles_completed") == record.get("cycles") and not record.get("cycle_error")
    dev = record.get("device_mem_growth_bytes")
    host = record.get("host_rss_growth_bytes")
    cpu = record.get("cpu_suite") or {}
    out = {
        "soak_mismatches == 0": record.get("soak_mismatches") == 0 and bool(record.get("soak_replays")),
        "native_logit_mismatches == 0": record.get("native_logit_mismatches") == 0,
        "all cycles completed": bool(cycles_ok),
        "cycle_mismatches == 0": record.get("cycle_mismatches") == 0,
        "device_mem_growth_bytes == 0": dev == 0,
        "host_rss_growth_bytes < limit": host is not None and host < host_limit_bytes,
    }
    if cpu.get("exit_status") is not None:  # the CPU suite ran (not skipped with --no-cpu-suite)
        out["tamper_refused == tamper_cases"] = bool(record.get("tamper_cases")) and record.get(
            "tamper_refused"
        ) == record.get("tamper_cases")
        out["kill_loadable_partial == 0"] = (
            bool(record.get("kill_points")) and record.get("kill_loadable_partial") == 0
        )
        out["cpu suite passed"] = cpu.get("exit_status") == 0
    return out


def assemble(
    *,
    args_command: str,
    commit: str,
    save: dict | None,
    load: dict | None,
    cpu: dict | None,
    cycles: int,
    warmup: int,
    host_limit_bytes: int,
    errors: list[str],
    date: str | None = None,
) -> dict:
    """The reliability record (benchmarks/results/reliability-h200.json) from the three processes' results."""
    save, load, cpu = save or {}, load or {}, cpu or {}
    curves = load.get("curves", {"loaded": [], "unloaded": []})
    grown = memory_growth(curves, warmup)
    counts = cpu.get("counts", {})
    record = {
        "date": date or datetime.date.today().isoformat(),
        "commit": commit,
        "machine": load.get("machine") or save.get("machine"),
        "command": args_command,
        "tamper_cases": counts.get("tamper_cases"),
        "tamper_refused": counts.get("tamper_refused"),
        "fuzz_cases": counts.get("fuzz_cases"),
        "kill_points": counts.get("kill_points"),
        "kill_loadable_partial": counts.get("kill_loadable_partial"),
        "soak_replays": load.get("soak", {}).get("soak_replays"),
        "soak_mismatches": load.get("soak", {}).get("soak_mismatches"),
        "cycles": cycles,
        "cycles_completed": load.get("cycles_completed"),
        "cycle_error": load.get("cycle_error"),
        "cycle_mismatches": load.get("cycle_mismatches"),
        "warmup_cycles": warmup,
        "device_mem_growth_bytes": grown.get("unloaded.device_used"),
        "host_rss_growth_bytes": grown.get("unloaded.host_rss"),
        "host_rss_growth_limit_bytes": host_limit_bytes,
        "memory_growth": grown,
        "memory_curves": curves,
        "native_logit_mismatches": save.get("native_logit_mismatches"),
        "soak": load.get("soak"),
        "soak_s": {"save_native": save.get("soak_s"), "load_restored": load.get("soak_s")},
        "restore_s": load.get("restore_s"),
        "load_s_per_cycle": load.get("load_s_per_cycle"),
        "save": {k: v for k, v in save.items() if k not in ("phase",)},
        "cpu_suite": cpu,
        "errors": errors,
    }
    record["criteria"] = criteria(record, host_limit_bytes)
    record["pass"] = all(record["criteria"].values()) and not errors
    return record


# ------------------------------------------------------------------------------------ orchestration


def _worker_cmd(args, phase: str, archive: str, baseline: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "foundry_tools.soak",
        phase,
        "--archive",
        archive,
        "--baseline",
        baseline,
        "--replays",
        str(args.replays),
        "--cycles",
        str(args.cycles),
        *workload_argv(args),
    ]


def _run_worker(cmd: list[str], errors: list[str]) -> dict | None:
    print(f"foundry soak: {cmd[3]} process: {shlex.join(cmd[1:4])} ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            print(line)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        errors.append(f"the {cmd[3]} process failed (exit {proc.returncode}); its stderr is in the log")
        return None
    print(f"foundry soak: {cmd[3]} process done in {time.perf_counter() - t0:.1f} s", flush=True)
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def print_summary(r: dict) -> None:
    mib = 1 << 20

    def show(v):
        return "n/a" if v is None else v

    print("foundry soak:")
    print(f"  soak replays / mismatches      {show(r['soak_replays'])} / {show(r['soak_mismatches'])}")
    print(f"  native logit mismatches (SAVE) {show(r['native_logit_mismatches'])}")
    print(f"  cycles completed               {show(r['cycles_completed'])} / {r['cycles']}")
    if r.get("cycle_error"):
        print(f"  cycle error                    {r['cycle_error']}")
    print(f"  device growth (cuMemGetInfo)   {show(r['device_mem_growth_bytes'])} B")
    host = r["host_rss_growth_bytes"]
    print(f"  host RSS growth                {'n/a' if host is None else f'{host / mib:.1f} MiB'}")
    print(f"  tamper refused / cases         {show(r['tamper_refused'])} / {show(r['tamper_cases'])}")
    print(f"  fuzz cases                     {show(r['fuzz_cases'])}")
    print(f"  kill points / loadable partial {show(r['kill_points'])} / {show(r['kill_loadable_partial'])}")
    for name, ok in r["criteria"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for e in r["errors"]:
        print(f"  error: {e}")
    print("  result: " + ("PASS" if r["pass"] else "FAIL"))


def orchestrate(args, commit: str, command: str) -> tuple[dict, int]:
    """SAVE, then LOAD in a fresh process, with the CPU suite alongside; returns (record, exit status)."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="foundry-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    archive = str(Path(args.archive) if args.archive else workdir / "archive")
    baseline = str(workdir / "baseline.pt")
    errors: list[str] = []
    cpu_proc = None
    cpu_json = workdir / "cpu-suite.json"
    cpu_log = workdir / "cpu-suite.log"
    tests = getattr(args, "tests", None)
    skipped = None
    if args.no_cpu_suite:
        skipped = "not run (--no-cpu-suite)"
    elif tests is None:
        skipped = "not run (no --tests: the CPU suite's tests are in the repository, not in the package)"
        print(
            "foundry soak: CPU suite skipped: no --tests given. To run the tamper, fuzz and crash tests "
            "alongside, pass the repository's tests folder (from a checkout: foundry soak --tests tests ...), "
            "or run them on their own: python -m foundry_tools.soak cpu-suite --tests tests --json cpu-suite.json",
            flush=True,
        )
    else:
        tests_dir = Path(tests).resolve()
        if not tests_dir.is_dir():
            raise SystemExit(f"foundry soak: --tests {tests}: no such folder")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", FOUNDRY_NO_PROGRESS="1")
        # The CPU suite and the tests it runs import the very foundry_core and foundry_tools this process runs.
        import foundry_core

        here = {str(Path(f).resolve().parents[1]) for f in (foundry_core.__file__, __file__)}
        env["PYTHONPATH"] = os.pathsep.join([*sorted(here), *filter(None, [env.get("PYTHONPATH")])])
        with open(cpu_log, "w") as log:
            cpu_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "foundry_tools.soak",
                    "cpu-suite",
                    "--tests",
                    str(tests_dir),
                    "--json",
                    str(cpu_json),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(tests_dir.parent),
            )
        print(f"foundry soak: CPU suite started alongside (pid {cpu_proc.pid}, log {cpu_log})", flush=True)
    save = _run_worker(_worker_cmd(args, "save", archive, baseline), errors)
    load = _run_worker(_worker_cmd(args, "load", archive, baseline), errors) if save else None
    cpu = None
    if cpu_proc is not None:
        rc = cpu_proc.wait()
        tail = cpu_log.read_text().splitlines()[-15:]
        print("foundry soak: CPU suite: " + (tail[-1] if tail else "(no output)"), flush=True)
        if cpu_json.exists():
            cpu = json.loads(cpu_json.read_text())
        else:
            errors.append(f"the CPU suite wrote no result (exit {rc}); see {cpu_log}")
        if rc != 0:
            print("\n".join(tail))
    else:
        cpu = {"exit_status": None, "notes": [skipped], "counts": {}}
    record = assemble(
        args_command=command,
        commit=commit,
        save=save,
        load=load,
        cpu=cpu,
        cycles=args.cycles,
        warmup=args.warmup_cycles,
        host_limit_bytes=args.host_growth_limit_mib << 20,
        errors=errors,
    )
    record["preset"], record["variant"] = args.preset, args.variant
    record["batch_sizes"] = list(args.batch_sizes)
    return record, 0 if record["pass"] else 1


def main(argv=None) -> int:
    """Workers: ``save`` / ``load`` (one GPU phase each) and ``cpu-suite``."""
    p = argparse.ArgumentParser(prog="python -m foundry_tools.soak")
    sub = p.add_subparsers(dest="phase", required=True)
    for phase in ("save", "load"):
        w = sub.add_parser(phase, formatter_class=HelpFormatter)
        add_arguments(w)
        w.add_argument(
            "--baseline", required=True, help="the SAVE's soak baseline (written by save, read by load)"
        )
        w.add_argument(
            "--replays", type=int, default=DEFAULT_REPLAYS, help="soak replays in all (round robin)"
        )
        w.add_argument(
            "--cycles", type=int, default=DEFAULT_CYCLES, help="LOAD: load/unload cycles after the soak"
        )
    c = sub.add_parser(
        "cpu-suite",
        help="the tamper, fuzz and crash tests of a repository's tests/ folder, counted",
        formatter_class=HelpFormatter,
    )
    c.add_argument("--tests", required=True, metavar="DIR", help="the repository's tests/ folder")
    c.add_argument("--json", required=True, help="write what ran, counted, here")
    args = p.parse_args(argv)
    if args.phase == "cpu-suite":
        return run_cpu_suite(args.json, args.tests)
    if args.archive is None:
        p.error("--archive is required")
    result = run_save(args) if args.phase == "save" else run_load(args)
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FOUNDRY_NO_PROGRESS", "1")
    sys.exit(main())
