"""The GPU benchmark script benchmarks/vllm_h200.py: everything in it that runs without a GPU.

The children (real vLLM starts) need the GPU; what decides whether their results can be trusted is
tested here: equal engine flags and environments, plugin discovery through vLLM's own loader, result
assembly, log parsing, and that a failing or missing child still yields the result file.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("vllm_h200_bench", ROOT / "benchmarks" / "vllm_h200.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_all_children_get_the_same_environment_except_the_plugin_path(tmp_path):
    base = {"PYTHONPATH": "/tmp/site:/repo/src", "CUDA_VISIBLE_DEVICES": "0"}
    envs = {n: bench.child_env(base, n, tmp_path / "plugin", tmp_path / "cache") for n in bench.RUN_NAMES}
    without_path = [{k: v for k, v in e.items() if k != "PYTHONPATH"} for e in envs.values()]
    assert all(e == without_path[0] for e in without_path)
    assert envs["stock"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and envs["stock"]["HF_HUB_OFFLINE"] == "1"
    plugin = str(tmp_path / "plugin")
    assert envs["save"]["PYTHONPATH"] == envs["load"]["PYTHONPATH"]
    assert envs["save"]["PYTHONPATH"].split(os.pathsep)[0] == plugin
    assert plugin not in envs["stock"]["PYTHONPATH"].split(os.pathsep)
    assert str(ROOT / "src") in envs["stock"]["PYTHONPATH"].split(os.pathsep)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in envs["stock"]  # vLLM's default, for all three
    assert base == {"PYTHONPATH": "/tmp/site:/repo/src", "CUDA_VISIBLE_DEVICES": "0"}  # not modified


def test_vllms_plugin_loader_finds_the_written_entry_point(tmp_path):
    # The GPU machine has the package only as source: the .dist-info is what makes vLLM load it.
    bench.write_plugin_dist_info(tmp_path)
    code = """
from importlib.metadata import entry_points
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
ours = [ep for ep in entry_points(group=DEFAULT_PLUGINS_GROUP) if ep.dist.name == "foundry_graphs_bench_plugin"]
assert [(ep.name, ep.value) for ep in ours] == [("foundry", "foundry_vllm_plugin:register")], ours
loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
import foundry_vllm_plugin
assert loaded["foundry"] is foundry_vllm_plugin.register
# vLLM 0.26 turns its V2 model runner off when any vllm.logits_processors entry point exists.
assert not [ep for ep in entry_points(group="vllm.logits_processors") if ep.dist.name.startswith("foundry")]
print("OK")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_the_engine_flags_build_a_foundry_engine_config(tmp_path, qwen3_dir):
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from foundry_core.config import load_config
    from foundry_vllm_plugin.support import FOUNDRY_WORKER

    toml = tmp_path / "foundry.toml"
    toml.write_text(bench.foundry_toml(tmp_path / "archive", "64GiB"))
    cfg = load_config(toml)
    assert cfg.mode == "auto" and cfg.archive_dir == tmp_path / "archive" and cfg.region_size == 64 << 30
    kwargs = bench.engine_kwargs(str(qwen3_dir), 0.1)
    assert kwargs == bench.engine_kwargs(str(qwen3_dir), 0.1)  # the same for every child
    kwargs["compilation_config"] = CompilationConfig(**kwargs["compilation_config"])  # as vllm.LLM does
    vllm_config = EngineArgs(
        **kwargs, additional_config={"foundry": {"config": str(toml)}}
    ).create_engine_config()
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert list(vllm_config.compilation_config.cudagraph_capture_sizes) == bench.CAPTURE_SIZES
    assert vllm_config.scheduler_config.max_num_seqs == max(bench.BATCHES) == max(bench.CAPTURE_SIZES)
    assert vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER
    # The region holds weights, KV cache and graphs: more than the KV budget on an H200 (141 GiB).
    assert cfg.region_size > 0.1 * (141 << 30) * 2
    assert all(len(p) >= 4 for p in bench.PROMPTS) and len(bench.PROMPTS) >= max(bench.BATCHES)


