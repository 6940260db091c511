"""benchmarks/cold_start.py without an engine or a GPU: its pure helpers, and one whole benchmark
against a stand-in server (a small HTTP server that answers like an engine and leaves files where an
engine would)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
import types
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cold_start", ROOT / "benchmarks" / "cold_start.py")
cs = importlib.util.module_from_spec(_spec)
sys.modules["cold_start"] = cs  # dataclasses look their module up by name
_spec.loader.exec_module(cs)


def _touch(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- counting what was compiled ------------------------------------------------------------------


def test_foundry_compiles_count_only_files_not_carried(tmp_path):
    root = tmp_path / "foundry-caches" / "foundry-caches-0" / "archive-ab12"
    for rel in (
        "triton/k1/a.cubin",
        "triton/k1/a.json",
        "triton/k2/b.cubin",
        "inductor/fx/g.py",
        "cuda/c.bin",
    ):
        _touch(root / rel)
    _touch(root / "triton" / "k3" / "busy.lock")  # bookkeeping, never counted
    (root / "flashinfer").mkdir()
    stamps = {
        rel: cs._stamp(root / kind / rel) for kind, rel in (("triton", "k1/a.cubin"), ("inductor", "fx/g.py"))
    }
    _touch(root / "inductor" / "fx" / "same.json")
    crc = zlib.crc32((root / "inductor" / "fx" / "same.json").read_bytes())
    carried = {
        "triton": {"k1/a.cubin": stamps["k1/a.cubin"], "k1/a.json": [-1, 0]},
        # written again after it was carried, with the same bytes: no compilation
        "inductor": {"fx/g.py": stamps["fx/g.py"], "fx/same.json": [-1, 0, crc]},
    }
    (root / cs.CARRIED_LIST).write_text(json.dumps(carried))
    examples = {}
    counts = cs.count_foundry_compiles(root.parent.parent, examples)
    # k1/a.json was rewritten after it was carried (its stamp differs): counted with k2/b.cubin.
    assert examples["triton"] == ["k1/a.json (rewritten)", "k2/b.cubin"]
    assert examples["cuda"] == ["c.bin"] and examples["inductor"] == []
    assert counts == {
        "triton": 2,
        "inductor": 0,
        "cuda": 1,
        "flashinfer": 0,
        "total": 3,
        "private_roots": 1,
        "rewritten_unchanged": 1,
    }


def test_foundry_compiles_without_carried_list_counts_everything(tmp_path):
    _touch(tmp_path / "foundry-caches-rank0-x" / "triton" / "a")
    assert cs.count_foundry_compiles(tmp_path)["total"] == 1
    assert cs.count_foundry_compiles(tmp_path / "absent") == {
        "total": 0,
        "private_roots": 0,
        "rewritten_unchanged": 0,
    }


def test_new_files_are_grouped_by_folder(tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    _touch(home / ".triton" / "cache" / "old" / "k.cubin")
    roots = {"home": home, "tmp": tmp}
    before = cs.snapshot(roots)
    assert before == {"home": {".triton/cache/old/k.cubin"}, "tmp": set()}
    for rel in (
        ".cache/flashinfer/90a/cached_ops/x.so",
        ".cache/flashinfer/90a/y.so",
        ".nv/ComputeCache/0/1",
    ):
        _touch(home / rel)
    _touch(home / ".cache" / "huggingface" / "modules" / "__init__.py")
    _touch(home / ".triton" / "cache" / "new" / "k.cubin")
    _touch(tmp / "torchinductor_root" / "fxgraph" / "ab" / "cd")
    _touch(tmp / "loose.txt")
    _touch(tmp / "x.lock")
    result = cs.count_new_files(before, cs.snapshot(roots))
    assert result["compiles"] == {
        "home/.cache/flashinfer": 2,
        "home/.nv/ComputeCache": 1,
        "home/.triton/cache": 1,
        "tmp/torchinductor_root/fxgraph": 1,
        "tmp": 1,
    }
    assert result["not_compiles"] == {"home/.cache/huggingface": 1}
    assert result["total"] == 6
    assert result["examples"]["home/.triton/cache"] == [".triton/cache/new/k.cubin"]


def test_compiled_files_merges_foundry_kinds_and_outside_folders():
    rec = {
        "foundry_cache_files": {"triton": 2, "cuda": 0, "total": 2, "private_roots": 1},
        "outside_files": {"compiles": {"home/.cache/flashinfer": 3}, "total": 3},
    }
    assert cs.compiled_files(rec) == {"triton": 2, "cuda": 0, "home/.cache/flashinfer": 3, "total": 5}
    assert cs.compiled_files({}) == {"total": 0}


# --- logs ------------------------------------------------------------------------------------------

SGLANG_LOG = """\
[    0.020] /usr/lib/python3/warnings.py: FutureWarning: something
[    6.500] [2026-01-01 10:00:06] server_args=ServerArgs(model_path='m', ...)
[   12.000] [2026-01-01 10:00:12 TP0] Load weight begin. avail mem=139.00 GB
[   13.250] [2026-01-01 10:00:13 TP0] Load weight end. elapsed=1.21 s, type=Qwen3ForCausalLM, avail mem=135.0 GB
[   20.000] [2026-01-01 10:00:20 TP0] Capture target decode CUDA graph begin. backend=full, bs=[1, 2, 4, 8], avail mem=40 GB
[   20.500] [2026-01-01 10:00:20 TP0] Compiling kernel with nvcc in 3.5 s
[   31.000] [2026-01-01 10:00:31 TP0] Capture target decode CUDA graph end. elapsed=10.52 s, mem usage=0.5 GB, avail mem=39 GB.
[   31.100] [2026-01-01 10:00:31 TP0] Startup timing: init_memory_pool took 1.500s
[   31.200] [2026-01-01 10:00:31 TP0] Startup timing: init_memory_pool took 0.500s
[   33.000] [2026-01-01 10:00:33 TP0] Foundry rank 0: LOAD 4 graphs
[   35.000] [2026-01-01 10:00:35] The server is fired up and ready to roll!
"""

VLLM_LOG = """\
[    4.100] (APIServer pid=1) INFO 01-01 10:00:04 [api_utils.py:273] non-default args: {'model': 'm'}
[   15.000] (EngineCore pid=2) INFO 01-01 10:00:15 [default_loader.py:431] Loading weights took 0.81 seconds
[   15.100] (EngineCore pid=2) INFO 01-01 10:00:15 [model_runner.py:306] Model loading took 3.2 GiB and 1.234567 seconds
[   22.000] (EngineCore pid=2) INFO 01-01 10:00:22 [backends.py:1156] Dynamo bytecode transform time: 5.10 s
[   30.000] (EngineCore pid=2) INFO 01-01 10:00:30 [backends.py:394] Compiling a graph for compile range (1, 8192) takes 7.25 s
[   30.100] (EngineCore pid=2) INFO 01-01 10:00:30 [monitor.py:20] torch.compile took 12.40 s in total
[   31.000] Capturing CUDA graphs (decode, FULL): 100%|██████████| 67/67 [00:09<00:00]
[   40.000] (EngineCore pid=2) INFO 01-01 10:00:40 [model_runner.py:748] Graph capturing finished in 9 secs, took 0.50 GiB
[   40.700] (EngineCore pid=2) INFO 01-01 10:00:40 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT compilations during inference will use mode=warn.
[   41.000] (EngineCore pid=2) INFO 01-01 10:00:41 [core.py:348] init engine (profile, create kv cache, warmup model) took 25.50 s (compilation: 12.40 s)
[   44.000] (APIServer pid=1) INFO:     Application startup complete.
"""


def _lines(tmp_path: Path, text: str) -> list[tuple[float, str]]:
    path = tmp_path / "run.log"
    path.write_text(text)
    return cs.read_log(path)


def test_read_log_strips_the_stamp(tmp_path):
    lines = _lines(tmp_path, "[    1.500] hello\nno stamp\n[   12.250] [x] y\n")
    assert lines == [(1.5, "hello"), (1.5, "no stamp"), (12.25, "[x] y")]


def test_parse_sglang_log(tmp_path):
    parsed = cs.parse_log(_lines(tmp_path, SGLANG_LOG), "sglang")
    timers = parsed["timers"]
    assert timers["load_weight_s"]["value"] == 1.21 and timers["load_weight_s"]["t_s"] == 13.25
    assert timers["decode_graph_s"]["value"] == 10.52 and timers["decode_graph_s"]["t_s"] == 31.0
    assert timers["startup:init_memory_pool"]["n"] == 2 and timers["startup:init_memory_pool"]["sum"] == 2.0
    assert parsed["marks"] == {
        "imports_done": 6.5,
        "weights_begin": 12.0,
        "graphs_begin": 20.0,
        "graphs_end": 31.0,
        "server_ready_log": 35.0,
    }
    assert parsed["graphs_log"] == 4
    assert parsed["foundry_lines"] == 1
    assert parsed["compile_markers"]["nvcc"] == 1
    assert parsed["compile_markers"]["compiling"] == 1
    assert parsed["compile_markers"]["compile_took"] == 1
    assert parsed["first_line_s"] == 0.02


def test_parse_vllm_log(tmp_path):
    parsed = cs.parse_log(_lines(tmp_path, VLLM_LOG), "vllm")
    t = parsed["timers"]
    assert {k: t[k]["value"] for k in t} == {
        "load_weights_s": 0.81,
        "model_loading_s": 1.234567,
        "dynamo_transform_s": 5.1,
        "compile_graph_s": 7.25,
        "torch_compile_total_s": 12.4,
        "graph_capture_s": 9.0,
        "init_engine_s": 25.5,
    }
    assert parsed["marks"]["imports_done"] == 4.1
    assert parsed["marks"]["graphs_begin"] == 31.0
    assert parsed["marks"]["server_ready_log"] == 44.0
    assert parsed["marks"]["warmups_end"] == 40.7
    assert parsed["graphs_log"] == 67
    assert parsed["compile_markers"]["torch_compile"] == 1
    assert parsed["compile_markers"]["compiling"] == 1


def test_phases_split_the_start():
    rec = {
        "ready_s": 40.0,
        "ttft_s": 41.5,
        "first_request_s": 1.5,
        "log_parse": {"marks": {"imports_done": 6.5}, "timers": {"decode_graph_s": {"value": 10.5}}},
    }
    ph = cs.phases(rec, "sglang")
    assert (
        ph["spawn_imports_s"] == 6.5 and ph["until_ready_s"] == 33.5 and ph["ready_to_first_token_s"] == 1.5
    )
    assert ph["graph_phase_s"] == 10.5 and ph["graph_phase_source"] == "log:decode_graph_s"
    assert ph["setup_s"] == 23.0
    # No engine timer: Foundry's report.
    rec["log_parse"]["timers"] = {}
    rec["foundry_report"] = {"restore_s": 0.8}
    assert cs.phases(rec, "sglang")["graph_phase_source"] == "report:restore_s"


# --- requests and outputs ---------------------------------------------------------------------------


def test_completion_body_per_engine():
    body = cs.completion_body("sglang", "m")
    assert body["prompt"] == cs.PROMPTS and len(body["prompt"]) == 4
    assert body["max_tokens"] == 64 and body["temperature"] == 0 and body["logprobs"] == 5
    assert body["ignore_eos"] is True and body["return_token_ids"] is True
    assert "return_tokens_as_token_ids" not in body
    assert cs.completion_body("vllm", "m")["return_tokens_as_token_ids"] is True
    assert len({json.dumps(p) for p in cs.PROMPTS}) == 4
    assert max(max(p) for p in cs.PROMPTS) < len(cs.tokenizer_vocab())


def test_extract_outputs_orders_choices_and_falls_back_to_logprob_tokens():
    resp = {
        "choices": [
            {
                "index": 1,
                "text": "b",
                "logprobs": {
                    "tokens": ["token_id:7", "token_id:9"],
                    "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"token_id:7": -0.5, "token_id:3": -1.0}, {"token_id:9": -0.25}],
                },
            },
            {"index": 0, "text": "a", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, -2.0]}},
        ]
    }
    out = cs.extract_outputs(resp)
    assert out["tokens"] == [[1, 2], [7, 9]]
    assert out["token_logprobs"] == [[-1.0, -2.0], [-0.5, -0.25]]
    assert out["top_logprobs"][1] == [[["token_id:3", -1.0], ["token_id:7", -0.5]], [["token_id:9", -0.25]]]
    assert out["text"] == ["a", "b"]
    assert cs.outputs_differ(out) is True
    assert cs.outputs_differ({"tokens": [[1], [1]]}) is False
    assert cs.outputs_differ(None) is None


def test_vllm_graph_phase_captures():
    report = {"stream_captures": {"before_warmup": 0, "before_graphs": 3, "end": 3}}
    assert cs.decode_captures("vllm", report) == 0
    assert cs.decode_captures("sglang", {"decode_phase_stream_captures": {"runtime": 0, "driver": 2}}) == 2
    assert cs.decode_captures("sglang", {}) is None


# --- commands, environment, model ---------------------------------------------------------------------


def test_server_commands(tmp_path):
    argv = cs.server_command("sglang", tmp_path, 1234, None)
    joined = " ".join(argv)
    for flag in (
        "-m sglang.launch_server",
        "--load-format dummy",
        "--attention-backend fa3",
        "--sampling-backend pytorch",
        "--cuda-graph-max-bs-decode 512",
        "--cuda-graph-backend-prefill disabled",
        "--mem-fraction-static 0.5",
        "--random-seed 0",
        "--port 1234",
        "--host 127.0.0.1",
    ):
        assert flag in joined
    assert "--enable-foundry" not in argv
    argv = cs.server_command("vllm", tmp_path, 1234, tmp_path / "foundry.toml")
    joined = " ".join(argv)
    assert "vllm.entrypoints.cli.main serve" in joined and "--max-num-seqs 512" in joined
    assert "--max-model-len 4096" in joined and "--seed 0" in joined
    assert argv[-3:] == ["--enable-foundry", "--foundry-config", str(tmp_path / "foundry.toml")]


def test_child_env_keeps_plugin_out_of_stock_and_caches_out_of_every_run(tmp_path):
    base = {
        "PYTHONPATH": "/tmp/site-sglang",
        "TRITON_CACHE_DIR": "/x",
        "XDG_CACHE_HOME": "/y",
        "FOUNDRY_MODE": "save",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    shim = tmp_path / "shim"
    paths = cs.RunPaths.for_run(tmp_path, "stock_cold")
    stock = cs.child_env(base, "sglang", "stock_cold", paths, shim, ["foundry", "other"], "/ub")
    assert stock["SGLANG_PLUGINS"] == "other"
    assert str(shim) not in stock["PYTHONPATH"] and str(cs.SRC) in stock["PYTHONPATH"]
    assert stock["PYTHONPATH"].startswith("/tmp/site-sglang")
    # The same HOME and TMPDIR paths for every run, as in containers of one image.
    assert stock["HOME"] == str(tmp_path / "home") and stock["TMPDIR"] == str(tmp_path / "tmp")
    assert paths.kept_home == tmp_path / "home-stock_cold" and paths.kept_tmp == tmp_path / "tmp-stock_cold"
    assert stock["PYTHONUSERBASE"] == "/ub" and stock["CUDA_VISIBLE_DEVICES"] == "0"
    for key in (
        "TRITON_CACHE_DIR",
        "XDG_CACHE_HOME",
        "FOUNDRY_MODE",
        cs.CACHE_ROOT_ENV,
        cs.SGLANG_REPORT_ENV,
    ):
        assert key not in stock
    for key, value in (("HF_HUB_OFFLINE", "1"), ("PYTHONHASHSEED", "0"), ("FOUNDRY_NO_PROGRESS", "1")):
        assert stock[key] == value

    paths = cs.RunPaths.for_run(tmp_path, "load_warm")
    load = cs.child_env(base, "sglang", "load_warm", paths, shim, ["foundry"])
    assert load["PYTHONPATH"].split(os.pathsep)[0] == str(shim)
    assert "SGLANG_PLUGINS" not in load
    assert load["HOME"] == str(tmp_path / "home")
    assert paths.kept_home == tmp_path / "home-load_cold"  # warm: the cold sibling's caches
    assert load[cs.CACHE_ROOT_ENV] == str(tmp_path / "foundry-caches")  # SAVE's and LOAD's paths agree
    assert load[cs.SGLANG_REPORT_ENV] == str(tmp_path / "report-load_warm")

    vllm_stock = cs.child_env({}, "vllm", "stock_warm", cs.RunPaths.for_run(tmp_path, "stock_warm"), shim, [])
    assert vllm_stock["VLLM_PLUGINS"] == "none" and vllm_stock["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    vllm_load = cs.child_env(
        {"VLLM_PLUGINS": "a"}, "vllm", "save", cs.RunPaths.for_run(tmp_path, "save"), shim, []
    )
    assert vllm_load["VLLM_PLUGINS"] == "a,foundry" and cs.SGLANG_REPORT_ENV not in vllm_load


def test_entry_point_shim_declares_both_engines(tmp_path):
    cs.write_entry_point_shim(tmp_path)
    (info,) = tmp_path.glob("*.dist-info")
    text = (info / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]\nfoundry = foundry_sglang_plugin:register" in text
    assert "[vllm.general_plugins]\nfoundry = foundry_vllm_plugin:register" in text


def test_hand_written_tokenizer_loads(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    for name, data in cs.tokenizer_files().items():
        (tmp_path / name).write_text(json.dumps(data))
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == len(cs.TOKENIZER_SPECIALS) + cs.TOKENIZER_WORDS < 151936 // 10
    assert tok.encode("w0 w1").ids == [3, 4]
    assert tok.token_to_id(cs.EOS_TOKEN) == 2


def test_model_dir_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    assert cs.write_model(tmp_path) == "tokenizers+transformers"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 28 and config["vocab_size"] == 151936
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token == cs.EOS_TOKEN and len(tok) == len(cs.tokenizer_vocab())
    assert tok.decode([3, 4, 100000]) == "w0 w1"  # an id beyond the vocab decodes to nothing
    # The fallback writes the same vocabulary.
    hand = tmp_path / "hand"
    hand.mkdir()
    for name, data in cs.tokenizer_files().items():
        (hand / name).write_text(json.dumps(data))
    assert transformers.AutoTokenizer.from_pretrained(str(hand)).get_vocab() == tok.get_vocab()


def test_purge_spares_what_is_in_use(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    used = cache / "uv" / "python"
    used.mkdir(parents=True)
    other = tmp_path / "torchinductor_root"
    other.mkdir()
    monkeypatch.setattr(cs, "GLOBAL_CACHES", (str(cache), str(tmp_path / "torchinductor_*")))
    done = cs.purge_global_caches([used.resolve()])
    assert done == {"removed": [str(other)], "kept_in_use": [str(cache)]}
    assert used.is_dir() and not other.exists()


def test_parse_args_keeps_the_fixed_order():
    opts = cs.parse_args(["--engine", "vllm", "--out", "o.json", "--logs", "l", "--runs", "stock_cold,save"])
    assert opts.runs == ["save", "stock_cold"]
    with pytest.raises(SystemExit):
        cs.parse_args(["--engine", "vllm", "--out", "o.json", "--logs", "l", "--runs", "bogus"])


def test_repeat_adds_alternating_cold_pairs_that_are_cold_and_foundry_where_their_first_is():
    args = ["--engine", "sglang", "--out", "o.json", "--logs", "l", "--runs", "save,load_cold,stock_cold"]
    opts = cs.parse_args([*args, "--repeat", "3"])
    assert opts.runs == [
        "save",
        "load_cold",
        "stock_cold",
        "load_cold_2",
        "stock_cold_2",
        "load_cold_3",
        "stock_cold_3",
    ]
    assert [cs.kind(r) for r in opts.runs[3:]] == ["load_cold", "stock_cold"] * 2
    assert cs.kind("save") == "save" and cs.kind("load_warm") == "load_warm" and cs.kind("save_2") == "save_2"
    assert cs.parse_args(args).runs == ["save", "load_cold", "stock_cold"]
    with pytest.raises(SystemExit):
        cs.parse_args([*args, "--repeat", "0"])
    with pytest.raises(SystemExit):  # a repeat is not a run one can name, except to resume
        cs.parse_args(["--engine", "sglang", "--out", "o.json", "--logs", "l", "--runs", "load_cold_2"])
    resumed = ["--engine", "sglang", "--out", "o.json", "--logs", "l", "--resume"]
    assert cs.parse_args([*resumed, "--runs", "stock_cold_2,load_warm,load_cold_2"]).runs == [
        "load_warm",
        "load_cold_2",
        "stock_cold_2",
    ]
    with pytest.raises(SystemExit):  # only the cold pair repeats
        cs.parse_args([*resumed, "--runs", "save_2"])


# --- the result document -------------------------------------------------------------------------------


def _run(tokens, lps, ready, ttft, report=None, compiled=None):
    rec = {
        "ok": True,
        "ready_s": ready,
        "ttft_s": ttft,
        "first_request_s": ttft - ready,
        "outputs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": [[]] * len(tokens)},
        "self_consistent": {"tokens": True, "logprobs": True},
        "phases": {"spawn_imports_s": 5.0},
        "log_parse": {"graphs_log": 52},
    }
    if report is not None:
        rec["foundry_report"] = report
    if compiled is not None:
        rec["compiled_files"] = compiled
    return rec


def test_warm_restart_weighs_the_time_saved_against_stocks_compile_warmup_and_capture(tmp_path):
    stock = _run([[1]], [[-1.0]], 44.0, 44.2)
    stock["log_parse"] = cs.parse_log(_lines(tmp_path, VLLM_LOG), "vllm")
    runs = {"stock_warm": stock, "load_warm": _run([[1]], [[-1.0]], 20.0, 20.2)}
    got = cs.warm_restart("vllm", runs)
    # torch.compile 12.4 s, capture 9 s (vLLM's timer), warmups after the graphs 0.7 s
    assert got["stock"] == {"compile_s": 12.4, "warmup_s": 0.7, "capture_s": 9.0}
    assert got["stock_compile_warmup_capture_s"] == 22.1 and got["ready_saved_s"] == 24.0
    assert got["met"] is True
    runs["load_warm"]["ready_s"] = 22.5  # 21.5 s sooner: less than stock's 22.1 s of that work
    assert cs.warm_restart("vllm", runs)["met"] is False
    runs["load_warm"] = {"ok": False, "error": "TimeoutError"}
    assert cs.warm_restart("vllm", runs) is None
    sglang_stock = _run([[1]], [[-1.0]], 50.0, 50.3)
    sglang_stock["log_parse"] = cs.parse_log(_lines(tmp_path, SGLANG_LOG), "sglang")
    sg = cs.warm_restart(
        "sglang", {"stock_warm": sglang_stock, "load_warm": _run([[1]], [[-1.0]], 40.0, 40.3)}
    )
    capture = sglang_stock["log_parse"]["timers"]["decode_graph_s"]["sum"]
    assert sg["stock"] == {"compile_s": None, "warmup_s": None, "capture_s": capture}
    assert capture == 10.52 and sg["met"] is False  # 10 s sooner, stock captured for 10.52 s


def test_assemble_has_every_field():
    toks, lps = [[1, 2], [3, 4], [5, 6], [7, 8]], [[-1.0, -2.0]] * 4
    runs = {
        "save": _run(toks, lps, 60.0, 61.0, {"mode": "save", "graphs": 52, "capture_s": 3.0}),
        "load_cold": _run(
            toks,
            lps,
            30.0,
            31.0,
            {"mode": "load", "graphs": 52, "restore_s": 0.4, "decode_phase_stream_captures": {"a": 0}},
            {"triton": 0, "total": 0},
        ),
        "stock_cold": _run(
            toks, [[-1.0, -2.5]] * 4, 90.0, 92.0, compiled={"home/.triton/cache": 40, "total": 40}
        ),
        "load_warm": {"ok": False, "error": "TimeoutError: boom"},
    }
    meta = {
        "date": "d",
        "commit": "c",
        "machine": "m",
        "command": "x",
        "engine": "sglang",
        "engine_version": "1",
    }
    out = cs.assemble(meta, runs)
    for field in (
        "date",
        "commit",
        "machine",
        "command",
        "engine",
        "engine_version",
        "graphs",
        "ttft_s_stock_cold",
        "ttft_s_load_cold",
        "ready_s_stock_cold",
        "ready_s_load_cold",
        "ttft_s_stock_warm",
        "ttft_s_load_warm",
        "ready_s_stock_warm",
        "ready_s_load_warm",
        "ttft_ratio_cold",
        "load_compiles",
        "load_decode_captures",
        "tokens_identical_to_save",
        "tokens_identical_to_stock",
        "logprobs_identical_to_save",
        "outputs_differ_between_prompts",
        "breakdown",
        "runs",
    ):
        assert field in out, field
    assert out["graphs"] == 52 and out["load_decode_captures"] == 0
    assert out["ttft_ratio_cold"] == round(31.0 / 92.0, 4) and out["ttft_s_load_warm"] is None
    assert out["tokens_identical_to_save"] is True and out["tokens_identical_to_stock"] is True
    assert out["logprobs_identical_to_save"] is True
    assert out["outputs_differ_between_prompts"] is True
    assert out["load_compiles"] == {"triton": 0, "total": 0}
    assert out["modes"] == {"save": "save", "load_cold": "load", "load_warm": None}
    assert out["errors"] == {"load_warm": "TimeoutError: boom"}
    json.dumps(out)  # serialisable as it is
    runs["load_cold"]["outputs"]["token_logprobs"] = [[-1.0, -2.01]] * 4
    assert cs.assemble(meta, runs)["logprobs_identical_to_save"] is False
    assert cs.assemble(meta, {})["tokens_identical_to_save"] is None


# --- one whole benchmark against a stand-in server -----------------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    port = int(sys.argv[sys.argv.index("--port") + 1])
    foundry = "--enable-foundry" in sys.argv
    home = Path(os.environ["HOME"])
    print("[2026-01-01 10:00:00] server_args=ServerArgs(model_path='m')", flush=True)
    time.sleep(0.3)
    print("[t TP0] Capture target decode CUDA graph begin. backend=full, bs=[1, 2, 4], avail mem=1 GB", flush=True)
    print("[t TP0] Capture target decode CUDA graph end. elapsed=0.25 s, mem usage=0 GB", flush=True)
    if not (home / ".cache" / "fake" / "k.so").exists():  # a warm start finds its kernel
        (home / ".cache" / "fake").mkdir(parents=True, exist_ok=True)
        (home / ".cache" / "fake" / "k.so").write_text("kernel")
        print("Compiling kernel k with nvcc", flush=True)
    if foundry:
        root = Path(os.environ["FOUNDRY_CACHE_ROOT"]) / "foundry-caches-rank0-abcd"
        (root / "triton").mkdir(parents=True)
        (root / "triton" / "carried.cubin").write_text("c")
        (root / ".foundry-carried.json").write_text(json.dumps({"triton": ["carried.cubin"]}))
        report = Path(os.environ["FOUNDRY_SGLANG_REPORT_DIR"])
        report.mkdir(parents=True)
        mode = "load" if any(Path(os.environ["FOUNDRY_CACHE_ROOT"]).parent.glob("archive/*")) else "save"
        (report / "rank0.json").write_text(json.dumps(
            {"mode": mode, "graphs": 3, "decode_phase_stream_captures": {"runtime": 0 if mode == "load" else 3}}
        ))
        Path(os.environ["FOUNDRY_CACHE_ROOT"]).parent.joinpath("archive", "graphs.bin").write_text("g")


    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, data):
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._send({"data": [{"id": "fake-model"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            choices = []
            for i, prompt in enumerate(body["prompt"]):
                # A seeded request samples other tokens; this stand-in's stock server samples
                # differently from its Foundry one, so the comparison has something to catch.
                shift = body.get("seed", 0) + ("seed" in body and not foundry)
                ids = [(sum(prompt) * 31 + k + shift) % 151936 for k in range(body["max_tokens"])]
                lps = [-0.5 - (t % 7) / 8 for t in ids]
                tops = [{str(t): lp, "x": lp - 1} for t, lp in zip(ids, lps)]
                choices.append({"index": i, "text": "", "token_ids": ids,
                                "logprobs": {"token_logprobs": lps, "top_logprobs": tops}})
            self._send({"choices": choices, "usage": {"completion_tokens": 4 * body["max_tokens"]}})


    print("[t] The server is fired up and ready to roll!", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def test_whole_benchmark_against_a_stand_in_server(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def command(engine, model_dir, port, toml, **kwargs):
        argv = [sys.executable, str(script), "--port", str(port)]
        return argv + (["--enable-foundry", "--foundry-config", str(toml)] if toml else [])

    monkeypatch.setattr(cs, "server_command", command)
    monkeypatch.setattr(cs, "drop_page_cache", lambda: False)  # not this machine's page cache
    out = tmp_path / "out" / "cold-sglang.json"
    argv = ["--engine", "sglang", "--out", str(out), "--logs", str(tmp_path / "logs")]
    argv += [
        "--workdir",
        str(tmp_path / "work"),
        "--timeout",
        "60",
        "--budget",
        "900",
        "--keep-global-caches",
    ]
    # Cold runs in one call, warm runs in a second one that resumes it (as on a device whose calls
    # each have a time limit).
    rc = cs.main([*argv, "--runs", "save,load_cold,stock_cold", "--profile"])
    assert rc == 0, json.loads(out.read_text()).get("errors")
    rc = cs.main([*argv, "--runs", "load_warm,stock_warm", "--resume"])
    result = json.loads(out.read_text())
    assert rc == 0, result.get("errors")
    assert result["runs_requested"] == list(cs.RUNS) and result["resumed_from"]["date"]
    runs = result["runs"]
    assert list(runs) == list(cs.RUNS) and all(r["ok"] for r in runs.values())
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(f"sglang-{r}.log" for r in cs.RUNS)
    assert result["modes"] == {"save": "save", "load_cold": "load", "load_warm": "load"}
    assert result["graphs"] == 3 and result["load_decode_captures"] == 0
    assert result["tokens_identical_to_save"] is True and result["tokens_identical_to_stock"] is True
    assert result["logprobs_identical_to_save"] is True and result["outputs_differ_between_prompts"] is True
    # Cold runs compile the kernel into their fresh HOME; warm runs find it there.
    assert result["load_compiles"] == {"triton": 0, "home/.cache/fake": 1, "total": 1}
    assert runs["stock_cold"]["compiled_files"] == {"home/.cache/fake": 1, "total": 1}
    assert (
        runs["load_warm"]["compiled_files"]["total"] == 0
        and runs["stock_warm"]["compiled_files"]["total"] == 0
    )
    assert runs["load_warm"]["prepare"]["home_reused"] is True
    assert {r["env_changes"]["set"]["HOME"] for r in runs.values()} == {str(tmp_path / "work" / "home")}
    # --profile reaches Foundry's runs only (the stock server does not load Foundry at all).
    profiled = {name for name, r in runs.items() if cs.PROFILE_ENV in r["env_changes"]["set"]}
    assert profiled == {"save", "load_cold"}
    assert runs["stock_cold"]["log_parse"]["compile_markers"]["nvcc"] == 1
    assert runs["stock_warm"]["log_parse"]["compile_markers"]["nvcc"] == 0
    for name in cs.RUNS:
        r = runs[name]
        assert 0 < r["ready_s"] <= r["ttft_s"] and r["self_consistent"] == {"tokens": True, "logprobs": True}
        assert r["phases"]["spawn_imports_s"] <= r["ready_s"]
    assert result["breakdown"]["graph_phase_s"] == 0.25
    assert result["foundry_lines_in_stock_logs"] == {"stock_cold": 0, "stock_warm": 0}
    assert isinstance(result["ttft_ratio_cold"], float)
    png = out.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result["chart"] is None
    else:
        assert result["chart"] == str(png) and png.stat().st_size > 1000


def test_seeded_weights_sampling_and_max_tokens(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    seen = []

    def command(engine, model_dir, port, toml, **kwargs):
        seen.append(kwargs)
        argv = [sys.executable, str(script), "--port", str(port)]
        return argv + (["--enable-foundry", "--foundry-config", str(toml)] if toml else [])

    def weights(model_dir, seed):  # foundry_tools.weights itself is tested in tests/test_weights.py
        (model_dir / "model.safetensors").write_bytes(b"w")
        return {"seed": seed}

    monkeypatch.setattr(cs, "server_command", command)
    monkeypatch.setattr(cs, "write_seeded_weights", weights)
    monkeypatch.setattr(cs, "drop_page_cache", lambda: False)
    config = tmp_path / "moe.json"
    config.write_text(json.dumps({**cs.MODEL_CONFIG, "architectures": ["Qwen3MoeForCausalLM"]}))
    out = tmp_path / "m.json"
    argv = ["--engine", "sglang", "--out", str(out), "--logs", str(tmp_path / "logs"), "--keep-global-caches"]
    argv += ["--workdir", str(tmp_path / "w"), "--runs", "save,load_cold,stock_cold", "--timeout", "60"]
    argv += [
        "--model-config",
        str(config),
        "--weights",
        "seeded",
        "--seed",
        "7",
        "--max-tokens",
        "8",
        "--sampling",
    ]
    assert cs.main(argv) == 0
    result = json.loads(out.read_text())
    assert seen == [{"dummy": False}] * 3 and result["seeded_weights"] == {"seed": 7}
    assert json.loads((tmp_path / "w" / "model" / "config.json").read_text())["architectures"] == [
        "Qwen3MoeForCausalLM"
    ]
    load = result["runs"]["load_cold"]
    assert all(len(t) == 8 for t in load["outputs"]["tokens"]) and result["distinct_outputs"] == 4
    assert load["outputs_sampled"]["tokens"] != load["outputs"]["tokens"] and load["self_consistent_sampled"]
    assert result["logprobs_identical_to_stock"] is True and result["sampled_identical_to_save"] is True
    assert result["sampled_identical_to_stock"] is False  # the stand-in's stock server samples otherwise
    assert result["sampling"] == cs.SAMPLING


def test_server_command_reads_the_files_unless_dummy(tmp_path):
    assert "--load-format" not in cs.server_command("sglang", tmp_path, 1, None, dummy=False)
    assert "--load-format" not in cs.server_command("vllm", tmp_path, 1, None, dummy=False)
    body = cs.completion_body("vllm", "m", 300, cs.SAMPLING)
    assert body["max_tokens"] == 300 and body["seed"] == 4321 and body["temperature"] == 0.8


def test_resume_refuses_another_benchmarks_result(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"engine": "sglang", "commit": cs.commit(), "workdir": "/elsewhere"}))
    argv = ["--engine", "sglang", "--out", str(out), "--logs", str(tmp_path / "logs")]
    argv += ["--workdir", str(tmp_path / "w"), "--runs", "load_warm", "--resume"]
    with pytest.raises(SystemExit, match="another benchmark's result"):
        cs.main(argv)


def test_a_server_that_dies_is_recorded_and_the_benchmark_goes_on(tmp_path, monkeypatch):
    def command(engine, model_dir, port, toml, **kwargs):
        code = "import sys; print('Traceback (most recent call last):'); print('boom'); sys.exit(3)"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(cs, "server_command", command)
    monkeypatch.setattr(cs, "drop_page_cache", lambda: False)
    out = tmp_path / "r.json"
    argv = ["--engine", "vllm", "--out", str(out), "--logs", str(tmp_path / "logs"), "--keep-global-caches"]
    argv += ["--workdir", str(tmp_path / "w"), "--runs", "save,load_cold,stock_cold", "--timeout", "30"]
    assert cs.main(argv) == 1
    result = json.loads(out.read_text())
    save, load, stock = (result["runs"][r] for r in ("save", "load_cold", "stock_cold"))
    assert "exited with status 3" in save["error"] and "boom" in save["log_tail"]
    assert save["exit_code"] == 3 and save["log_parse"]["tracebacks"] == 1
    assert load["skipped"] and "SAVE" in load["error"]
    assert "exited with status 3" in stock["error"]
    assert result["ttft_s_stock_cold"] is None and result["ttft_ratio_cold"] is None
    assert set(result["errors"]) == {"save", "load_cold", "stock_cold"}


def test_cold_repeats_give_each_pairs_ratio_its_median_and_spread():
    toks, lps = [[1, 2], [3, 4]], [[-1.0, -2.0]] * 2
    runs = {
        "save": _run(toks, lps, 60.0, 61.0),
        "load_cold": _run(toks, lps, 40.0, 40.0),
        "stock_cold": _run(toks, lps, 100.0, 100.0),
        "load_cold_2": _run(toks, lps, 45.0, 45.0),
        "stock_cold_2": _run(toks, lps, 100.0, 100.0),
        "load_cold_3": _run(toks, lps, 60.0, 60.0),
        "stock_cold_3": {"ok": False, "error": "TimeoutError"},  # a pair with a failed run has no ratio
    }
    out = cs.cold_repeats(runs)
    assert out["ttft_s_load_cold_runs"] == [40.0, 45.0, 60.0]
    assert out["ttft_s_stock_cold_runs"] == [100.0, 100.0, None]
    assert out["ttft_ratio_cold_pairs"] == [0.4, 0.45, None]
    assert out["ttft_ratio_cold_median"] == 0.425
    assert out["ttft_ratio_cold_spread"] == round(0.05 / 0.425, 4)
    assert out["repeated_loads_identical_to_save"] is True
    runs["load_cold_2"]["outputs"]["tokens"] = [[1, 2], [3, 5]]
    assert cs.cold_repeats(runs)["repeated_loads_identical_to_save"] is False
    # Stock against stock: unknown while a repeat has no outputs, then whether they agree.
    assert out["repeated_stocks_identical_to_stock"] is None
    two = {k: v for k, v in runs.items() if k != "stock_cold_3"}
    assert cs.cold_repeats(two)["repeated_stocks_identical_to_stock"] is True
    two["stock_cold_2"] = _run([[1, 2], [3, 9]], lps, 100.0, 100.0)
    assert cs.cold_repeats(two)["repeated_stocks_identical_to_stock"] is False
    one = cs.cold_repeats({k: runs[k] for k in ("save", "load_cold", "stock_cold")})
    assert one["ttft_ratio_cold_pairs"] == [0.4] and one["ttft_ratio_cold_spread"] is None
    assert "cold pairs" in "\n".join(cs.summary_lines(cs.assemble({"engine": "sglang"}, runs)))


def test_the_summary_shows_what_the_cold_loads_start_report_says_of_foundrys_own_time():
    report = {"restore_s": 0.11, "prepared": True, "prepared_ready": True, "prepared_s": 0.31, "graphs": 52}
    report["begin_s"] = {"total_s": 0.9, "check_archive_s": 0.4}
    result = {"engine": "sglang", "runs": {"load_cold": {"foundry_report": report}}}
    (line,) = [x for x in cs.summary_lines(result) if x.startswith("  LOAD report:")]
    shown = json.loads(line.split(":", 1)[1])
    assert shown == {k: v for k, v in report.items() if k != "graphs"}
    assert not [x for x in cs.summary_lines({"engine": "sglang"}) if "LOAD report" in x]


def test_engine_settings_for_every_run_are_parsed_and_checked():
    args = ["--engine", "vllm", "--out", "o.json", "--logs", "l"]
    opts = cs.parse_args(
        [*args, "--engine-env", "VLLM_USE_V2_MODEL_RUNNER=1", "--engine-arg=--no-enable-prefix-caching"]
    )
    assert opts.engine_env == ["VLLM_USE_V2_MODEL_RUNNER=1"] and opts.engine_arg == [
        "--no-enable-prefix-caching"
    ]
    with pytest.raises(SystemExit):
        cs.parse_args([*args, "--engine-env", "VLLM_USE_V2_MODEL_RUNNER"])


def test_a_load_run_that_saved_instead_is_failed_and_compared_with_nothing():
    toks, lps = [[1, 2], [3, 4]], [[-1.0, -2.0]] * 2
    save_report = {
        "mode": "save",
        "graphs": 52,
        "decode_phase_stream_captures": {"driver": 52, "runtime": 52},
    }
    runs = {
        "save": _run(toks, lps, 60.0, 61.0, report=save_report),
        "stock_cold": _run(toks, lps, 100.0, 100.0),
    }
    # The archive was gone, so the auto-mode "LOAD" captured and saved: same tokens, but no LOAD.
    load = _run(toks, lps, 59.0, 60.0, report=dict(save_report), compiled={"total": 3})
    load.update(name="load_cold", foundry=True)
    cs.judge_foundry_run(load)
    assert load["ok"] is False and "mode 'save', not 'load'" in load["error"]
    assert load["not_counted"]["ttft_s"] == 60.0 and "outputs" not in load and "ttft_s" not in load
    runs["load_cold"] = load
    result = cs.assemble({"engine": "sglang"}, runs)
    assert result["tokens_identical_to_save"] is None and result["logprobs_identical_to_stock"] is None
    assert result["ttft_s_load_cold"] is None and result["ttft_ratio_cold"] is None
    assert result["load_decode_captures"] is None and result["load_compiles"] is None
    assert result["modes"] == {"save": "save", "load_cold": "save"}
    assert "load_cold" in result["errors"]
    # A LOAD that ran as a LOAD is left alone; a failed one gains Foundry's own first error line.
    good = _run(toks, lps, 40.0, 41.0, report={"mode": "load"})
    good.update(name="load_cold_2", foundry=True)
    cs.judge_foundry_run(good)
    assert good["ok"] is True and "error" not in good and good["ttft_s"] == 41.0
    died = {"name": "load_cold", "foundry": True, "ok": False, "error": "ServerDied: status -9"}
    died["foundry_report"] = {
        "mode": "load",
        "ok": False,
        "error": "Exception: cuGraphAddKernelNode failed\nmore",
    }
    cs.judge_foundry_run(died)
    assert died["error"] == "ServerDied: status -9; Foundry: Exception: cuGraphAddKernelNode failed"


def test_one_prompt_per_request_sends_each_prompt_alone_and_answers_like_one_request():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["prompt"])
            choices = [
                {
                    "index": i,
                    "token_ids": [sum(p)],
                    "logprobs": {"token_logprobs": [-1.0], "top_logprobs": []},
                }
                for i, p in enumerate(body["prompt"])
            ]
            raw = json.dumps({"choices": choices, "usage": {"n": len(choices)}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        body = cs.completion_body("vllm", "m", 4)
        deadline = cs.time.monotonic() + 30
        status, together, _ = cs.complete(base, body, deadline, one_by_one=False)
        assert status == 200 and seen == [cs.PROMPTS]
        seen.clear()
        status, alone, first = cs.complete(base, body, deadline, one_by_one=True)
        assert status == 200 and seen == [[p] for p in cs.PROMPTS] and first <= cs.time.monotonic()
        assert cs.extract_outputs(alone) == cs.extract_outputs(together)
        assert [c["index"] for c in alone["choices"]] == list(range(len(cs.PROMPTS)))
    finally:
        server.shutdown()


def test_resume_refuses_runs_that_sent_their_requests_otherwise(tmp_path):
    out = tmp_path / "r.json"
    earlier = {"engine": "sglang", "commit": cs.commit(), "workdir": str((tmp_path / "w").resolve())}
    earlier.update(max_tokens=cs.MAX_TOKENS, sampling=None, one_prompt_per_request=True)
    out.write_text(json.dumps(earlier))
    argv = ["--engine", "sglang", "--out", str(out), "--logs", str(tmp_path / "logs")]
    argv += ["--workdir", str(tmp_path / "w"), "--runs", "stock_cold", "--resume"]
    with pytest.raises(SystemExit, match="'one_prompt_per_request': False"):
        cs.main(argv)


def test_autotune_records_are_kept_whole_for_comparison(tmp_path):
    root = tmp_path / "foundry-caches" / "foundry-caches-0" / "archive-ab12"
    _touch(root / "vllm" / "c" / "k1.best_config", '{"XBLOCK": 64, "num_warps": 4}')
    _touch(root / "vllm" / "d" / "k2.best_config", '{"XBLOCK": 128, "num_warps": 8}')
    _touch(root / "vllm" / "d" / "k2.py", "kernel source: not a record")
    everything = cs.autotune_records(tmp_path / "foundry-caches")
    assert everything == {
        "vllm/c/k1.best_config": '{"XBLOCK": 64, "num_warps": 4}',
        "vllm/d/k2.best_config": '{"XBLOCK": 128, "num_warps": 8}',
    }
    assert list(cs.autotune_records(tmp_path / "foundry-caches", {"vllm/d/k2.best_config"})) == [
        "vllm/d/k2.best_config"
    ]
    assert cs.autotune_records(tmp_path / "absent") == {}


def test_a_resume_needs_the_same_server_arguments(tmp_path):
    """Runs compared across calls must have started their servers alike; a result written before the
    arguments were kept gives them back from its command line."""
    setting = '--compilation-config={"inductor_compile_config":{"dynamic_scale_rblock":false}}'
    out = tmp_path / "r.json"
    earlier = {
        "engine": "vllm",
        "commit": "abc1234",
        "max_tokens": 64,
        "sampling": None,
        "one_prompt_per_request": False,
        "workdir": str(tmp_path.resolve()),
        "command": f"cold_start.py --engine vllm --engine-arg={setting} --engine-env VLLM_X=1",
        "runs": {"save": {"ok": True}},
    }
    out.write_text(json.dumps(earlier))
    meta = {k: earlier[k] for k in ("engine", "commit", "max_tokens", "sampling", "one_prompt_per_request")}
    opts = types.SimpleNamespace(workdir=str(tmp_path), runs=["stock_cold"])
    assert cs.resumed_runs(out, {**meta, "engine_args": [setting], "engine_env": ["VLLM_X=1"]}, opts) == {
        "save": {"ok": True}
    }
    with pytest.raises(SystemExit, match="another benchmark's result"):
        cs.resumed_runs(out, {**meta, "engine_args": [], "engine_env": ["VLLM_X=1"]}, opts)


# --- the start-up stack sampler (--sample-stacks) --------------------------------------------------


def test_stack_sampler_follows_forked_children_and_names_imports(tmp_path):
    import subprocess

    import startup_stacks

    shim = startup_stacks.write_shim(tmp_path / "shim")
    mod = tmp_path / "mods"
    _touch(mod / "slow_module.py", "import time\ntime.sleep(0.4)\n")
    script = "import os, time\npid = os.fork()\nif pid == 0:\n    import slow_module\n    os._exit(0)\nos.waitpid(pid, 0)\ntime.sleep(0.2)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(mod)]))
    env[startup_stacks.ENV] = str(tmp_path / "out")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    files = sorted((tmp_path / "out").glob("stacks-*.jsonl"))
    assert len(files) == 2  # the parent and its forked child each wrote their own
    summary = startup_stacks.summarize(tmp_path / "out")
    assert "import slow_module" in summary
    # Without the variable the shim records nothing.
    env.pop(startup_stacks.ENV)
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    assert len(sorted((tmp_path / "out").glob("stacks-*.jsonl"))) == 2


def test_the_log_names_the_engine_settings_a_foundry_start_set(monkeypatch, caplog):
    from foundry_core.engine import launch_env
    from foundry_vllm_plugin.session import launch_settings

    settings = launch_settings()
    for name in settings:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_env, "initial_environment", lambda: {})
    with caplog.at_level("INFO"):
        done = launch_env.apply(settings)  # the line Foundry's launcher logs
    launch_env.undo()
    lines = [(float(i), r.getMessage()) for i, r in enumerate(caplog.records)]
    assert cs.parse_log(lines, "vllm")["launch_settings"] == done
    assert done["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert "launch_settings" not in cs.parse_log([(1.0, "no settings here")], "vllm")


def test_every_ranks_start_report_is_kept_beside_rank_0s(tmp_path):
    (tmp_path / "rank0.json").write_text('{"rank": 0}')
    (tmp_path / "rank1.json").write_text('{"rank": 1, "graphs": 1}')
    (tmp_path / "rank3.json").write_text("{not json")
    (tmp_path / "rank0.start.json").write_text("{}")
    paths = types.SimpleNamespace(report_dir=tmp_path)
    got = cs.other_rank_reports(types.SimpleNamespace(engine="sglang"), paths)
    assert got["1"] == {"rank": 1, "graphs": 1} and "unreadable" in got["3"] and set(got) == {"1", "3"}
    assert cs.other_rank_reports(types.SimpleNamespace(engine="vllm"), paths) == {}


def test_tensor_parallel_runs_get_one_row_per_rank_from_every_ranks_reports():
    toks, lps = [[1, 2], [3, 4]], [[-1.0, -2.0]] * 2

    def reports(mode, key, seconds, captures, collectives=None):
        rank0 = {
            "mode": mode,
            "graphs": 1,
            key: seconds,
            "decode_phase_stream_captures": {"driver": captures},
        }
        other = dict(rank0, **{key: round(seconds + 0.1, 4)})
        if collectives is not None:
            rank0["collectives"], other["collectives"] = collectives, {"symm_mem": 3}
        return rank0, {"1": other, "2": {"unreadable": "rank2.json: boom"}}

    save0, save_others = reports("save", "capture_s", 3.0, 1)
    load0, load_others = reports("load", "restore_s", 0.2, 0, {"symm_mem": 3, "nccl": 0})
    runs = {
        "save": {**_run(toks, lps, 60.0, 61.0, save0), "foundry_rank_reports": save_others},
        "load_cold": {**_run(toks, lps, 30.0, 31.0, load0), "foundry_rank_reports": load_others},
    }
    out = cs.assemble({"engine": "sglang"}, runs)
    rows = {r["rank"]: r for r in out["ranks"]}
    assert set(rows) == {0, 1, 2}
    assert rows[1]["capture_s"] == 3.1 and rows[1]["restore_s"] == 0.3 and rows[1]["graphs"] == 1
    assert rows[0]["load_decode_captures"] == 0 and rows[0]["save_decode_captures"] == 1
    assert rows[1]["symm_mem_collectives"] == 3 and rows[1]["nccl_kernels"] == 0
    assert rows[2]["graphs"] is None and rows[2]["nccl_kernels"] is None  # nothing known is not 0
    assert "rank 1: graphs 1, capture 3.1 s, restore 0.3 s" in "\n".join(cs.summary_lines(out))
    # one rank: no rows
    one = {"save": _run(toks, lps, 60.0, 61.0, save0), "load_cold": _run(toks, lps, 30.0, 31.0, load0)}
    assert cs.assemble({"engine": "sglang"}, one)["ranks"] is None


def test_load_is_compared_with_each_stock_run_and_stock_with_its_own_restart():
    # As vLLM 0.26 did at 4adbae1: the cold stock start differs from the warm one, LOAD matches SAVE
    # and the warm stock run; LOAD == stock_cold alone would read as a Foundry fault.
    lps = [[-1.0, -2.0]] * 2
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 7]]
    runs = {
        "save": _run(same, lps, 60.0, 61.0),
        "load_cold": _run(same, lps, 40.0, 40.0),
        "stock_cold": _run(other, lps, 100.0, 100.0),
        "stock_warm": _run(same, lps, 80.0, 80.0),
    }
    out = cs.assemble({"engine": "vllm"}, runs)
    assert out["tokens_identical_to_stock"] is False
    assert out["stock_warm_identical_to_stock_cold"] is False
    assert out["load_identical_to_stock_runs"] == {"stock_cold": False, "stock_warm": True}
    assert "stock warm == stock cold False" in "\n".join(cs.summary_lines(out))
    runs["stock_cold"] = _run(same, lps, 100.0, 100.0)
    out = cs.assemble({"engine": "vllm"}, runs)
    assert out["stock_warm_identical_to_stock_cold"] is True
    del runs["stock_warm"]
    assert cs.assemble({"engine": "vllm"}, runs)["stock_warm_identical_to_stock_cold"] is None


def test_results_text_is_the_same_json_with_number_lists_on_one_line():
    data = {
        "runs": {"save": {"outputs": {"tokens": [[1, 2, 3], [4, 5]], "top_logprobs": [[["t:1", -0.5]]]}}},
        "empty": {},
        "none": None,
        "pairs": [0.3, 0.29],
        "rows": [{"case": "a", "s": 1.5}, {"case": "b"}],
        "tuple": (1, 2),
        "path": Path("/x"),
    }
    text = cs.results_text(data)
    assert json.loads(text) == json.loads(json.dumps(data, default=str))
    assert '"tokens": [[1, 2, 3], [4, 5]]' in text and '"pairs": [0.3, 0.29]' in text
    assert '\n  "runs": {\n' not in text and '\n "runs": {\n' in text  # one space per level, as indent=1
    assert len(text) < len(json.dumps(data, indent=1, default=str))
