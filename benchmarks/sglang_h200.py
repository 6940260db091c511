"""SGLang with and without Foundry on one GPU: stock, SAVE and LOAD, each in a fresh process.

    python benchmarks/sglang_h200.py --out $OUT/sglang-h200.json --logs $OUT

Three runs of the same ``sglang.Engine`` (a Qwen3-1.7B-shaped model from a config written locally,
benchmarks/cold_start.py's ``MODEL_CONFIG``; dummy weights; token-id prompts; FlashAttention 3;
prefill CUDA graphs off; decode graphs up to batch size 512, 52 graphs), each in its own subprocess
with its own timeout:

1. ``stock``: SGLang alone (the Foundry plugin is kept out through ``SGLANG_PLUGINS``);
2. ``save``: ``--enable-foundry``, mode ``auto``, empty archive directory: captures and persists;
3. ``load``: the same configuration again: restores the archive, captures nothing.

The former small setup: ``--model-config examples/qwen3-tiny/config.json --max-bs 8``.

Each run measures engine start-to-ready seconds, the greedy output token ids of a fixed prompt set
(8 prompts x ``--new-tokens``), and decode (benchmarks/engine_steps.py): ``--decode-prompts`` prompts x
``--decode-tokens`` tokens, ``--reps`` timed repetitions after a warm-up; per repetition the decode
tokens per second and, from CUDA events around every decode-graph replay in the scheduler (the same
timer in all three runs: ``torch.cuda.CUDAGraph.replay`` for stock and SAVE, Foundry's restored
graphs for LOAD), the median host and device time per step; per run the median and the spread
``(max - min) / median`` across repetitions. The Foundry runs also report what happened inside the
scheduler (graphs, capture/restore seconds, stream captures counted by CUPTI during the decode-graph
phase, the plugin's own timing of the first ``--replay-timing`` replays) through the plugin's report
file (``FOUNDRY_SGLANG_REPORT_DIR``).

``--paired``: SAVE first, then LOAD alone until it waits at its first timed repetition, then stock
beside it; the parent opens one repetition at a time, stock and LOAD alternating with the order
swapped every round, and the result's ``paired`` block compares each round's two (tokens/s and
device time as ratios, host time per replay as a difference). Every run's KV cache is then pinned
(``--max-total-tokens``, default 65,536 tokens): SGLang sizes its pool from the memory it finds free
at start, and stock starts beside LOAD. Every run also gets SGLang's ``sleep_on_idle``
(``--no-sleep-on-idle`` leaves it off): while one server decodes the other is idle, and an idle
scheduler otherwise spins on its sockets at 100 % of a core.

The JSON at ``--out`` is written after every run and always at the end, failures included, with
each run's error; each run's stdout and stderr (SGLang's scheduler logs included) are kept as
``--logs/sglang-h200-<run>.std{out,err}.log`` (six files). All runs together stay inside
``--budget`` seconds (a run gets at most ``--timeout``, and keeps time for the ones after it; a run's
repetitions stop early rather than pass its timeout). Needs SGLang, an NVIDIA GPU and the native
library built in ``src/foundry_core``. ``FOUNDRY_COMMIT`` names the commit when ``.git`` is not there.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
RUNS = ("stock", "save", "load")
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "foundry"
# The plugin's names for its environment, spelled out rather than imported: this script is also the
# stock run's child, which must not have the plugin in sys.modules (child_main checks exactly that).
# tests/sglang/test_sglang_h200_bench.py holds them equal to the plugin's.
REPORT_ENV = "FOUNDRY_SGLANG_REPORT_DIR"  # foundry_sglang_plugin.session.REPORT_ENV
TIMING_ENV = "FOUNDRY_SGLANG_REPLAY_TIMING"  # foundry_sglang_plugin.replay_timing.ENV
#: Foundry settings a run must not inherit from the calling shell (foundry_sglang_plugin.settings).
SETTINGS_ENV = (
    "FOUNDRY_SGLANG",
    "FOUNDRY_MODE",
    "FOUNDRY_ARCHIVE_DIR",
    "FOUNDRY_REGION_BASE",
    "FOUNDRY_REGION_SIZE",
    "FOUNDRY_ARCHIVE_DIGEST",
    "FOUNDRY_CONFIG",
    "FOUNDRY_SGLANG_REPLICA_MODES",
    REPORT_ENV,
    TIMING_ENV,
)


def _sibling(name: str) -> Any:
    """A module of benchmarks/ by its file (this script is also loaded by path, from tests)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


steps = _sibling("engine_steps")  # standard library only: the stock child may import it

