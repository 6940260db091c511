"""Foundry with real vLLM on one GPU: stock vLLM, a Foundry SAVE start and a Foundry LOAD start.

    python benchmarks/vllm_h200.py --out $OUT/vllm-h200.json --logs $OUT

Each start runs in a fresh process (its own session, its own timeout) with the same engine flags: a
Qwen3-1.7B-shaped model from a config written locally (benchmarks/cold_start.py's ``MODEL_CONFIG``),
dummy weights, no tokenizer, token-id prompts, greedy decoding, ``max_num_seqs`` 512 and vLLM's own
default capture sizes in ``FULL_DECODE_ONLY`` mode (the mode Foundry persists; stock runs it too).
The former small setup: ``--model-config examples/qwen3-tiny/config.json --max-bs 8`` (graphs for
batch sizes 1, 2, 4 and 8, ``max_num_seqs`` 8).

Every child reports start-to-ready seconds, the output token ids of greedy generates of batch 1, 3
and 8 (``--new-tokens`` each, compared across runs) and decode (benchmarks/engine_steps.py):
``--decode-prompts`` prompts x ``--decode-tokens`` tokens, ``--reps`` timed repetitions after a
warm-up; per repetition the decode tokens per second and, from CUDA events around every decode-graph
replay in the engine core (the same timer in all three children: ``torch.cuda.CUDAGraph.replay`` for
stock and SAVE, Foundry's restored graphs for LOAD), the median host and device time per step; per
run the median and the spread ``(max - min) / median`` across repetitions.  The Foundry children also
report what their worker wrote to ``rank0.start.json`` (mode, graphs, capture/save or restore
seconds, CUDA stream captures counted by the core's CUPTI recorder).  The parent writes one JSON file
with the comparison and keeps each child's stdout and stderr in ``--logs`` (six files).  It writes
the JSON after every child, so a failure or a hang still leaves what was measured, with the error.
All children together stay inside ``--budget`` seconds (each at most ``--child-timeout``, keeping
time for the later ones; a child's repetitions stop early rather than pass its timeout).

``--paired``: after SAVE, LOAD starts alone and stock once LOAD waits at its first timed repetition
(LOAD sizes its KV cache with the GPU to itself, as SAVE did); then the parent opens one repetition
at a time, stock and LOAD alternating with the order swapped every round, and the result's
``paired`` block compares each round's two (tokens/s and device time as ratios, host time per
replay as a difference; median, range and spread).  Run one after the other, the two children had
met the host in different states (periods of seconds in which the whole decode loop, the replay
call included, ran slower), which decided their ratio.

Order: SAVE first, then stock, then LOAD.  All children share one set of compile caches (vLLM,
Inductor, Triton) under the work directory, so the first child pays the cold caches; with stock second,
stock and LOAD both start with warm kernel caches (stock still compiles its own graph: vLLM keys its
compile cache by a config hash that includes ``additional_config``).

The plugin is found the way vLLM finds it in production, through the ``vllm.general_plugins`` entry
point: the Foundry children get a directory on ``PYTHONPATH`` holding a minimal ``.dist-info`` with the
same entry point as pyproject.toml (the package itself is imported from ``src``, which is not installed
there).  The stock child does not get it, so it runs vLLM without the plugin.  The step timer is a
second general plugin (``foundry_bench_steps``), on every child's path.

Environment, the same for all three children: ``VLLM_USE_FLASHINFER_SAMPLER=0``.  vLLM 0.26's V2 model
runner warms its sampler up after the graph capture with top-k/top-p sampling
(``warmup_kernels`` with ``SamplingParams.for_sampler_warmup()``), which makes FlashInfer compile its
sampling kernels with nvcc at first use (flashinfer-python ships sources only): most likely the ~89 s
seen after "Graph capturing finished" in the vLLM 0.26 probe.  Greedy decoding never uses that sampler.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The former default model: the 4-layer Qwen3 of the engine examples.
TINY_CONFIG = ROOT / "examples" / "qwen3-tiny" / "config.json"
RUN_NAMES = ("save", "stock", "load")
#: max_num_seqs without --max-bs (vLLM then captures its default sizes up to 512: 51 graphs).
MAX_NUM_SEQS = 512
# Batch sizes of the compared generates: 1 (graph 1), 3 (padded to graph 4), 8 (graph 8).
BATCHES = (1, 3, 8)
# Fixed token-id prompts of different lengths (no tokenizer: skip_tokenizer_init).
PROMPTS = [[3 + 11 * i + j for j in range(4 + i % 4)] for i in range(8)]
PLUGIN_DIST = "foundry_graphs_bench_plugin-0.0.0"
ENTRY_POINT = "foundry = foundry_vllm_plugin:register"


def _sibling(name: str) -> Any:
    """A module of benchmarks/ by its file (this script is also loaded by path, from tests)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


steps = _sibling("engine_steps")

