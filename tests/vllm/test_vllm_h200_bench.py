"""The GPU benchmark script benchmarks/vllm_h200.py: everything in it that runs without a GPU.

The children (real vLLM starts) need the GPU; what decides whether their results can be trusted is
tested here: equal engine flags and environments, plugin discovery through vLLM's own loader (the
Foundry plugin and the step timer), the default and the former small engine configuration, result
assembly with the decode fields, the summary, log parsing, and that a failing or missing child still
yields the result file. The decode measurement itself (benchmarks/engine_steps.py) is tested in
tests/test_engine_steps_bench.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
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
    assert bench.steps.ENV_DIR not in envs["stock"]
    assert envs["stock"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and envs["stock"]["HF_HUB_OFFLINE"] == "1"
    plugin = str(tmp_path / "plugin")
    assert envs["save"]["PYTHONPATH"] == envs["load"]["PYTHONPATH"]
    assert envs["save"]["PYTHONPATH"].split(os.pathsep)[0] == plugin
    assert plugin not in envs["stock"]["PYTHONPATH"].split(os.pathsep)
    assert str(ROOT / "src") in envs["stock"]["PYTHONPATH"].split(os.pathsep)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in envs["stock"]  # vLLM's default, for all three
    assert base == {"PYTHONPATH": "/tmp/site:/repo/src", "CUDA_VISIBLE_DEVICES": "0"}  # not modified


def test_the_step_timer_is_on_every_childs_path_with_its_own_folder(tmp_path):
    base = {"PYTHONPATH": "/tmp/site", bench.steps.ENV_DIR: "/from/the/shell", "VLLM_PLUGINS": "foundry"}
    timer = tmp_path / "step-timer"
    envs = {
        n: bench.child_env(base, n, tmp_path / "plugin", tmp_path / "cache", timer, tmp_path / f"steps-{n}")
        for n in bench.RUN_NAMES
    }
    for name, env in envs.items():
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(timer)
        assert env[bench.steps.ENV_DIR] == str(tmp_path / f"steps-{name}")
        assert env["VLLM_PLUGINS"] == "foundry,foundry_bench_steps"  # an allow-list from outside
    ignore = ("PYTHONPATH", bench.steps.ENV_DIR)
    rest = [{k: v for k, v in e.items() if k not in ignore} for e in envs.values()]
    assert all(e == rest[0] for e in rest)
    assert "VLLM_PLUGINS" not in bench.child_env({}, "stock", tmp_path, tmp_path, timer, tmp_path)


def test_vllms_plugin_loader_finds_the_written_entry_point(tmp_path):
    # The GPU machine has the package only as source: the .dist-info is what makes vLLM load it.
    bench.write_plugin_dist_info(tmp_path)
    bench.steps.write_plugin(tmp_path / "step-timer")
    code = """