LOG = """\
[bench] load: child start, epoch 100.000
(EngineCore pid=7) INFO 11-30 10:00:05 [gpu_worker.py:380] Using V2 Model Runner
(EngineCore pid=7) INFO 11-30 10:00:07 [session.py:90] Foundry rank 0: LOAD (valid archive for this configuration at /a)
(EngineCore pid=7) INFO 11-30 10:00:20 [monitor.py:20] torch.compile took 3.50 s in total
Capturing CUDA graphs (FULL):  25%|██▌       | 1/4 [00:00<00:00]\rCapturing CUDA graphs (FULL): 100%|██████████| 4/4 [00:01<00:00]
(EngineCore pid=7) INFO 11-30 10:00:31 [session.py:200] Foundry rank 0: restored 4 decode graphs in 0.80 s (no warmup, no capture)
(EngineCore pid=7) INFO 11-30 10:00:40 [core.py:348] init engine (profile, create kv cache, warmup model) took 30.25 s (compilation: 3.50 s)
"""


def test_log_parsing_reports_phases_relative_to_the_child_start():
    import datetime as dt

    t0 = dt.datetime(2026, 11, 30, 10, 0, 0).timestamp()
    parsed = bench.parse_log(LOG, t0, year=2026)
    assert parsed["marks_s"] == {
        "v2_model_runner": 5.0,
        "foundry_mode": 7.0,
        "compile_done": 20.0,
        "foundry_restored": 31.0,
        "engine_ready": 40.0,
    }
    assert parsed["compile_s"] == 3.5 and parsed["engine_init_log_s"] == 30.25
    assert parsed["graphs_captured"] == 4 and parsed["v2_model_runner"] and not parsed["flashinfer_sampler"]
    assert bench.parse_log("", None) == {"marks_s": {}, "v2_model_runner": False, "flashinfer_sampler": False}


TOKENS = {"1": [[5, 6, 7]], "3": [[1, 2], [3, 4], [5, 6]], "8": [[9]] * 8}


def _runs():
    def report(mode, **extra):
        return {"mode": mode, "graphs": 4, "runner": "v2", "attention_backends": ["FLASH_ATTN"], **extra}

    return {
        "save": {
            "ready_s": 95.0,
            "decode_tok_s": 900.0,
            "tokens": copy.deepcopy(TOKENS),
            "foundry_report": report("save", capture_s=1.2, save_s=3.4, stream_captures={"end": 4}),
        },
        "stock": {
            "ready_s": 60.0,
            "decode_tok_s": 910.0,
            "tokens": copy.deepcopy(TOKENS),
            "log": {"graphs_captured": 4},
        },
        "load": {
            "ready_s": 40.0,
            "decode_tok_s": 905.0,
            "tokens": copy.deepcopy(TOKENS),
            "foundry_report": report("load", restore_s=0.8, stream_captures={"before_graphs": 0, "end": 0}),
        },
    }


def test_result_assembly_when_everything_worked():
    meta = {"date": "d", "commit": "c", "machine": "m", "command": "python x", "vllm_version": "0.26.0"}
    r = bench.assemble(meta, _runs())
    for key in bench.SUMMARY_KEYS:
        assert key in r, key
    assert (r["graphs"], r["graphs_restored"], r["graphs_stock"], r["load_decode_captures"]) == (4, 4, 4, 0)
    assert r["tokens_identical_to_save"] is True and r["tokens_identical_to_stock"] is True
    assert (r["capture_s"], r["save_s"], r["restore_s"]) == (1.2, 3.4, 0.8)
    assert (r["ready_s_stock"], r["ready_s_load"], r["decode_tok_s_stock"], r["decode_tok_s_load"]) == (
        60.0,
        40.0,
        910.0,
        905.0,
    )
    assert r["ok"] is True and r["errors"] == {} and all(r["checks"].values())
    assert r["runner"] == "v2" and r["attention_backends"] == ["FLASH_ATTN"]
    assert "OK" in bench.summary_lines(r)[0]


def test_result_assembly_flags_every_failure():
    runs = _runs()
    runs["load"]["tokens"]["8"][3] = [10]
    runs["load"]["foundry_report"]["stream_captures"]["end"] = 4  # LOAD captured
    r = bench.assemble({}, runs)
    assert r["tokens_identical_to_save"] is False and r["tokens_identical_to_stock"] is False
    assert r["save_tokens_identical_to_stock"] is True
    assert r["load_decode_captures"] == 4 and r["ok"] is False
    assert not r["checks"]["no_captures_in_load"] and not r["checks"]["tokens_identical_to_stock"]

    runs = _runs()
    runs["save"]["foundry_report"]["stream_captures"]["end"] = 0  # the counter saw nothing: LOAD's 0 is void
    r = bench.assemble({}, runs)
    assert r["load_decode_captures"] == 0 and not r["checks"]["capture_counter_saw_save"] and r["ok"] is False

    runs = _runs()
    runs["load"]["foundry_report"].update(mode="save", reason="archive was saved for another configuration")
    r = bench.assemble({}, runs)
    assert r["load_mode"] == "save" and not r["checks"]["load_mode_is_load"] and r["ok"] is False
    assert r["load_mode_reason"].startswith("archive was saved")