#: The fields the result always has; benchmarks/sglang_h200.py uses the same names for the same things.
SUMMARY_KEYS = (
    "date",
    "commit",
    "machine",
    "command",
    "vllm_version",
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
    "decode_spread",
)
# vLLM log lines (first occurrence) whose time is reported per child, relative to the child's start.
LOG_MARKS = {
    "engine_core_started": r"Initializing a V1 LLM engine",
    "v2_model_runner": r"Using V2 Model Runner",
    "model_loaded": r"Model loading took",
    "foundry_mode": r"Foundry rank 0: (SAVE|LOAD)",
    "compile_done": r"torch\.compile took",
    "kv_from_archive": r"Foundry rank 0: KV cache \d+ bytes from the archive",
    "graphs_captured": r"Graph capturing finished",
    "foundry_saved": r"Foundry rank 0: saved",
    "foundry_restored": r"Foundry rank 0: restored",
    "engine_ready": r"init engine \(profile, create kv cache, warmup model\) took",
}
_LOG_TIME = re.compile(r"(?:^|\s)(?:INFO|WARNING|ERROR|DEBUG)\s+(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\s")


# ---------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested on CPU: tests/vllm/test_vllm_h200_bench.py)


def model_config(path: str | None) -> dict:
    """The model's config.json: the file given, or the Qwen3-1.7B shape of benchmarks/cold_start.py."""
    if path:
        return json.loads(Path(path).read_text())
    return dict(_sibling("cold_start").MODEL_CONFIG)


def capture_sizes(max_bs: int) -> list[int]:
    """The decode graph sizes of ``--max-bs``: vLLM's own pattern (1, 2, 4, then steps of 8) up to it."""
    sizes = [b for b in (1, 2, 4) if b <= max_bs] + list(range(8, max_bs + 1, 8))
    return sizes if max_bs in sizes else [*sizes, max_bs]


def model_len(prompts: list[list[int]], new_tokens: int) -> int:
    """A max_model_len that holds the longest prompt and ``new_tokens`` more (at least 1024)."""
    need = max(len(p) for p in prompts) + new_tokens + 8
    return max(1024, -(-need // 256) * 256)


def engine_kwargs(
    model_dir: str, gpu_memory_utilization: float, max_bs: int | None = None, max_model_len: int = 1024
) -> dict:
    """The vllm.LLM arguments shared by all three children (Foundry adds only additional_config).

    ``max_bs`` None: ``max_num_seqs`` 512 and vLLM's default capture sizes; else ``max_num_seqs``
    ``max_bs`` and :func:`capture_sizes`. FULL_DECODE_ONLY in every child (what Foundry persists)."""
    compilation: dict[str, Any] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    if max_bs is not None:
        compilation["cudagraph_capture_sizes"] = capture_sizes(max_bs)
    return {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len,
        "max_num_seqs": MAX_NUM_SEQS if max_bs is None else max_bs,
        "seed": 0,
        "enable_prefix_caching": False,
        "compilation_config": compilation,
    }


foundry_toml = steps.foundry_toml  # the runs' foundry.toml, one writer for both engines


def write_plugin_dist_info(directory: Path) -> Path:
    """A minimal installed-distribution record that makes ``vllm.general_plugins: foundry`` discoverable.

    importlib.metadata (which vLLM's plugin loader uses) finds ``*.dist-info`` folders on ``sys.path``
    and reads their ``entry_points.txt``; the entry point is the one pyproject.toml declares.
    """
    info = directory / f"{PLUGIN_DIST}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    name, version = PLUGIN_DIST.rsplit("-", 1)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return info


def child_env(
    base: dict,
    name: str,
    plugin_dir: Path,
    cache_dir: Path,
    step_plugin: Path | None = None,
    steps_dir: Path | None = None,
) -> dict:
    """The environment of one child: identical for all three except the plugin directory on the path
    and, with ``step_plugin`` (:func:`engine_steps.write_plugin`), where the step timer writes."""
    env = {k: v for k, v in base.items() if k != steps.ENV_DIR}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = str(ROOT / "src")
    if src not in paths:
        paths.append(src)
    if name != "stock":
        paths.insert(0, str(plugin_dir))
    if step_plugin is not None:
        paths.insert(0, str(step_plugin))
        allowed = [x.strip() for x in env.get("VLLM_PLUGINS", "").split(",") if x.strip()]
        if allowed and steps.PLUGIN_NAME not in allowed:  # an allow-list from outside: ours too
            env["VLLM_PLUGINS"] = ",".join([*allowed, steps.PLUGIN_NAME])
        if steps_dir is not None:
            env[steps.ENV_DIR] = str(steps_dir)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
            "TRITON_CACHE_DIR": str(cache_dir / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
        }
    )
    return env


def parse_log(text: str, t0_epoch: float | None, year: int | None = None) -> dict:
    """Timings, graph count and flags that a child's vLLM log shows.

    ``marks_s``: seconds from the child's start to the first line matching each of :data:`LOG_MARKS`
    (vLLM stamps lines to the second, local time, without a year).
    """
    out: dict = {"marks_s": {}}
    year = year or _dt.datetime.now().year
    for line in text.splitlines():
        for key, pattern in LOG_MARKS.items():
            if key in out["marks_s"] or not re.search(pattern, line):
                continue
            m = _LOG_TIME.search(line)
            if m and t0_epoch is not None:
                mo, d, hh, mm, ss = (int(g) for g in m.groups())
                try:
                    stamp = _dt.datetime(year, mo, d, hh, mm, ss).timestamp()
                    out["marks_s"][key] = round(stamp - t0_epoch, 1)
                except ValueError:
                    pass
    m = re.search(r"torch\.compile took ([\d.]+) s in total", text)
    if m:
        out["compile_s"] = float(m.group(1))
    m = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text)
    if m:
        out["engine_init_log_s"] = float(m.group(1))
    m = re.search(r"Graph capturing finished in (\d+) secs?", text)
    if m:
        out["capture_log_s"] = int(m.group(1))
    counts = re.findall(r"Capturing CUDA graphs[^\r\n]*?(\d+)/(\d+)", text)
    if counts:
        out["graphs_captured"] = max(int(total) for _, total in counts)
    out["v2_model_runner"] = "Using V2 Model Runner" in text
    out["flashinfer_sampler"] = "Using FlashInfer for top-p & top-k sampling" in text
    return out