from importlib.metadata import entry_points
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
ours = [ep for ep in entry_points(group=DEFAULT_PLUGINS_GROUP) if ep.dist.name == "foundry_graphs_bench_plugin"]
assert [(ep.name, ep.value) for ep in ours] == [("foundry", "foundry_vllm_plugin:register")], ours
loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
import foundry_vllm_plugin
assert loaded["foundry"] is foundry_vllm_plugin.register
import foundry_bench_steps
assert loaded["foundry_bench_steps"] is foundry_bench_steps.register
# vLLM 0.26 turns its V2 model runner off when any vllm.logits_processors entry point exists.
assert not [ep for ep in entry_points(group="vllm.logits_processors") if ep.dist.name.startswith("foundry")]
print("OK")
"""
    paths = [str(tmp_path / "step-timer"), str(tmp_path), str(ROOT / "src")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def _engine_config(kwargs: dict, toml: Path | None):
    from vllm.config.compilation import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(kwargs)
    kwargs["compilation_config"] = CompilationConfig(**kwargs["compilation_config"])  # as vllm.LLM does
    extra = {"additional_config": {"foundry": {"config": str(toml)}}} if toml else {}
    return EngineArgs(**kwargs, **extra).create_engine_config()


def test_the_default_engine_flags_build_a_foundry_engine_config(tmp_path, qwen3_dir):
    from vllm.config.compilation import CUDAGraphMode

    from foundry_core.config import load_config
    from foundry_vllm_plugin.support import FOUNDRY_WORKER

    args = bench.parse_args(["--out", "o", "--logs", "l"])
    toml = tmp_path / "foundry.toml"
    toml.write_text(bench.foundry_toml(tmp_path / "archive", args.region_size))
    cfg = load_config(toml)
    assert cfg.mode == "auto" and cfg.archive_dir == tmp_path / "archive" and cfg.region_size == 64 << 30
    kwargs = bench.engine_kwargs(str(qwen3_dir), args.gpu_memory_utilization, args.max_bs, 1024)
    assert kwargs == bench.engine_kwargs(str(qwen3_dir), args.gpu_memory_utilization, None, 1024)
    assert kwargs["max_num_seqs"] == 512 and "cudagraph_capture_sizes" not in kwargs["compilation_config"]
    vllm_config = _engine_config(kwargs, toml)
    cc = vllm_config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    # vLLM's own sizes up to 512: 1, 2, 4, 8..248 by 8, 256..512 by 16
    assert list(cc.cudagraph_capture_sizes) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert vllm_config.scheduler_config.max_num_seqs == 512
    assert vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER
    # stock gets the same sizes and mode without Foundry
    stock = _engine_config(kwargs, None).compilation_config
    assert stock.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert list(stock.cudagraph_capture_sizes) == list(cc.cudagraph_capture_sizes)
    # The region holds weights, KV cache and graphs: more than the KV budget on an H200 (141 GiB).
    assert cfg.region_size > args.gpu_memory_utilization * (141 << 30) * 1.4


def test_the_former_small_setup_is_two_options(tmp_path, qwen3_dir):
    args = bench.parse_args(
        ["--out", "o", "--logs", "l", "--model-config", str(bench.TINY_CONFIG), "--max-bs", "8"]
    )
    assert args.decode_prompts == 8 and bench.model_config(args.model_config)["num_hidden_layers"] == 4
    kwargs = bench.engine_kwargs(str(qwen3_dir), 0.1, args.max_bs)
    assert kwargs["max_num_seqs"] == 8 and kwargs["compilation_config"]["cudagraph_capture_sizes"] == [
        1,
        2,
        4,
        8,
    ]
    cc = _engine_config(kwargs, None).compilation_config
    assert list(cc.cudagraph_capture_sizes) == [1, 2, 4, 8]
    assert bench.capture_sizes(20) == [1, 2, 4, 8, 16, 20] and bench.capture_sizes(1) == [1]
    assert all(len(p) >= 4 for p in bench.PROMPTS) and len(bench.PROMPTS) >= max(bench.BATCHES)


def test_defaults_and_counts():
    args = bench.parse_args(["--out", "o", "--logs", "l"])
    assert args.budget <= 585 and args.child_timeout == 300 and args.model_config is None
    assert (args.decode_prompts, args.decode_tokens, args.reps, args.new_tokens) == (64, 512, 5, 128)
    assert bench.parse_args(["--out", "o", "--logs", "l", "--max-tokens", "16"]).new_tokens == 16  # old name
    for bad in (["--reps", "0"], ["--max-bs", "0"], ["--decode-prompts", "0"], ["--decode-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "o", "--logs", "l", *bad])


def test_the_default_model_is_qwen3_1_7b_shaped_and_fits_the_model_length():
    config = bench.model_config(None)
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        28,
        2048,
        6144,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 8, 128)
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    prompts = bench.steps.decode_prompts(64, config["vocab_size"])
    assert bench.model_len(prompts, 513) == 1024
    assert bench.model_len(prompts, 2000) == 2048 and bench.model_len(prompts, 2000) >= 39 + 2000


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


def _decode_stats(tok_s, host=20.0, device=4000.0, spread=0.01):
    return {
        "tok_s": {"median": tok_s, "spread": spread},
        "replay_host_us": {"median": host, "spread": 2 * spread},
        "replay_device_us": {"median": device, "spread": spread / 2},
    }


def _runs():
    def report(mode, **extra):
        return {"mode": mode, "graphs": 4, "runner": "v2", "attention_backends": ["FLASH_ATTN"], **extra}

    return {
        "save": {
            "ready_s": 95.0,
            "decode_tok_s": 900.0,
            "decode_stats": _decode_stats(900.0, host=21.0, device=4010.0),
            "tokens": copy.deepcopy(TOKENS),
            "foundry_report": report("save", capture_s=1.2, save_s=3.4, stream_captures={"end": 4}),
        },
        "stock": {
            "ready_s": 60.0,
            "decode_tok_s": 910.0,
            "decode_stats": _decode_stats(910.0, host=19.0),
            "tokens": copy.deepcopy(TOKENS),
            "log": {"graphs_captured": 4},
        },
        "load": {
            "ready_s": 40.0,
            "decode_tok_s": 905.0,
            "decode_stats": _decode_stats(905.0, host=25.0, device=4030.0, spread=0.02),
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
    # the decode fields, named as in benchmarks/sglang_h200.py
    assert r["restore_critical_s"] == 0.8
    assert (r["replay_host_us_save"], r["replay_host_us_load"], r["replay_host_us_stock"]) == (
        21.0,
        25.0,
        19.0,
    )
    assert (r["replay_device_us_save"], r["replay_device_us_load"]) == (4010.0, 4030.0)
    assert r["replay_device_ratio_load_vs_save"] == round(4030 / 4010, 4)
    assert r["decode_spread"]["load"] == {"tok_s": 0.02, "replay_host_us": 0.04, "replay_device_us": 0.01}
    assert r["decode_stats"]["stock"]["tok_s"]["median"] == 910.0


def test_the_summary_is_one_screen():
    r = bench.assemble({"vllm_version": "0.26.0", "decode": "64 prompts x 512 tokens x 5 reps"}, _runs())
    lines = bench.summary_lines(r)
    assert len(lines) < 20
    table = [line for line in lines if line.lstrip().startswith(("stock", "save", "load"))]
    assert len(table) == 3 and "905.0 (2.0%)" in table[2] and "4030.00 (1.0%)" in table[2]
    assert any("restore_critical_s 0.8" in line for line in lines)


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


def test_a_call_without_save_is_checked_on_what_it_ran():
    """KEEP_WORK=1 and --order stock,load: LOAD restores an earlier call's SAVE; no SAVE check
    applies, every other one still does."""
    runs = _runs()
    del runs["save"]
    r = bench.assemble({"order": ["stock", "load"]}, runs)
    assert r["ok"] is True and "tokens_identical_to_save" not in r["checks"], r["checks"]
    assert r["graphs"] == r["graphs_restored"] == 4
    runs["load"]["foundry_report"]["stream_captures"]["end"] = 4  # LOAD captured
    assert bench.assemble({"order": ["stock", "load"]}, runs)["ok"] is False
    assert bench.assemble({"order": ["save", "stock", "load"]}, runs)["ok"] is False  # SAVE missing


def test_result_assembly_with_missing_runs_keeps_what_is_known():
    runs = _runs()
    runs["load"] = {"name": "load", "error": "skipped: the SAVE run failed"}
    runs["save"] = {"name": "save", "error": "Traceback ...\nSaveError: graph 'decode/x': pointer outside"}
    r = bench.assemble({"vllm_version": None}, runs)
    assert r["ready_s_stock"] == 60.0 and r["ready_s_load"] is None and r["graphs"] is None
    assert r["tokens_identical_to_save"] is None and r["load_decode_captures"] is None
    assert r["restore_critical_s"] is None and r["replay_host_us_load"] is None
    assert r["decode_spread"]["load"] is None and r["replay_host_us_stock"] == 19.0
    assert all(k in r for k in bench.SUMMARY_KEYS if k not in ("date", "commit", "machine", "command"))
    assert set(r["errors"]) == {"save", "load"} and r["ok"] is False
    lines = bench.summary_lines(r)
    assert any("SaveError: graph 'decode/x'" in line for line in lines)
    assert bench.summary_lines({})  # never fails, even on an empty result


def test_child_timeouts_leave_room_for_the_later_children():
    assert bench.child_timeout(570, 2, 300) == 300
    assert bench.child_timeout(300, 1, 300) == 180
    assert bench.child_timeout(100, 0, 300) == 80
    assert bench.child_timeout(10, 0, 300) == 30


def test_a_budget_too_small_for_a_run_skips_it_instead_of_starting_it_to_time_out(tmp_path):
    # 240 s for three runs gave SAVE a 30 s timeout on the H200 (2026-12-04): it was started and
    # timed out in the engine's setup. Now it is not started; stock, with the time left, is.
    calls: list = []
    args = bench.parse_args(
        ["--out", str(tmp_path / "r.json"), "--logs", str(tmp_path / "l"), "--workdir", str(tmp_path / "w")]
        + ["--budget", "240"]
    )
    result = bench.run_benchmark(args, launch=_fake_launcher(_runs(), calls))
    assert [c[0] for c in calls] == ["stock"]
    assert calls[0][3] >= bench.MIN_CHILD_S
    assert result["errors"]["save"].startswith("skipped: ")
    assert "200 s of it kept for the 2 run(s) after this one" in result["errors"]["save"]
    assert result["errors"]["load"] == "skipped: the SAVE run failed" and result["ok"] is False


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
    assert result["model"].startswith("benchmarks/cold_start.py MODEL_CONFIG: qwen3 28 layers")
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
    # every child: the same decode work, a deadline inside its timeout, its own step folder
    assert all(c[1]["decode_prompts"] == save_spec["decode_prompts"] for c in calls)
    assert (
        len(save_spec["decode_prompts"]) == 64
        and save_spec["decode_tokens"] == 512
        and save_spec["reps"] == 5
    )
    assert all(c[1]["deadline"] <= time.time() + c[3] - 19 for c in calls)
    assert [c[2][bench.steps.ENV_DIR] for c in calls] == [
        str(tmp_path / "w" / f"steps-{n}") for n in bench.RUN_NAMES
    ]
    assert (tmp_path / "w" / "step-timer" / "foundry_bench_steps.py").is_file()
    assert json.loads((tmp_path / "w" / "model" / "config.json").read_text())["num_hidden_layers"] == 28
    assert save_spec["engine"]["max_model_len"] == 1024 and save_spec["engine"]["max_num_seqs"] == 512


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