#: The fields the result always has (None where a run did not get that far). benchmarks/vllm_h200.py
#: uses the same names for the same things.
FIELDS = (
    "date",
    "commit",
    "machine",
    "command",
    "sglang_version",
    "graphs",
    "load_decode_captures",
    "tokens_identical_to_save",
    "tokens_identical_to_stock",
    "capture_s",
    "restore_s",
    "restore_critical_s",
    "ready_s_stock",
    "ready_s_save",
    "ready_s_load",
    "decode_tok_s_stock",
    "decode_tok_s_save",
    "decode_tok_s_load",
    *steps.REPLAY_FIELDS,
)

#: The former default model: the 4-layer Qwen3 of the engine examples.
TINY_CONFIG = REPO / "examples" / "qwen3-tiny" / "config.json"

#: Eight fixed token-id prompts of different lengths: the compared generate.
PROMPTS = [[3 + (7 * i + 13 * j) % 31000 for j in range(4 + 3 * i)] for i in range(8)]

LOG_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MIN_RUN_S = 60  # a run is not started with less time than this left in the budget
RESERVE_S = 100.0  # kept in the budget for each later run when a run's timeout is set
#: --paired: KV tokens of every run (SGLang sizes its pool from the memory it finds free at start,
#: and the second engine up finds the first one's: pinned, both get the same pool, as SAVE's).
PAIRED_KV_TOKENS = 65536


# --- arguments ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="sglang-h200.json", help="result JSON (written after every run)")
    p.add_argument("--logs", default=".", help="directory for the six run logs")
    p.add_argument("--workdir", default=None, help="model config, archive, reports (default: a new temp dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    p.add_argument(
        "--budget",
        type=float,
        default=570.0,
        help="seconds for all three runs together (one device call: 600)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="config.json of the model (default: the Qwen3-1.7B shape of benchmarks/cold_start.py); "
        "the former small setup: examples/qwen3-tiny/config.json with --max-bs 8",
    )
    p.add_argument("--attention-backend", default="fa3")
    p.add_argument(
        "--max-bs",
        type=int,
        default=512,
        help="largest decode graph batch size (default 512: 52 decode graphs, the list the cold-start "
        "benchmark uses; SGLang 0.5.17's own default on an H200 at tp=1 is 256, 36 graphs; 0 leaves it "
        "to SGLang)",
    )
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help=f"KV cache tokens of every run (default: SGLang sizes it; {PAIRED_KV_TOKENS} with --paired)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="after SAVE, run LOAD and stock at once and alternate their timed repetitions (LOAD "
        "first, stock once LOAD waits at its first one), comparing each round's two; the KV cache "
        "of every run is then pinned (--max-total-tokens)",
    )
    steps.add_round_pause(p)
    steps.add_save_reps(p)
    p.add_argument(
        "--sleep-on-idle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SGLang's sleep_on_idle in every run: an idle scheduler waits on its sockets instead of "
        "spinning a core (default: on with --paired, where one server idles while the other decodes; "
        "otherwise off, SGLang's default)",
    )
    p.add_argument("--region-size", default="96GiB", help="Foundry region per rank ([region] size)")
    p.add_argument(
        "--cpus",
        type=steps.cpu_list,
        default=None,
        help="pin every run (and the processes SGLang starts from it) to these cores, e.g. 2-9",
    )
    p.add_argument(
        "--check-structure",
        action="store_true",
        help="LOAD reads its graphs back and compares them with the archive ([load] check_structure)",
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt in the compared generate")
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=None,
        help="prompts decoded together in the timed generates (default 64, at most --max-bs)",
    )
    p.add_argument("--decode-tokens", type=int, default=512, help="tokens per prompt in the timed generates")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median and spread across them)")
    p.add_argument("--log-level", default="info", help="SGLang log level in every run")
    p.add_argument(
        "--replay-timing",
        type=int,
        default=150,
        help="SAVE and LOAD also have the plugin time their first N decode-graph replays (its own "
        "timer, per shape, in the scheduler; before the timed generates; 0: off)",
    )
    p.add_argument(
        "--no-step-timing",
        dest="step_timing",
        action="store_false",
        help="do not time every decode-graph replay (benchmarks/engine_steps.py) in the runs",
    )
    p.add_argument(
        "--stock-from",
        default=None,
        help="take the stock run from this earlier result JSON (same flags) instead of running it again",
    )
    # Internal: one run, in the subprocess the parent started.
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pair-dir", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.paired and opts.stock_from:
        p.error("--paired runs stock beside LOAD: it cannot take stock from an earlier result")
    if opts.paired and opts.max_total_tokens is None:
        opts.max_total_tokens = PAIRED_KV_TOKENS
    if opts.sleep_on_idle is None:
        opts.sleep_on_idle = opts.paired
    if opts.max_bs == 0:
        opts.max_bs = None  # SGLang's own decode batch sizes, as a user gets them
    steps.check_counts(p, opts)
    if opts.decode_prompts is None:
        opts.decode_prompts = min(64, opts.max_bs or 64)
    return opts