def _tokens(run: dict | None):
    return (run or {}).get("tokens")


def _ratio(a, b) -> float | None:
    return round(a / b, 4) if a and b else None


def _same(a, b) -> bool | None:
    return None if a is None or b is None else a == b


def _captures_total(report: dict | None, key: str = "end") -> int | None:
    value = ((report or {}).get("stream_captures") or {}).get(key)
    return None if value is None else int(value)


def assemble(meta: dict, runs: dict) -> dict:
    """The result JSON: ``meta`` (date, commit, machine, command, ...), the summary fields, every run."""
    save, stock, load = (runs.get(n) or {} for n in ("save", "stock", "load"))
    save_report, load_report = save.get("foundry_report") or {}, load.get("foundry_report") or {}
    errors = {n: r["error"] for n, r in runs.items() if r and r.get("error")}
    result = dict(meta)
    if not result.get("vllm_version"):
        result["vllm_version"] = next((r.get("vllm_version") for r in runs.values() if r), None)
    result.update(
        graphs=save_report.get("graphs", load_report.get("graphs")),
        graphs_restored=load_report.get("graphs"),
        graphs_stock=(stock.get("log") or {}).get("graphs_captured"),
        load_decode_captures=_captures_total(load_report),
        save_stream_captures=_captures_total(save_report),
        tokens_identical_to_save=_same(_tokens(load), _tokens(save)),
        tokens_identical_to_stock=_same(_tokens(load), _tokens(stock)),
        save_tokens_identical_to_stock=_same(_tokens(save), _tokens(stock)),
        capture_s=save_report.get("capture_s"),
        save_s=save_report.get("save_s"),
        restore_s=load_report.get("restore_s"),
        # The decode-graph phase of LOAD's start as the engine's start waits for it; the modules
        # and graphs were rebuilt on a thread from open() on (restore_background_s), unless off.
        restore_critical_s=load_report.get("restore_s"),
        restore_background_s=load_report.get("prepared_s"),
        restore_prepared_ready=load_report.get("prepared_ready"),
        # Graphs built ahead with their memory nodes re-pointed after the mapping, and graphs the
        # driver would not build ahead (built on the critical path instead).
        restore_graphs_retargeted=load_report.get("graphs_retargeted"),
        restore_graphs_deferred=load_report.get("graphs_deferred"),
        ready_s_stock=stock.get("ready_s"),
        ready_s_save=save.get("ready_s"),
        ready_s_load=load.get("ready_s"),
        decode_tok_s_stock=stock.get("decode_tok_s"),
        decode_tok_s_save=save.get("decode_tok_s"),
        decode_tok_s_load=load.get("decode_tok_s"),
        decode_ratio_load_vs_stock=_ratio(load.get("decode_tok_s"), stock.get("decode_tok_s")),
        decode_ratio_load_vs_save=_ratio(load.get("decode_tok_s"), save.get("decode_tok_s")),
        decode_ratio_save_vs_stock=_ratio(save.get("decode_tok_s"), stock.get("decode_tok_s")),
        **steps.decode_fields(runs, steps.RUN_NAMES),
        save_mode=save_report.get("mode"),
        load_mode=load_report.get("mode"),
        load_mode_reason=load_report.get("reason"),
        runner=load_report.get("runner", save_report.get("runner")),
        attention_backends=load_report.get("attention_backends", save_report.get("attention_backends")),
    )
    if meta.get("paired"):
        # --paired: LOAD's repetitions against stock's, round by round (both engines up at once).
        result["paired"] = {
            **(meta.get("pairing") or {}),
            **steps.paired_stats(stock, load, (meta.get("pairing") or {}).get("rounds") or 0),
        }
    checks = {
        "save_mode_is_save": result["save_mode"] == "save",
        "load_mode_is_load": result["load_mode"] == "load",
        "graphs_restored": bool(result["graphs"]) and result["graphs_restored"] == result["graphs"],
        "no_captures_in_load": result["load_decode_captures"] == 0,
        # The counter saw the SAVE's captures: a 0 in LOAD then means something.
        "capture_counter_saw_save": bool(result["graphs"])
        and (result["save_stream_captures"] or 0) >= result["graphs"],
        "tokens_identical_to_save": result["tokens_identical_to_save"] is True,
        "tokens_identical_to_stock": result["tokens_identical_to_stock"] is True,
    }
    ran = [n for n in steps.RUN_NAMES if n in (meta.get("order") or steps.RUN_NAMES)]
    if "save" not in ran:
        # --order stock,load: LOAD restores an earlier call's SAVE (KEEP_WORK=1), checked then.
        for key in ("save_mode_is_save", "capture_counter_saw_save", "tokens_identical_to_save"):
            checks.pop(key)
    if meta.get("step_timing", True):
        checks["decode_replays_timed"] = steps.replays_timed(result, ran)
    result["checks"] = checks
    result["ok"] = all(checks.values()) and not errors
    result["errors"] = errors
    result["runs"] = runs
    return result