def test_result_assembly_with_missing_runs_keeps_what_is_known():
    runs = _runs()
    runs["load"] = {"name": "load", "error": "skipped: the SAVE run failed"}
    runs["save"] = {"name": "save", "error": "Traceback ...\nSaveError: graph 'decode/x': pointer outside"}
    r = bench.assemble({"vllm_version": None}, runs)
    assert r["ready_s_stock"] == 60.0 and r["ready_s_load"] is None and r["graphs"] is None
    assert r["tokens_identical_to_save"] is None and r["load_decode_captures"] is None
    assert set(r["errors"]) == {"save", "load"} and r["ok"] is False
    lines = bench.summary_lines(r)
    assert any("SaveError: graph 'decode/x'" in line for line in lines)
    assert bench.summary_lines({})  # never fails, even on an empty result


def test_child_timeouts_leave_room_for_the_later_children():
    assert bench.child_timeout(540, 2, 300) == 300
    assert bench.child_timeout(300, 1, 300) == 190
    assert bench.child_timeout(100, 0, 300) == 80
    assert bench.child_timeout(10, 0, 300) == 30


def _fake_launcher(outcomes: dict, calls: list):
    def launch(name, spec, env, logs, timeout_s):
        calls.append((name, spec, env, timeout_s))
        for suffix in ("stdout", "stderr"):
            (logs / f"vllm-{name}.{suffix}.log").write_text(f"{name} {suffix}\n")
        return {"name": name, **outcomes[name]}

    return launch


def test_a_failed_save_skips_load_and_the_result_file_is_still_written(tmp_path):
    runs = _runs()
    outcomes = {"save": {"error": "SaveError: boom"}, "stock": runs["stock"], "load": runs["load"]}
    calls: list = []
    out = tmp_path / "out" / "vllm-h200.json"
    args = bench.parse_args(
        ["--out", str(out), "--logs", str(tmp_path / "out"), "--workdir", str(tmp_path / "w")]
    )
    result = bench.run_benchmark(args, launch=_fake_launcher(outcomes, calls))
    assert [c[0] for c in calls] == ["save", "stock"]
    assert json.loads(out.read_text())["errors"] == result["errors"]
    assert result["errors"]["load"] == "skipped: the SAVE run failed" and result["ok"] is False
    assert result["command"].startswith("python benchmarks/vllm_h200.py --out ")
    logs = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".log"))
    assert logs == [
        "vllm-save.stderr.log",
        "vllm-save.stdout.log",
        "vllm-stock.stderr.log",
        "vllm-stock.stdout.log",
    ]
    save_spec, stock_spec = calls[0][1], calls[1][1]
    assert save_spec["engine"] == stock_spec["engine"] and save_spec["foundry"] and not stock_spec["foundry"]
    assert (
        save_spec["start_report"].endswith("archive/rank0.start.json") and stock_spec["start_report"] is None
    )


def test_order_save_then_load_reuses_one_toml_and_archive(tmp_path):
    runs = _runs()
    calls: list = []
    args = bench.parse_args(
        [
            "--out",
            str(tmp_path / "r.json"),
            "--logs",
            str(tmp_path / "logs"),
            "--workdir",
            str(tmp_path / "w"),
        ]
    )
    result = bench.run_benchmark(args, launch=_fake_launcher(runs, calls))
    assert [c[0] for c in calls] == ["save", "stock", "load"] and result["ok"] is True
    save_spec, load_spec = calls[0][1], calls[2][1]
    # The TOML path is part of vLLM's compile-cache key: SAVE and LOAD must use the same file.
    assert save_spec["foundry_toml"] == load_spec["foundry_toml"]
    assert Path(save_spec["foundry_toml"]).read_text() == bench.foundry_toml(
        tmp_path / "w" / "archive", "64GiB"
    )
    assert len({id(c[1]["engine"]) for c in calls}) == 1
    assert all(c[3] <= 300 for c in calls)


def test_order_is_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--logs", "l", "--order", "load,save"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--logs", "l", "--order", "save,save"])
    assert bench.parse_args(["--out", "o", "--logs", "l", "--order", "stock,save,load"]).order == [
        "stock",
        "save",
        "load",
    ]


def test_log_file_names_are_plain():
    import re

    names = [f"vllm-{n}.{s}.log" for n in bench.RUN_NAMES for s in ("stdout", "stderr")]
    assert len(names) == 6 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