def model_config(path: str | None) -> dict[str, Any]:
    """The model's config.json: the file given, or the Qwen3-1.7B shape of benchmarks/cold_start.py."""
    if path:
        return json.loads(Path(path).read_text())
    return dict(_sibling("cold_start").MODEL_CONFIG)


def engine_kwargs(opts: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """The ServerArgs of every run: identical in all three (Foundry is switched on separately)."""
    kwargs = {
        "model_path": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "sampling_backend": "pytorch",
        "attention_backend": opts.attention_backend,
        "cuda_graph_backend_prefill": "disabled",  # Foundry persists decode graphs only
        "mem_fraction_static": opts.mem_fraction_static,
        "random_seed": 0,
        "log_level": opts.log_level,
    }
    if opts.max_bs is not None:  # otherwise SGLang's own decode batch sizes, as a user gets them
        kwargs["cuda_graph_max_bs_decode"] = opts.max_bs
    if getattr(opts, "max_total_tokens", None):
        kwargs["max_total_tokens"] = opts.max_total_tokens
    if getattr(opts, "sleep_on_idle", False):
        # The paired run at 87eda11 had one server idle while the other decoded; an idle SGLang
        # scheduler otherwise polls its sockets without pause, one core at 100 %.
        kwargs["sleep_on_idle"] = True
    return kwargs


foundry_toml = steps.foundry_toml  # the runs' foundry.toml, one writer for both engines


def log_names(kind: str) -> tuple[str, str]:
    names = (f"sglang-h200-{kind}.stdout.log", f"sglang-h200-{kind}.stderr.log")
    assert all(LOG_NAME.match(n) for n in names)
    return names


# --- plugin discovery and the runs' environment ----------------------------------------------------


def general_plugins() -> list[str]:
    """Names of the SGLang general plugins this interpreter's path exposes (no SGLang import)."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=PLUGIN_GROUP)})


def make_entry_point_shim(root: Path) -> Path:
    """A directory holding just the distribution metadata that makes SGLang find the plugin when the
    package is on PYTHONPATH (``src/``) but not pip-installed: SGLang discovers plugins through entry
    points only. Put it on PYTHONPATH of the Foundry runs."""
    m = re.search(r'^__version__ = "([^"]+)"', (SRC / "foundry_core" / "__init__.py").read_text(), re.M)
    version = m.group(1) if m else "0"
    info = root / f"foundry_graphs-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: foundry-graphs\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = foundry_sglang_plugin:register\n"
    )
    return root


def run_env(
    kind: str,
    base: dict[str, str],
    workdir: Path,
    shim: Path | None,
    plugins: list[str],
    replay_timing: int = 0,
    step_plugin: Path | None = None,
) -> dict[str, str]:
    """Environment of one run: the repository's ``src`` (and, for Foundry runs, the entry-point shim)
    first on PYTHONPATH, no Foundry settings from outside, no network; the stock run keeps the
    plugin out, the Foundry runs make sure SGLang loads it and writes its report. With
    ``step_plugin`` (the folder of :func:`engine_steps.write_plugin`) every run also loads the step
    timer, which writes to ``<workdir>/steps-<kind>``."""
    env = {k: v for k, v in base.items() if k not in SETTINGS_ENV and k != steps.ENV_DIR}
    paths = [str(SRC)]
    if kind != "stock" and shim is not None:
        paths.insert(0, str(shim))
    if step_plugin is not None:
        paths.insert(0, str(step_plugin))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # Same string hashing in every process (SGLang's spawned schedulers inherit it): setup code that
    # walks a set of names then allocates in the same order at SAVE and at LOAD.
    env.setdefault("PYTHONHASHSEED", "0")
    ours = [steps.PLUGIN_NAME] if step_plugin is not None else []
    others = [name for name in plugins if name not in (PLUGIN_NAME, *ours)]
    if kind == "stock":
        # SGLANG_PLUGINS is an allow-list; a name no plugin has keeps every plugin out.
        env["SGLANG_PLUGINS"] = ",".join([*others, *ours]) or "none"
    else:
        allowed = [x.strip() for x in env.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
        if allowed:
            env["SGLANG_PLUGINS"] = ",".join(allowed + [n for n in (PLUGIN_NAME, *ours) if n not in allowed])
        env[REPORT_ENV] = str(workdir / f"report-{kind}")
        if replay_timing > 0:
            env[TIMING_ENV] = str(replay_timing)
    if step_plugin is not None:
        env[steps.ENV_DIR] = str(step_dir(workdir, kind))
    return env


def step_dir(workdir: Path, kind: str) -> Path:
    return workdir / f"steps-{kind}"


# --- one run (in its own process) ------------------------------------------------------------------


def _write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def child_main(opts: argparse.Namespace) -> int:
    kind = opts.child
    workdir = Path(opts.workdir)
    res: dict[str, Any] = {"kind": kind, "ok": False, "stage": "import", "pid": os.getpid()}
    foundry = kind != "stock"

    def stage(name: str) -> None:
        res["stage"] = name
        _write_json(opts.result, res)
        print(f"[sglang_h200] {kind}: {name}", flush=True)

    if opts.cpus:  # --cpus: this run and every process SGLang starts from it, same cores each run
        res["cpus"] = steps.pin(opts.cpus)
    try:
        stage("import")
        t0 = time.perf_counter()
        from sglang.srt.server_args import ServerArgs

        import sglang

        res["import_s"] = round(time.perf_counter() - t0, 3)
        res["sglang_version"] = getattr(sglang, "__version__", None)
        res["general_plugins"] = general_plugins()
        stage("configure")
        server_args = ServerArgs(**engine_kwargs(opts, str(workdir / "model")))
        if foundry:
            import foundry_sglang_plugin

            foundry_sglang_plugin.enable(server_args, str(workdir / "foundry.toml"))

        stage("engine")
        t0 = time.perf_counter()
        engine = sglang.Engine(server_args=server_args)
        res["ready_s"] = round(time.perf_counter() - t0, 3)
        res["foundry_mode"] = server_args.__dict__.get("foundry_mode")
        res["foundry_plugin_loaded"] = "foundry_sglang_plugin" in sys.modules
        res["step_timer_loaded"] = steps.MODULE_NAME in sys.modules
        if foundry:
            res["foundry_hooks"] = sorted(sys.modules["foundry_sglang_plugin"]._registered)
            if not res["foundry_mode"]:
                raise RuntimeError(
                    "SGLang did not run the Foundry plugin (no mode was settled): is its entry point visible?"
                )
        elif res["foundry_plugin_loaded"]:
            raise RuntimeError("the stock run loaded the Foundry plugin")
        try:

            def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
                params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]

            stage("generate")
            res["output_ids"] = generate(PROMPTS, opts.new_tokens)
            # The same again from an empty prefix cache: a run that disagrees with itself says the
            # engine is not deterministic here, whatever Foundry does.
            try:
                engine.flush_cache()
            except Exception as e:
                res["flush_cache_error"] = f"{type(e).__name__}: {e}"
            res["self_consistent"] = generate(PROMPTS, opts.new_tokens) == res["output_ids"]
            stage("decode")
            vocab = int(json.loads((workdir / "model" / "config.json").read_text()).get("vocab_size", 32000))
            env_steps = os.environ.get(steps.ENV_DIR)
            res.update(
                steps.measure_decode(
                    generate,
                    steps.decode_prompts(opts.decode_prompts, vocab),
                    opts.decode_tokens,
                    opts.reps,
                    steps_dir=env_steps,
                    deadline=opts.deadline,
                    gate=steps.PairGate(
                        opts.pair_dir, kind, timeout_s=max(1.0, (opts.deadline or 0) - time.time())
                    )
                    if opts.pair_dir
                    else None,
                )
            )
        finally:
            stage("shutdown")
            engine.shutdown()
        res["ok"] = True
        res["stage"] = "done"
    except BaseException as e:  # everything goes into the result
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-6000:]
    finally:
        if foundry:
            res["foundry_report"] = read_reports(workdir / f"report-{kind}")
        _write_json(opts.result, res)
    return 0 if res["ok"] else 1


def read_reports(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(directory.glob("rank*.json")) if directory.is_dir() else []:
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            out[path.stem] = {"unreadable": str(e)}
    return out


# --- the parent: three runs, one result ------------------------------------------------------------


def _kill_group(pgid: int, wait_s: float = 15.0) -> None:
    """End what a run left behind (its SGLang scheduler and detokenizer processes), so the next run
    starts with the GPU memory free."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (5.0 if sig == signal.SIGTERM else wait_s)
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def child_argv(
    kind: str,
    opts: argparse.Namespace,
    workdir: Path,
    result: Path,
    deadline: float | None = None,
    pair_dir: Path | None = None,
) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--workdir", str(workdir)]
    argv += ["--result", str(result), "--attention-backend", opts.attention_backend]
    argv += ["--max-bs", str(opts.max_bs or 0)]
    argv += ["--mem-fraction-static", str(opts.mem_fraction_static), "--new-tokens", str(opts.new_tokens)]
    argv += ["--decode-prompts", str(opts.decode_prompts), "--decode-tokens", str(opts.decode_tokens)]
    argv += ["--reps", str(steps.reps_of(kind, opts)), "--log-level", opts.log_level]
    if opts.max_total_tokens:
        argv += ["--max-total-tokens", str(opts.max_total_tokens)]
    argv += ["--sleep-on-idle" if opts.sleep_on_idle else "--no-sleep-on-idle"]
    if pair_dir is not None:
        argv += ["--pair-dir", str(pair_dir)]
    if opts.cpus:
        argv += ["--cpus", ",".join(map(str, sorted(opts.cpus)))]
    if deadline is not None:
        argv += ["--deadline", f"{deadline:.1f}"]
    return argv


def run_timeout(left_s: float, runs_after: int, cap_s: float, reserve_s: float = RESERVE_S) -> float:
    """A run's timeout: at most ``cap_s``, keeping ``reserve_s`` for each later run and 25 s to end
    the run's processes and write the result; never less than what is left minus those 25 s allows."""
    room = left_s - 25.0
    return min(cap_s, max(room - reserve_s * runs_after, min(room, MIN_RUN_S)))


class RunProc:
    """One run's subprocess: :meth:`start`, then :meth:`finish` (waits at most ``timeout`` seconds,
    ends what the run left behind and returns its result). Paired runs keep two alive at once."""

    def __init__(self, kind: str, argv: list[str], env: dict[str, str], logs: Path, result: Path):
        self.kind, self.argv, self.env, self.logs, self.result = kind, argv, env, logs, result
        self.out_name, self.err_name = log_names(kind)
        self.proc: subprocess.Popen | None = None

    def start(self) -> RunProc:
        self.t0 = time.monotonic()
        with open(self.logs / self.out_name, "wb") as out, open(self.logs / self.err_name, "wb") as err:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=err, env=self.env, cwd=REPO, start_new_session=True
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def finish(self, timeout: float) -> dict[str, Any]:
        proc, logs, out_name, err_name = self.proc, self.logs, self.out_name, self.err_name
        timed_out = False
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        finally:
            _kill_group(proc.pid)
            if proc.poll() is None:
                proc.wait()
        run: dict[str, Any] = {}
        try:
            run = json.loads(self.result.read_text())
        except (OSError, ValueError):
            pass
        run.update(
            returncode=rc if rc is not None else proc.returncode,
            timed_out=timed_out,
            timeout_s=round(timeout),
            wall_s=round(time.monotonic() - self.t0, 2),
            logs=[out_name, err_name],
        )
        run.update(
            parse_logs(
                (logs / out_name).read_text(errors="replace") + (logs / err_name).read_text(errors="replace")
            )
        )
        if timed_out:
            run["ok"] = False
            run["error"] = f"timed out after {timeout:.0f} s in stage {run.get('stage', 'start')!r}" + (
                f" ({run['error']})" if run.get("error") else ""
            )
        elif not run.get("ok"):
            run.setdefault("error", f"exited with status {rc} before reporting")
            run["stderr_tail"] = (logs / err_name).read_text(errors="replace")[-3000:]
        return run


def run_one(
    kind: str, argv: list[str], env: dict[str, str], logs: Path, result: Path, timeout: float
) -> dict[str, Any]:
    return RunProc(kind, argv, env, logs, result).start().finish(timeout)


def run_paired(
    load: RunProc,
    stock: RunProc,
    pair_dir: Path,
    rounds: int,
    deadline: float,
    poll_s: float = 0.2,
    pause_s: float = 0.0,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``--paired``: :func:`engine_steps.run_paired` with this benchmark's runs."""
    skipped = {"ok": False, "skipped": True, "error": "skipped: LOAD did not reach its first repetition"}
    return steps.run_paired(load, stock, pair_dir, rounds, deadline, skipped, poll_s, pause_s)


_CAPTURE_BEGIN = re.compile(r"Capture (?:target )?decode \S+ graph begin\..*?bs=\[([^\]]*)\]")
_CAPTURE_END = re.compile(r"Capture (?:target )?decode \S+ graph end\. elapsed=([0-9.]+) s")


def parse_logs(text: str) -> dict[str, Any]:
    """What SGLang's own scheduler log says about the decode graphs (needs --log-level info)."""
    found: dict[str, Any] = {}
    m = _CAPTURE_BEGIN.search(text)
    if m:
        found["log_decode_graph_bs"] = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    m = _CAPTURE_END.search(text)
    if m:
        found["log_decode_graph_phase_s"] = float(m.group(1))
    found["log_tracebacks"] = text.count("Traceback (most recent call last)")
    return found


def _report(run: dict[str, Any] | None) -> dict[str, Any]:
    reports = (run or {}).get("foundry_report") or {}
    return reports.get("rank0") or {}


def assemble(meta: dict[str, Any], runs: dict[str, dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    """The result document from what the runs reported (any of them may be missing or failed)."""
    stock, save, load = (runs.get(k) or {} for k in RUNS)
    rep_save, rep_load = _report(save), _report(load)
    out: dict[str, Any] = {field: None for field in FIELDS}
    out.update(meta)
    if not out.get("sglang_version"):
        out["sglang_version"] = next(
            (r["sglang_version"] for r in (stock, save, load) if r.get("sglang_version")), None
        )

    def same(a: dict, b: dict) -> bool | None:
        if a.get("output_ids") is None or b.get("output_ids") is None:
            return None
        return a["output_ids"] == b["output_ids"]

    captures = rep_load.get("decode_phase_stream_captures")
    out.update(
        graphs=rep_load.get("graphs", rep_save.get("graphs")),
        load_decode_captures=sum(captures.values()) if isinstance(captures, dict) else None,
        tokens_identical_to_save=same(load, save),
        tokens_identical_to_stock=same(load, stock),
        capture_s=rep_save.get("capture_s"),
        restore_s=rep_load.get("restore_s"),
        # The decode-graph phase of LOAD's start (the runner's capture() from its first to its last
        # shape): what the engine's start waits for. The modules and graphs were rebuilt on a
        # thread from the region's reservation on (restore_background_s), unless switched off.
        restore_critical_s=rep_load.get("restore_s"),
        restore_background_s=rep_load.get("prepared_s"),
        restore_prepared_ready=rep_load.get("prepared_ready"),
        # Graphs built ahead with their memory nodes re-pointed after the mapping, and graphs the
        # driver would not build ahead (built on the critical path instead).
        restore_graphs_retargeted=rep_load.get("graphs_retargeted"),
        restore_graphs_deferred=rep_load.get("graphs_deferred"),
        ready_s_stock=stock.get("ready_s"),
        ready_s_save=save.get("ready_s"),
        ready_s_load=load.get("ready_s"),
        decode_tok_s_stock=_round(stock.get("decode_tok_s")),
        decode_tok_s_save=_round(save.get("decode_tok_s")),
        decode_tok_s_load=_round(load.get("decode_tok_s")),
    )
    out.update(steps.decode_fields(runs, RUNS))
    # Extras.
    out["save_tokens_identical_to_stock"] = same(save, stock)
    for name, num, den in (
        ("load_vs_stock", load, stock),
        ("load_vs_save", load, save),
        ("save_vs_stock", save, stock),
    ):
        a, b = num.get("decode_tok_s"), den.get("decode_tok_s")
        out[f"decode_ratio_{name}"] = round(a / b, 4) if a and b else None
    # The plugin's own timer of the first --replay-timing replays (Foundry runs only, per shape).
    out["replay_timing"] = {"save": rep_save.get("replay_timing"), "load": rep_load.get("replay_timing")}
    out["fc_save_s"] = rep_save.get("fc_save_s")
    out["fc_load_s"] = rep_load.get("fc_load_s")
    out["graphs_saved"] = rep_save.get("graphs")
    out["self_consistent"] = {k: (runs.get(k) or {}).get("self_consistent") for k in RUNS}
    save_captures = rep_save.get("decode_phase_stream_captures")
    out["save_decode_captures"] = sum(save_captures.values()) if isinstance(save_captures, dict) else None
    out["graphs_stock_log"] = len(stock["log_decode_graph_bs"]) if stock.get("log_decode_graph_bs") else None
    out["decode_graph_phase_s_log"] = {k: (runs.get(k) or {}).get("log_decode_graph_phase_s") for k in RUNS}
    out["modes"] = {k: (runs.get(k) or {}).get("foundry_mode") for k in ("save", "load")}
    out["load_stream_captures_process_total"] = rep_load.get("stream_captures_total")
    if meta.get("paired"):
        # --paired: LOAD's repetitions against stock's, round by round (both engines up at once).
        pairing = meta.get("pairing") or {}
        out["paired"] = {**pairing, **steps.paired_stats(stock, load, pairing.get("rounds") or 0)}
    out["runs"] = runs
    checks = {
        "every run finished": all((runs.get(k) or {}).get("ok") for k in RUNS),
        "save run saved": out["modes"]["save"] == "save" and rep_save.get("ok") is True,
        "load run loaded": out["modes"]["load"] == "load" and rep_load.get("ok") is True,
        "no decode capture at LOAD": out["load_decode_captures"] == 0,
        "LOAD tokens == SAVE tokens": out["tokens_identical_to_save"] is True,
        "LOAD tokens == stock tokens": out["tokens_identical_to_stock"] is True,
    }
    if meta.get("step_timing", True):
        checks["decode replays timed in every run"] = steps.replays_timed(out, RUNS)
    out["checks"] = checks
    out["errors"] = list(errors) + [
        f"{k}: {(runs.get(k) or {}).get('error')}" for k in RUNS if (runs.get(k) or {}).get("error")
    ]
    out["ok"] = all(checks.values()) and not out["errors"]
    return out


def _round(x: Any, digits: int = 1) -> Any:
    return round(x, digits) if isinstance(x, float) else x


def machine() -> str:
    gpu = None
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        gpu = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{gpu or 'GPU unknown (nvidia-smi failed)'}; host {platform.node()}; Python {platform.python_version()}"


def commit() -> str | None:
    if os.environ.get("FOUNDRY_COMMIT"):
        return os.environ["FOUNDRY_COMMIT"]
    try:
        q = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return q.stdout.strip() or None if q.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def summary(result: dict[str, Any]) -> str:
    """One screen: what ran, the per-run table, the Foundry figures, the checks and errors."""
    lines = [
        f"sglang-h200: {'OK' if result.get('ok') else 'NOT OK'} (sglang {result.get('sglang_version')}, "
        f"commit {result.get('commit')}, {result.get('wall_s')} s)",
        f"  {result.get('machine')}",
        f"  model {result.get('model')}",
        f"  decode {result.get('decode')}; decode graphs: "
        + (
            f"max bs {(result.get('engine') or {}).get('cuda_graph_max_bs_decode')}"
            if (result.get("engine") or {}).get("cuda_graph_max_bs_decode")
            else "SGLang's default batch sizes"
        ),
    ]
    lines += steps.summary_table(result, RUNS)
    lines += steps.foundry_lines(result)
    lines += steps.paired_lines(result.get("paired"))
    lines.append(
        f"  stock log: {result.get('graphs_stock_log')} decode graphs, phase "
        f"{(result.get('decode_graph_phase_s_log') or {}).get('stock')} s; plugin replay timing "
        f"(first {result.get('replay_timing_n')}): {_plugin_timing(result.get('replay_timing'))}"
    )
    for name, passed in (result.get("checks") or {}).items():
        lines.append(f"  [{'x' if passed else ' '}] {name}")
    for err in result.get("errors") or []:
        lines.append(f"  error: {str(err)[:300]}")
    return "\n".join(lines)


def _plugin_timing(timing: Any) -> str:
    """The plugin's per-shape medians, shortened to the most replayed shape of each run."""
    parts = []
    for run, shapes in (timing or {}).items():
        if not shapes:
            continue
        name, best = max(shapes.items(), key=lambda kv: kv[1].get("replays", 0))
        size = re.search(r"size=(\d+)", name)
        parts.append(
            f"{run} bs{size.group(1) if size else '?'} host {best.get('host_us_median')} us "
            f"device {best.get('device_us_median')} us"
        )
    return "; ".join(parts) or "n/a"


def parent_main(opts: argparse.Namespace) -> int:
    started = time.monotonic()
    out_path = Path(opts.out).resolve()
    logs = Path(opts.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="foundry-sglang-h200-")).resolve()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "sglang_version": sglang_version(),
        "workdir": str(workdir),
        "engine": {k: v for k, v in engine_kwargs(opts, "<model>").items() if k != "model_path"},
        "model": None,
        "prompts": PROMPTS,
        "new_tokens": opts.new_tokens,
        "decode": f"{opts.decode_prompts} prompts x {opts.decode_tokens} tokens x {opts.reps} reps",
        "decode_prompts": opts.decode_prompts,
        "decode_tokens": opts.decode_tokens,
        "reps": opts.reps,
        "save_reps": steps.reps_of("save", opts),
        "budget_s": opts.budget,
        "replay_timing_n": opts.replay_timing,
        "step_timing": opts.step_timing,
        "paired": opts.paired,
        "sleep_on_idle": opts.sleep_on_idle,
    }
    runs: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    def write() -> dict[str, Any]:
        result = assemble(meta, runs, errors)
        result["wall_s"] = round(time.monotonic() - started, 1)
        _write_json(out_path, result)
        return result

    result = write()
    # A SIGTERM (the caller's own time limit) still ends the current run and writes the result.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        config = model_config(opts.model_config)
        meta["model"] = steps.describe_model(
            config, opts.model_config or "benchmarks/cold_start.py MODEL_CONFIG"
        )
        meta["model_config"] = config
        (workdir / "model").mkdir(parents=True, exist_ok=True)
        (workdir / "model" / "config.json").write_text(json.dumps(config, indent=1))
        (workdir / "foundry.toml").write_text(
            foundry_toml(workdir / "archive", opts.region_size, opts.check_structure)
        )
        meta["native_library"] = [p.name for p in (SRC / "foundry_core").glob("_foundry_native*.so")]
        if not meta["native_library"]:
            errors.append("src/foundry_core/_foundry_native*.so is missing: build the native library first")
        plugins = general_plugins()
        shim = None if PLUGIN_NAME in plugins else make_entry_point_shim(workdir / "entry-point")
        meta["plugin_entry_point"] = "installed" if shim is None else f"shim at {shim}"
        step_plugin = steps.write_plugin(workdir / "step-timer") if opts.step_timing else None
        if opts.stock_from:
            earlier = json.loads(Path(opts.stock_from).read_text())
            runs["stock"] = dict(
                earlier["runs"]["stock"], reused_from=f"{opts.stock_from} (commit {earlier.get('commit')})"
            )
            meta["stock_reused_from"] = runs["stock"]["reused_from"]
        order = ("save", "load", "stock") if opts.paired else RUNS  # paired: LOAD and stock at once
        for i, kind in enumerate(order):
            if kind in runs:
                continue
            if opts.paired and kind == "load" and (runs.get("save") or {}).get("ok"):
                left = opts.budget - (time.monotonic() - started)
                deadline = time.time() + left - 10
                pair_dir = workdir / "pairs"
                shutil.rmtree(pair_dir, ignore_errors=True)
                pair_dir.mkdir()
                procs = {}
                for k in ("stock", "load"):
                    result_file = workdir / f"result-{k}.json"
                    result_file.unlink(missing_ok=True)
                    env = run_env(
                        k, dict(os.environ), workdir, shim, plugins, opts.replay_timing, step_plugin
                    )
                    argv = child_argv(k, opts, workdir, result_file, deadline - 20, pair_dir)
                    procs[k] = RunProc(k, argv, env, logs, result_file)
                print(f"[sglang_h200] load and stock, paired: starting ({left:.0f} s left)", flush=True)
                meta["pairing"], runs["stock"], runs["load"] = run_paired(
                    procs["load"], procs["stock"], pair_dir, opts.reps, deadline, pause_s=opts.round_pause
                )
                if not runs["load"].get("foundry_report"):
                    runs["load"]["foundry_report"] = read_reports(workdir / "report-load")
                for k in ("load", "stock"):
                    print(
                        f"[sglang_h200] {k}: {'ok' if runs[k].get('ok') else 'FAILED'} "
                        f"in {runs[k].get('wall_s')} s {runs[k].get('error') or ''}",
                        flush=True,
                    )
                result = write()
                continue
            left = opts.budget - (time.monotonic() - started)
            timeout = run_timeout(left, len(order) - i - 1, opts.timeout)
            if kind == "load" and not (runs.get("save") or {}).get("ok"):
                runs[kind] = {"ok": False, "skipped": True, "error": "skipped: the SAVE run did not succeed"}
            elif timeout < MIN_RUN_S:
                runs[kind] = {
                    "ok": False,
                    "skipped": True,
                    "error": f"skipped: {left:.0f} s of the budget left",
                }
            else:
                result_file = workdir / f"result-{kind}.json"
                result_file.unlink(missing_ok=True)
                env = run_env(kind, dict(os.environ), workdir, shim, plugins, opts.replay_timing, step_plugin)
                # The run's own repetitions end 20 s before its timeout (its engine must shut down).
                deadline = time.time() + timeout - 20
                print(f"[sglang_h200] {kind}: starting (timeout {timeout:.0f} s)", flush=True)
                runs[kind] = run_one(
                    kind,
                    child_argv(kind, opts, workdir, result_file, deadline),
                    env,
                    logs,
                    result_file,
                    timeout,
                )
                if kind != "stock" and not runs[kind].get("foundry_report"):
                    # The run died before reading it (SGLang ends its launcher when a scheduler fails).
                    runs[kind]["foundry_report"] = read_reports(workdir / f"report-{kind}")
                print(
                    f"[sglang_h200] {kind}: {'ok' if runs[kind].get('ok') else 'FAILED'} "
                    f"in {runs[kind]['wall_s']} s {runs[kind].get('error') or ''}",
                    flush=True,
                )
            result = write()
    except BaseException as e:  # the result is written whatever happens
        errors.append(f"benchmark: {type(e).__name__}: {e} | {traceback.format_exc()[-1500:]}")
    finally:
        result = write()
    chart = _sibling("engine_chart").write_chart(result, out_path.with_suffix(".png"))
    print(summary(result) + (f"\n  chart {chart}" if chart else ""), flush=True)
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return child_main(opts) if opts.child else parent_main(opts)


if __name__ == "__main__":  # SGLang spawns its schedulers: the guard is required
    sys.exit(main())