def summary_lines(result: dict) -> list[str]:
    """One screen: what ran, the per-run table, the Foundry figures, the checks and errors."""

    def f(key, unit=""):
        v = result.get(key)
        return "n/a" if v is None else (f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    lines = [
        f"vLLM {f('vllm_version')} on {f('machine')}, commit {f('commit')}: {'OK' if result.get('ok') else 'FAILED'}"
        f" ({f('elapsed_s')} s)",
        f"  model {f('model')}",
        f"  decode {f('decode')}; engine max_num_seqs {(result.get('engine') or {}).get('max_num_seqs')}, "
        f"capture sizes {((result.get('engine') or {}).get('compilation_config') or {}).get('cudagraph_capture_sizes', 'vLLM default')}",
        *steps.summary_table(result, steps.RUN_NAMES),
        *steps.foundry_lines(result),
        f"  graphs restored {f('graphs_restored')}, stock captured {f('graphs_stock')}; "
        f"capture {f('capture_s')} s + save {f('save_s')} s (SAVE)",
        f"  tokens LOAD==SAVE {f('tokens_identical_to_save')}, LOAD==stock {f('tokens_identical_to_stock')}, "
        f"SAVE==stock {f('save_tokens_identical_to_stock')}",
        *steps.paired_lines(result.get("paired")),
    ]
    failed = [k for k, v in (result.get("checks") or {}).items() if not v]
    if failed:
        lines.append("  failed checks: " + ", ".join(failed))
    for name, err in (result.get("errors") or {}).items():
        lines.append(f"  {name}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else err}")
    return lines


#: A child is not started with a smaller timeout than this: at the Qwen3-1.7B shape a vLLM start takes
#: 30-95 s before its first decode, so a shorter one only spends device time (a 240 s budget gave
#: SAVE 30 s on 2026-12-04, and it timed out in the engine's setup).
MIN_CHILD_S = 60.0
RESERVE_S = 100.0  # kept in the budget for each later child when a child's timeout is set


def child_share(remaining_s: float, runs_left_after: int, reserve_s: float = RESERVE_S) -> float:
    """What the budget leaves this child: ``reserve_s`` kept for each later child and 20 s spare."""
    return remaining_s - 20.0 - reserve_s * runs_left_after


def child_timeout(
    remaining_s: float, runs_left_after: int, cap_s: float, reserve_s: float = RESERVE_S
) -> float:
    """This child's timeout: its :func:`child_share`, at most ``cap_s`` and at least 30 s."""
    return max(30.0, min(cap_s, child_share(remaining_s, runs_left_after, reserve_s)))


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------
# Child: one vLLM start in this process


def _ensure_plugin(result: dict) -> None:
    from importlib.metadata import entry_points

    names = sorted({ep.name for ep in entry_points(group="vllm.general_plugins")})
    result["general_plugins"] = names
    if "foundry" in names:
        result["plugin_loaded_by"] = "entry_point"
        return
    import foundry_vllm_plugin  # the entry point is missing: the same function, called directly

    foundry_vllm_plugin.register()
    result["plugin_loaded_by"] = "explicit register()"


def child_main(spec_path: str) -> int:
    t0_epoch, t0 = time.time(), time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["result"])
    result: dict = {"name": spec["name"], "pid": os.getpid(), "t0_epoch": t0_epoch, "stage": "start"}
    if spec.get("cpus"):  # --cpus: this run and every process vLLM starts from it, same cores each run
        result["cpus"] = steps.pin(spec["cpus"])
    print(f"[bench] {spec['name']}: child start, epoch {t0_epoch:.3f}", flush=True)
    rc = 0

    def checkpoint(stage: str) -> None:
        result["stage"] = stage
        write_json(out, result)

    try:
        checkpoint("start")
        if spec["foundry"]:
            _ensure_plugin(result)
        else:
            from importlib.metadata import entry_points

            result["general_plugins"] = sorted({ep.name for ep in entry_points(group="vllm.general_plugins")})
        import torch

        import vllm
        from vllm import LLM, SamplingParams

        result.update(vllm_version=vllm.__version__, torch_version=torch.__version__)
        result["import_s"] = round(time.perf_counter() - t0, 3)
        kwargs = dict(spec["engine"])
        if spec["foundry"]:
            kwargs["additional_config"] = {"foundry": {"config": spec["foundry_toml"]}}
        checkpoint("engine_init")
        t1 = time.perf_counter()
        llm = LLM(**kwargs)
        t2 = time.perf_counter()
        result.update(engine_init_s=round(t2 - t1, 3), ready_s=round(t2 - t0, 3))
        print(f"[bench] {spec['name']}: engine ready after {t2 - t0:.1f} s", flush=True)
        if spec["foundry"]:
            import foundry_vllm_plugin

            result["plugin_registered"] = foundry_vllm_plugin.is_registered()
            report_path = Path(spec["start_report"])  # removed by the parent before this child started
            report = json.loads(report_path.read_text()) if report_path.is_file() else None
            result["foundry_report"] = report
            if not result["plugin_registered"] or not report or report.get("mode") not in ("save", "load"):
                raise RuntimeError(
                    "Foundry did not run in the worker (no plugin registration or start report)"
                )
        checkpoint("warmup")

        def params(n: int):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

        def prompts(batch: int):
            return [{"prompt_token_ids": p} for p in PROMPTS[:batch]]

        llm.generate(prompts(max(BATCHES)), params(8), use_tqdm=False)  # warm-up, not timed
        result["step_timer_loaded"] = steps.MODULE_NAME in sys.modules
        checkpoint("compared")
        new_tokens = int(spec["new_tokens"])
        tokens, decode = {}, {}
        for batch in BATCHES:
            ts = time.perf_counter()
            llm.generate(prompts(batch), params(1), use_tqdm=False)
            prefill_s = time.perf_counter() - ts
            ts = time.perf_counter()
            outs = llm.generate(prompts(batch), params(new_tokens), use_tqdm=False)
            total_s = time.perf_counter() - ts
            tokens[str(batch)] = [list(o.outputs[0].token_ids) for o in outs]
            decode_tokens = sum(max(0, len(t) - 1) for t in tokens[str(batch)])
            decode_s = max(total_s - prefill_s, 1e-9)
            decode[str(batch)] = {
                "prefill_s": round(prefill_s, 4),
                "generate_s": round(total_s, 4),
                "decode_tokens": decode_tokens,
                "decode_tok_s": round(decode_tokens / decode_s, 1),
            }
        result.update(tokens=tokens, decode=decode)
        # The compared figures: --reps long generates of --decode-prompts prompts (engine_steps.py).
        checkpoint("decode")

        def generate(batch: list[list[int]], n: int) -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params(n), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        result.update(
            steps.measure_decode(
                generate,
                spec["decode_prompts"],
                int(spec["decode_tokens"]),
                int(spec["reps"]),
                steps_dir=os.environ.get(steps.ENV_DIR),
                deadline=spec.get("deadline"),
                gate=steps.PairGate(
                    spec["pair_dir"], spec["name"], timeout_s=max(1.0, spec["deadline"] - time.time())
                )
                if spec.get("pair_dir")
                else None,
            )
        )
        result["total_s"] = round(time.perf_counter() - t0, 3)
        checkpoint("done")
        print(f"[bench] {spec['name']}: done after {result['total_s']:.1f} s", flush=True)
    except BaseException:
        result["error"] = traceback.format_exc()[-6000:]
        print(result["error"], file=sys.stderr, flush=True)
        rc = 1
        try:
            checkpoint(result.get("stage", "start"))
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's engine core runs in a child process of this one; the parent ends the whole session.
    os._exit(rc)


# ---------------------------------------------------------------------------------------------------
# Parent


def _kill_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _gpu_query(fields: str) -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def gpu_memory_used_mib() -> int | None:
    rows = _gpu_query("gpu=memory.used")
    try:
        return sum(int(r.split()[0]) for r in rows) if rows else None
    except ValueError:
        return None


def wait_gpu_idle(baseline_mib: int | None, limit_s: float = 30.0) -> float:
    """Wait until the GPU is back to its memory use before the children (a killed engine core frees
    its memory asynchronously) and no compute process is listed; at most ``limit_s``."""
    t0 = time.perf_counter()
    time.sleep(1.0)
    while time.perf_counter() - t0 < limit_s:
        used = gpu_memory_used_mib()
        settled = used is None or baseline_mib is None or used <= baseline_mib + 1024
        if settled and not _gpu_query("compute-apps=pid"):
            break
        time.sleep(1.0)
    return round(time.perf_counter() - t0, 1)


_BASELINE_MIB: list[int | None] = [None]


class Child:
    """One child (:func:`child_main`) in its own session: :meth:`start` it, then :meth:`finish` it,
    which waits at most ``timeout_s``, ends whatever it left behind and returns its result (or what
    is known) with its exit status. Paired runs keep two alive at once."""

    def __init__(self, name: str, spec: dict, env: dict, logs: Path):
        self.name, self.spec, self.env = name, spec, env
        self.stdout_path = logs / f"vllm-{name}.stdout.log"
        self.stderr_path = logs / f"vllm-{name}.stderr.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        spec_path = Path(self.spec["result"]).with_suffix(".spec.json")
        write_json(spec_path, self.spec)
        self.t0 = time.perf_counter()
        with open(self.stdout_path, "wb") as so, open(self.stderr_path, "wb") as se:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                stdout=so,
                stderr=se,
                env=self.env,
                cwd=str(ROOT),
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def finish(self, timeout_s: float) -> dict:
        proc, spec, name = self.proc, self.spec, self.name
        timed_out = False
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_session(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        _kill_session(proc.pid, signal.SIGKILL)  # the engine core and anything else the child left behind
        wall = round(time.perf_counter() - self.t0, 1)
        try:
            result = json.loads(Path(spec["result"]).read_text())
        except (OSError, ValueError):
            result = {"name": name, "stage": "no result file"}
        result.update(exit_code=rc, wall_s=wall, timeout_s=round(timeout_s), timed_out=timed_out)
        if timed_out:
            result["error"] = (
                f"timed out after {timeout_s:.0f} s in stage {result.get('stage')!r}\n"
                + result.get("error", "")
            )
        elif rc != 0 and not result.get("error"):
            result["error"] = (
                f"exit status {rc} in stage {result.get('stage')!r} (see vllm-{name}.stderr.log)"
            )
        if spec.get("start_report") and not result.get("foundry_report"):
            try:  # the worker may have written it before the child failed
                result["foundry_report"] = json.loads(Path(spec["start_report"]).read_text())
            except (OSError, ValueError):
                pass
        text = ""
        for path in (self.stdout_path, self.stderr_path):
            try:
                text += path.read_text(errors="replace") + "\n"
            except OSError:
                pass
        result["log"] = parse_log(text, result.get("t0_epoch"))
        report = result.get("foundry_report") or {}
        result["graphs"] = report.get("graphs", result["log"].get("graphs_captured"))
        return result


def launch_child(name: str, spec: dict, env: dict, logs: Path, timeout_s: float) -> dict:
    """Run one child to its end (see :class:`Child`)."""
    return Child(name, spec, env, logs).start().finish(timeout_s)


def run_paired(
    load: Child,
    stock: Child,
    pair_dir: Path,
    rounds: int,
    deadline: float,
    poll_s: float = 0.2,
    pause_s: float = 0.0,
) -> tuple[dict, dict, dict]:
    """``--paired``: :func:`engine_steps.run_paired` with this benchmark's children."""
    skipped = {"name": "stock", "error": "skipped: LOAD did not reach its first repetition"}
    return steps.run_paired(load, stock, pair_dir, rounds, deadline, skipped, poll_s, pause_s)


def machine_info() -> dict:
    gpus = _gpu_query("gpu=name,driver_version,memory.total")
    info = {"host": socket.gethostname(), "gpus": gpus}
    if gpus:
        name, driver, mem = (s.strip() for s in (gpus[0].split(",") + ["", "", ""])[:3])
        info["description"] = f"{len(gpus)}x {name} ({mem}), driver {driver}"
    return info


def commit_hash() -> str:
    env = os.environ.get("FOUNDRY_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return None


def run_benchmark(args, launch=launch_child) -> dict:
    t_start = time.perf_counter()
    out, logs = Path(args.out), Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="foundry-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    _BASELINE_MIB[0] = machine["gpu_memory_used_mib"] = gpu_memory_used_mib()
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_hash(),
        "machine": machine.get("description") or machine["host"],
        "machine_info": machine,
        "command": " ".join(shlex.quote(a) for a in ["python", *args.argv]),
        "vllm_version": vllm_version(),
        "python": sys.version.split()[0],
        "order": list(args.order),
        "engine": None,
        "env": None,
        "workdir": str(work),
        "model": None,
        "new_tokens": args.new_tokens,
        "batches": list(BATCHES),
        "prompts": PROMPTS,
        "decode": f"{args.decode_prompts} prompts x {args.decode_tokens} tokens x {args.reps} reps",
        "decode_prompts": args.decode_prompts,
        "decode_tokens": args.decode_tokens,
        "reps": args.reps,
        "save_reps": steps.reps_of("save", args),
        "budget_s": args.budget,
        "step_timing": args.step_timing,
        "paired": args.paired,
    }
    runs: dict = {}

    def flush() -> dict:
        meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        result = assemble(meta, runs)
        write_json(out, result)
        return result

    try:
        config = model_config(args.model_config)
        meta["model"] = steps.describe_model(
            config, args.model_config or "benchmarks/cold_start.py MODEL_CONFIG"
        )
        meta["model_config"] = config
        model_dir = work / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
        decode_prompts = steps.decode_prompts(args.decode_prompts, int(config.get("vocab_size", 32000)))
        plugin_dir = work / "plugin-path"
        write_plugin_dist_info(plugin_dir)
        archive_dir = work / "archive"
        toml = work / "foundry.toml"
        toml.write_text(foundry_toml(archive_dir, args.region_size, args.check_structure))
        cache_dir = work / "cache"
        step_plugin = steps.write_plugin(work / "step-timer") if args.step_timing else None
        length = model_len(decode_prompts + PROMPTS, max(args.decode_tokens, args.new_tokens) + 1)
        engine = engine_kwargs(str(model_dir), args.gpu_memory_utilization, args.max_bs, length)
        meta["engine"] = engine
        common_env = {
            k: v
            for k, v in child_env({}, "stock", plugin_dir, cache_dir, step_plugin).items()
            if k != "PYTHONPATH"
        }
        meta["env"] = common_env
        native = sorted((ROOT / "src" / "foundry_core").glob("_foundry_native*.so"))
        meta["native_library"] = str(native[-1]) if native else None
    except Exception:
        meta["setup_error"] = traceback.format_exc()[-4000:]
        return flush()
    flush()

    def make_spec(name: str, timeout_s: float) -> dict:
        spec = {
            "name": name,
            "foundry": name != "stock",
            "engine": engine,
            "foundry_toml": str(toml),
            "start_report": str(archive_dir / "rank0.start.json") if name != "stock" else None,
            "new_tokens": args.new_tokens,
            "decode_prompts": decode_prompts,
            "decode_tokens": args.decode_tokens,
            "reps": steps.reps_of(name, args),
            "cpus": sorted(args.cpus) if args.cpus else None,
            # The child's repetitions end 20 s before its timeout (its engine must shut down).
            "deadline": round(time.time() + timeout_s - 20, 1),
            "result": str(work / f"result-{name}.json"),
        }
        if spec["start_report"]:
            Path(spec["start_report"]).unlink(missing_ok=True)  # only this child's worker may write it
        return spec

    def make_env(name: str) -> dict:
        return child_env(dict(os.environ), name, plugin_dir, cache_dir, step_plugin, work / f"steps-{name}")

    for i, name in enumerate(args.order):
        if name in runs:  # the other half of a paired run
            continue
        if name == "load" and (runs.get("save") or {}).get("error"):
            runs[name] = {"name": name, "error": "skipped: the SAVE run failed"}
            flush()
            continue
        remaining = args.budget - (time.perf_counter() - t_start)
        later = len(args.order) - i - 1
        timeout_s = child_timeout(remaining, later, args.child_timeout)
        if child_share(remaining, later) < MIN_CHILD_S:
            why = (
                f", {RESERVE_S * later:.0f} s of it kept for the {later} run(s) after this one"
                if later
                else ""
            )
            runs[name] = {"name": name, "error": f"skipped: {remaining:.0f} s of the budget left{why}"}
            flush()
            continue
        if args.paired and name in ("stock", "load") and not (runs.get("save") or {}).get("error"):
            if i > 0 and _BASELINE_MIB[0] is not None:
                wait_gpu_idle(_BASELINE_MIB[0], limit_s=30.0)
            deadline = time.time() + remaining - 10
            pair_dir = work / "pairs"
            shutil.rmtree(pair_dir, ignore_errors=True)
            pair_dir.mkdir()
            children = {}
            for n in ("stock", "load"):
                spec = make_spec(n, deadline - time.time())
                spec.update(pair_dir=str(pair_dir), deadline=round(deadline - 20, 1))
                children[n] = Child(n, spec, make_env(n), logs)
            print(
                f"[bench] stock and load, paired: starting (LOAD first; {remaining:.0f} s left)", flush=True
            )
            try:
                meta["pairing"], runs["stock"], runs["load"] = run_paired(
                    children["load"],
                    children["stock"],
                    pair_dir,
                    args.reps,
                    deadline,
                    pause_s=args.round_pause,
                )
            except Exception:
                for n, c in children.items():
                    if c.alive():
                        _kill_session(c.proc.pid, signal.SIGKILL)
                    runs[n] = {"name": n, "error": "paired run failed:\n" + traceback.format_exc()[-4000:]}
            for n in ("stock", "load"):
                r = runs[n]
                print(
                    f"[bench] {n}: exit {r.get('exit_code')} after {r.get('wall_s')} s, ready {r.get('ready_s')} s"
                    + (" ERROR" if r.get("error") else ""),
                    flush=True,
                )
            flush()
            continue
        spec = make_spec(name, timeout_s)
        idle_wait = None
        if i > 0 and _BASELINE_MIB[0] is not None:
            # The previous child's engine core frees its memory asynchronously; the wait is counted
            # in this child's share of the budget (at most 30 s, and never more than it leaves).
            idle_wait = wait_gpu_idle(_BASELINE_MIB[0], limit_s=min(30.0, max(0.0, timeout_s - 60)))
            timeout_s = max(30.0, timeout_s - idle_wait)
            spec["deadline"] = round(time.time() + timeout_s - 20, 1)
        print(f"[bench] {name}: starting (timeout {timeout_s:.0f} s)", flush=True)
        try:
            runs[name] = launch(name, spec, make_env(name), logs, timeout_s)
        except Exception:
            runs[name] = {"name": name, "error": "launch failed:\n" + traceback.format_exc()[-4000:]}
        r = runs[name]
        if idle_wait is not None:
            r["gpu_idle_wait_s"] = idle_wait
        print(
            f"[bench] {name}: exit {r.get('exit_code')} after {r.get('wall_s')} s, ready {r.get('ready_s')} s"
            + (" ERROR" if r.get("error") else ""),
            flush=True,
        )
        flush()
    return flush()


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON (written after every child)")
    p.add_argument("--logs", required=True, help="directory for the children's stdout/stderr logs")
    p.add_argument("--workdir", help="model, archive, caches (default: a new temporary directory)")
    p.add_argument("--order", default=",".join(RUN_NAMES), help="comma-separated: save, stock, load")
    p.add_argument(
        "--model-config",
        default=None,
        help="config.json of the model (default: the Qwen3-1.7B shape of benchmarks/cold_start.py); "
        "the former small setup: examples/qwen3-tiny/config.json with --max-bs 8",
    )
    p.add_argument(
        "--max-bs",
        type=int,
        default=None,
        help=f"max_num_seqs and largest decode graph (default: max_num_seqs {MAX_NUM_SEQS}, vLLM's own sizes)",
    )
    p.add_argument(
        "--new-tokens",
        "--max-tokens",
        dest="new_tokens",
        type=int,
        default=128,
        help="tokens per request in the compared generates (batch 1, 3 and 8)",
    )
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=None,
        help="prompts decoded together in the timed generates (default 64, at most --max-bs)",
    )
    p.add_argument("--decode-tokens", type=int, default=512, help="tokens per prompt in the timed generates")
    p.add_argument(
        "--reps",
        type=int,
        default=int(os.environ.get("FOUNDRY_BENCH_DECODE_REPS", "5")),
        help="timed repetitions (median and spread across them; default $FOUNDRY_BENCH_DECODE_REPS or 5)",
    )
    p.add_argument(
        "--no-step-timing",
        dest="step_timing",
        action="store_false",
        help="do not time every decode-graph replay (benchmarks/engine_steps.py) in the children",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--region-size", default="64GiB", help="Foundry region size (virtual)")
    p.add_argument(
        "--cpus",
        type=steps.cpu_list,
        default=None,
        help="pin every run to these cores (e.g. 2-9): vLLM's decode is host-bound here, and its "
        "throughput varied by 20-35 %% between repetitions unpinned",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="run stock and LOAD at once and alternate their timed repetitions (stock, LOAD; LOAD, "
        "stock; ...), comparing each round's two: runs one after the other met the host in different "
        "states (tok/s 16,000 vs 21,000 between periods of seconds on the H200 machine)",
    )
    steps.add_round_pause(p)
    steps.add_save_reps(p)
    p.add_argument(
        "--check-structure",
        action="store_true",
        help="LOAD reads its graphs back and compares them with the archive ([load] check_structure)",
    )
    p.add_argument("--child-timeout", type=float, default=300.0, help="seconds, per child at most")
    p.add_argument(
        "--budget", type=float, default=570.0, help="seconds for everything (one device call: 600)"
    )
    args = p.parse_args(argv)
    args.order = [n.strip() for n in args.order.split(",") if n.strip()]
    if sorted(args.order) != sorted(set(args.order)) or not set(args.order) <= set(RUN_NAMES):
        p.error(f"--order takes each of {', '.join(RUN_NAMES)} at most once")
    if "load" in args.order and "save" in args.order and args.order.index("load") < args.order.index("save"):
        p.error("--order: load needs the archive of save, so save comes first")
    if args.paired and not {"stock", "load"} <= set(args.order):
        p.error("--paired needs stock and load in --order")
    steps.check_counts(p, args)
    if args.decode_prompts is None:
        args.decode_prompts = min(64, args.max_bs or 64)
    args.argv = [os.path.relpath(Path(__file__).resolve(), ROOT), *argv]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--child":
        return child_main(argv[1])
    args = parse_args(argv)
    try:
        result = run_benchmark(args)
    except BaseException:
        result = {"error": traceback.format_exc()[-4000:]}
        write_json(Path(args.out), result)
        print(result["error"], file=sys.stderr)
        return 2
    chart = _sibling("engine_chart").write_chart(result, Path(args.out).with_suffix(".png"))
    print("\n".join(summary_lines(result)) + (f"\n  chart {chart}" if chart else ""), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
