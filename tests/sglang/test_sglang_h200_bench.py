"""benchmarks/sglang_h200.py without a GPU: its arguments, the runs' configuration and environment
(SGLang's own plugin loader included), result assembly with the decode fields, the summary, and the
parent's handling of runs that fail, hang or never start (fake runs). The decode measurement itself
(benchmarks/engine_steps.py) is tested in tests/test_engine_steps_bench.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_h200.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sglang_h200_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_fit_one_device_call(bench):
    opts = bench.parse_args(["--out", "x.json", "--logs", "logs"])
    assert (opts.out, opts.logs, opts.child) == ("x.json", "logs", None)
    # three runs inside one 600 s device call (run_h200_engines.sh passes its own, smaller budget)
    assert opts.timeout == 300 and opts.budget <= 585
    # the 52 decode graphs of the cold-start benchmark, the 1.7B shape; 0 leaves the list to SGLang
    assert opts.max_bs == 512 and opts.model_config is None
    assert bench.parse_args(["--max-bs", "0"]).max_bs is None
    assert (opts.decode_prompts, opts.decode_tokens, opts.reps) == (64, 512, 5)
    assert opts.step_timing and opts.replay_timing == 150 and len(bench.PROMPTS) == 8


def test_the_former_small_setup_is_two_options(bench, tmp_path):
    opts = bench.parse_args(["--model-config", str(bench.TINY_CONFIG), "--max-bs", "8"])
    assert opts.decode_prompts == 8  # one decode batch inside the largest graph
    assert bench.engine_kwargs(opts, str(tmp_path))["cuda_graph_max_bs_decode"] == 8
    assert bench.model_config(opts.model_config)["num_hidden_layers"] == 4
    assert bench.parse_args(["--max-bs", "8", "--decode-prompts", "4"]).decode_prompts == 4


def test_bad_counts_are_refused(bench):
    for bad in (["--reps", "0"], ["--max-bs", "-1"], ["--decode-prompts", "0"], ["--decode-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_default_model_is_qwen3_1_7b_shaped(bench):
    config = bench.model_config(None)
    expected = {
        "num_hidden_layers": 28,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    assert {k: config[k] for k in expected} == expected


def test_every_run_has_the_same_engine_configuration(bench, plugins_loaded, tmp_path):
    from sglang.srt.server_args import ServerArgs

    opts = bench.parse_args([])
    kwargs = bench.engine_kwargs(opts, str(tmp_path))
    assert kwargs["cuda_graph_backend_prefill"] == "disabled"
    assert kwargs["random_seed"] == 0 and kwargs["load_format"] == "dummy"
    assert kwargs["cuda_graph_max_bs_decode"] == 512 and "cuda_graph_bs_decode" not in kwargs
    own = bench.engine_kwargs(bench.parse_args(["--max-bs", "0"]), str(tmp_path))
    assert "cuda_graph_max_bs_decode" not in own  # SGLang's own list
    # msgspec record (0.5.20+) or dataclass (before)
    fields = getattr(ServerArgs, "__struct_fields__", None) or tuple(ServerArgs.__dataclass_fields__)
    small = bench.engine_kwargs(bench.parse_args(["--max-bs", "8"]), str(tmp_path))
    paired = bench.engine_kwargs(bench.parse_args(["--paired"]), str(tmp_path))  # KV tokens pinned
    missing = [name for name in {**kwargs, **small, **paired} if name not in fields]
    assert missing == [], f"fields this SGLang release does not have: {missing}"


def test_the_engine_configuration_is_one_foundry_accepts(bench, plugins_loaded, model_dir, tmp_path):
    from sglang.srt.server_args import ServerArgs

    import foundry_sglang_plugin
    from foundry_core.config import load_config

    opts = bench.parse_args([])
    toml = tmp_path / "foundry.toml"
    toml.write_text(bench.foundry_toml(tmp_path / "archive", opts.region_size))
    cfg = load_config(toml)
    assert cfg.mode == "auto" and cfg.archive_dir == tmp_path / "archive"
    assert cfg.region_size == 96 << 30
    big = tmp_path / "qwen3-1.7b"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(bench.model_config(None)))
    for directory in (model_dir, big):  # the former tiny model and the default one
        # device given: resolution must not look for a GPU here (older releases do when it is unset)
        server_args = ServerArgs(**bench.engine_kwargs(opts, str(directory)), device="cuda")
        foundry_sglang_plugin.enable(server_args, toml)
        foundry_sglang_plugin.check_supported(server_args)


def test_log_files_are_six_plain_names(bench):
    names = [n for kind in bench.RUNS for n in bench.log_names(kind)]
    assert len(set(names)) == 6
    assert all(bench.LOG_NAME.match(n) for n in names)


def test_environment_names_are_the_plugins(bench):
    """The script spells the plugin's environment names out (its stock child must not import the
    plugin); they must stay the plugin's own."""
    from foundry_sglang_plugin import replay_timing, session, settings

    assert bench.REPORT_ENV == session.REPORT_ENV and bench.TIMING_ENV == replay_timing.ENV
    assert bench.SETTINGS_ENV == (
        settings.ENV_MARKER,
        *settings.ENV_KEYS,
        session.REPORT_ENV,
        replay_timing.ENV,
    )


def test_run_environments(bench, tmp_path):
    base = {
        "PYTHONPATH": "/tmp/site",
        "FOUNDRY_MODE": "load",
        "FOUNDRY_SGLANG": "1",
        "FOUNDRY_COMMIT": "abc",
        "FOUNDRY_CUPTI": "/x/libcupti.so",
    }
    shim = tmp_path / "shim"
    stock = bench.run_env("stock", base, tmp_path, shim, ["foundry", "other"])
    assert stock["SGLANG_PLUGINS"] == "other" and bench.REPORT_ENV not in stock
    assert stock["PYTHONPATH"].split(":") == [str(bench.SRC), "/tmp/site"]
    assert "FOUNDRY_MODE" not in stock and "FOUNDRY_SGLANG" not in stock  # no settings from outside
    assert stock["FOUNDRY_COMMIT"] == "abc" and stock["FOUNDRY_CUPTI"] == "/x/libcupti.so"
    assert bench.run_env("stock", base, tmp_path, shim, ["foundry"])["SGLANG_PLUGINS"] == "none"
    assert stock["PYTHONHASHSEED"] == "0" and stock["HF_HUB_OFFLINE"] == "1"

    save = bench.run_env("save", base, tmp_path, shim, ["foundry"])
    assert save["PYTHONPATH"].split(":") == [str(shim), str(bench.SRC), "/tmp/site"]
    assert save[bench.REPORT_ENV] == str(tmp_path / "report-save") and "SGLANG_PLUGINS" not in save
    # the replay-timing switch comes from --replay-timing only, never from the calling shell
    inherited = {**base, bench.TIMING_ENV: "999"}
    assert bench.TIMING_ENV not in bench.run_env("save", inherited, tmp_path, shim, ["foundry"])
    assert bench.run_env("load", inherited, tmp_path, shim, ["foundry"], 150)[bench.TIMING_ENV] == "150"
    narrowed = bench.run_env("load", {**base, "SGLANG_PLUGINS": "other"}, tmp_path, None, [])
    assert narrowed["SGLANG_PLUGINS"] == "other,foundry"
    assert bench.steps.ENV_DIR not in narrowed


def test_run_environments_with_the_step_timer(bench, tmp_path):
    base = {"PYTHONPATH": "/tmp/site", bench.steps.ENV_DIR: "/elsewhere", "SGLANG_PLUGINS": ""}
    shim, timer = tmp_path / "shim", tmp_path / "step-timer"
    envs = {k: bench.run_env(k, base, tmp_path, shim, ["foundry", "other"], 0, timer) for k in bench.RUNS}
    for kind, env in envs.items():
        assert env[bench.steps.ENV_DIR] == str(tmp_path / f"steps-{kind}")  # never the shell's
        assert env["PYTHONPATH"].split(":")[0] == str(timer)
    # stock: the timer is allowed, Foundry is not
    assert envs["stock"]["SGLANG_PLUGINS"] == "other,foundry_bench_steps"
    assert bench.run_env("stock", base, tmp_path, shim, ["foundry"], 0, timer)["SGLANG_PLUGINS"] == (
        "foundry_bench_steps"
    )
    assert "SGLANG_PLUGINS" not in envs["save"] or envs["save"]["SGLANG_PLUGINS"] == ""
    narrowed = bench.run_env("save", {**base, "SGLANG_PLUGINS": "other"}, tmp_path, shim, [], 0, timer)
    assert narrowed["SGLANG_PLUGINS"] == "other,foundry,foundry_bench_steps"
    assert envs["save"]["PYTHONPATH"].split(":")[:3] == [str(timer), str(shim), str(bench.SRC)]


def test_sglangs_loader_loads_the_step_timer_in_every_run_and_foundry_only_in_foundry_runs(
    bench, tmp_path, fresh_python
):
    """The environments as run_env builds them, read by SGLang's own plugin loader in a fresh process."""
    timer = bench.steps.write_plugin(tmp_path / "step-timer")
    shim = bench.make_entry_point_shim(tmp_path / "shim")
    plugins = bench.general_plugins()
    code = """
        import json
        from sglang.srt.plugins import load_plugins_by_group
        print(json.dumps(sorted(load_plugins_by_group("sglang.srt.plugins"))))
    """
    base = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    for kind in ("stock", "save"):
        env = bench.run_env(kind, base, tmp_path, shim, plugins, 0, timer)
        loaded = fresh_python(code, env=env)
        assert "foundry_bench_steps" in loaded, (kind, loaded)
        assert ("foundry" in loaded) is (kind != "stock"), (kind, loaded)


def test_entry_point_shim_names_the_plugin_like_the_package_does(bench, tmp_path):
    from importlib.metadata import distributions

    root = bench.make_entry_point_shim(tmp_path / "shim")
    (dist,) = distributions(path=[str(root)])
    assert dist.metadata["Name"] == "foundry-graphs"
    (ep,) = dist.entry_points
    assert (ep.group, ep.name, ep.value) == (
        "sglang.srt.plugins",
        "foundry",
        "foundry_sglang_plugin:register",
    )
    pyproject = (bench.REPO / "pyproject.toml").read_text()
    assert 'foundry = "foundry_sglang_plugin:register"' in pyproject


def test_sglang_log_lines_are_read(bench):
    text = (
        "[2026-11-30 06:00:01] Capture target decode CUDA graph begin. backend=full, "
        "num_tokens_per_req=1, bs=[1, 2, 4, 8], avail mem=90.12 GB\n"
        "[2026-11-30 06:00:02] Capture target decode CUDA graph end. elapsed=1.13 s, mem usage=0.05 GB\n"
    )
    assert bench.parse_logs(text) == {
        "log_decode_graph_bs": [1, 2, 4, 8],
        "log_decode_graph_phase_s": 1.13,
        "log_tracebacks": 0,
    }


def test_a_run_gets_the_parents_options(bench, tmp_path):
    opts = bench.parse_args(["--decode-tokens", "256", "--reps", "7", "--max-bs", "16"])
    argv = bench.child_argv("load", opts, tmp_path, tmp_path / "r.json", deadline=1234.5)
    child = bench.parse_args(argv[2:])
    assert child.child == "load" and child.deadline == 1234.5
    for key in ("decode_tokens", "reps", "max_bs", "decode_prompts", "new_tokens", "mem_fraction_static"):
        assert getattr(child, key) == getattr(opts, key), key
    assert bench.engine_kwargs(child, "m") == bench.engine_kwargs(opts, "m")
    default = bench.parse_args([])
    child = bench.parse_args(bench.child_argv("stock", default, tmp_path, tmp_path / "r.json")[2:])
    assert child.max_bs == 512 and child.deadline is None and child.decode_prompts == 64
    own = bench.parse_args(["--max-bs", "0"])
    child = bench.parse_args(bench.child_argv("stock", own, tmp_path, tmp_path / "r.json")[2:])
    assert child.max_bs is None  # the child leaves the list to SGLang too
    paired = bench.parse_args(["--paired"])
    argv = bench.child_argv("load", paired, tmp_path, tmp_path / "r.json", 99.0, tmp_path / "pairs")
    child = bench.parse_args(argv[2:])
    assert child.pair_dir == str(tmp_path / "pairs") and child.max_total_tokens == bench.PAIRED_KV_TOKENS
    assert bench.engine_kwargs(child, "m") == bench.engine_kwargs(paired, "m")
    assert bench.engine_kwargs(child, "m")["sleep_on_idle"] is True  # the idle server of a pair sleeps
    spinning = bench.parse_args(["--paired", "--no-sleep-on-idle"])
    child = bench.parse_args(bench.child_argv("load", spinning, tmp_path, tmp_path / "r.json")[2:])
    assert "sleep_on_idle" not in bench.engine_kwargs(child, "m")
    asleep = bench.parse_args(["--sleep-on-idle"])
    child = bench.parse_args(bench.child_argv("save", asleep, tmp_path, tmp_path / "r.json")[2:])
    assert bench.engine_kwargs(child, "m")["sleep_on_idle"] is True
    assert "sleep_on_idle" not in bench.engine_kwargs(bench.parse_args([]), "m")  # SGLang's default
    assert bench.parse_args(["--paired", "--round-pause", "1.5"]).round_pause == 1.5
    assert bench.parse_args([]).round_pause == 0.0
    fewer = bench.parse_args(["--paired", "--reps", "30", "--save-reps", "3"])
    reps = {
        kind: bench.parse_args(bench.child_argv(kind, fewer, tmp_path, tmp_path / "r.json")[2:]).reps
        for kind in ("save", "stock", "load")
    }
    assert reps == {"save": 3, "stock": 30, "load": 30}, "only SAVE's repetitions follow --save-reps"
    with pytest.raises(SystemExit):
        bench.parse_args(["--save-reps", "0"])


def test_run_timeouts_keep_time_for_the_later_runs(bench):
    assert bench.run_timeout(570, 2, 300) == 300
    assert bench.run_timeout(370, 1, 300) == 245  # 25 s to end the run, 100 s kept for LOAD
    assert bench.run_timeout(200, 0, 300) == 175
    assert bench.run_timeout(150, 2, 300) == bench.MIN_RUN_S  # too little to keep: try anyway
    assert bench.run_timeout(50, 0, 300) < bench.MIN_RUN_S  # skipped by the parent


def _decode_stats(tok_s=1234.56, host=20.0, device=4000.0, spread=0.01):
    return {
        "tok_s": {"median": tok_s, "spread": spread},
        "replay_host_us": {"median": host, "spread": 2 * spread},
        "replay_device_us": {"median": device, "spread": spread / 2},
    }


def _run(ok=True, ids=((1, 2),), **extra):
    return {
        "ok": ok,
        "output_ids": [list(x) for x in ids],
        "ready_s": 10.0,
        "decode_tok_s": 1234.56,
        "decode_stats": _decode_stats(),
        **extra,
    }


def _foundry_run(mode, **report):
    return _run(foundry_mode=mode, foundry_report={"rank0": {"ok": True, "mode": mode, **report}})


def test_assemble_a_good_result(bench):
    meta = {"date": "d", "commit": "c", "machine": "m", "command": "python x", "sglang_version": "0.5.17"}
    runs = {
        "stock": _run(log_decode_graph_bs=[1, 2, 4, 8]),
        "save": _foundry_run("save", graphs=4, capture_s=1.5, fc_save_s=3.0),
        "load": _foundry_run(
            "load", graphs=4, restore_s=0.8, decode_phase_stream_captures={"runtime": 0, "driver": 0}
        ),
    }
    out = bench.assemble(meta, runs, [])
    assert set(bench.FIELDS) <= set(out)
    assert out["ok"] and out["errors"] == [] and all(out["checks"].values())
    assert (out["graphs"], out["load_decode_captures"], out["capture_s"], out["restore_s"]) == (
        4,
        0,
        1.5,
        0.8,
    )
    assert out["tokens_identical_to_save"] is True and out["tokens_identical_to_stock"] is True
    assert out["decode_tok_s_load"] == 1234.6 and out["ready_s_stock"] == 10.0
    assert out["graphs_stock_log"] == 4 and out["sglang_version"] == "0.5.17"
    # the decode fields, named as in benchmarks/vllm_h200.py
    assert out["restore_critical_s"] == 0.8
    assert (out["replay_host_us_load"], out["replay_host_us_save"]) == (20.0, 20.0)
    assert (out["replay_device_us_load"], out["replay_device_us_save"]) == (4000.0, 4000.0)
    assert out["decode_spread"]["stock"] == {"tok_s": 0.01, "replay_host_us": 0.02, "replay_device_us": 0.005}
    assert out["decode_ratio_load_vs_stock"] == 1.0 and out["replay_device_ratio_load_vs_save"] == 1.0
    json.dumps(out)


def test_assemble_reports_each_runs_replay_times(bench):
    runs = {
        "stock": _run(decode_stats=_decode_stats(host=18.0, device=3900.0)),
        "save": _foundry_run("save", graphs=36),
        "load": _foundry_run("load", graphs=36, restore_s=2.5),
    }
    runs["load"]["decode_stats"] = _decode_stats(tok_s=1200.0, host=30.0, device=4120.0, spread=0.04)
    out = bench.assemble({}, runs, [])
    assert (out["replay_host_us_stock"], out["replay_host_us_load"]) == (18.0, 30.0)
    assert out["replay_device_ratio_load_vs_save"] == 1.03 and out["replay_host_ratio_load_vs_save"] == 1.5
    assert out["decode_spread"]["load"]["tok_s"] == 0.04 and out["graphs"] == 36
    assert out["restore_critical_s"] == out["restore_s"] == 2.5
    text = bench.summary(out)
    assert "1200.0 (4.0%)" in text and "restore_critical_s 2.5" in text
    assert len(text.splitlines()) < 25  # one screen


def test_assemble_names_what_went_wrong(bench):
    runs = {
        "stock": _run(ids=((1, 2),)),
        "save": _foundry_run("save", graphs=4, capture_s=1.5),
        "load": _foundry_run("load", graphs=4, decode_phase_stream_captures={"runtime": 4, "driver": 4}),
    }
    runs["load"]["output_ids"] = [[1, 3]]
    out = bench.assemble({}, runs, [])
    assert not out["ok"]
    assert out["load_decode_captures"] == 8 and out["tokens_identical_to_save"] is False
    assert not out["checks"]["no decode capture at LOAD"]


def test_assemble_with_runs_missing(bench):
    runs = {"stock": {"ok": False, "error": "RuntimeError: boom", "sglang_version": "0.5.17"}}
    out = bench.assemble({"sglang_version": None}, runs, ["native library missing"])
    assert not out["ok"] and out["sglang_version"] == "0.5.17"
    assert out["errors"] == ["native library missing", "stock: RuntimeError: boom"]
    assert all(out[f] is None for f in bench.FIELDS[5:])
    assert out["decode_spread"] == {"stock": None, "save": None, "load": None}
    assert "NOT OK" in bench.summary(out)


# --- the parent with fake runs ---------------------------------------------------------------------

_FAKE = textwrap.dedent(
    """
    import json, sys, time
    kind, result = sys.argv[1], sys.argv[2]
    print(kind, "says hello"); print(kind, "complains", file=sys.stderr)
    if kind == "stock":
        json.dump({"ok": True, "kind": kind, "stage": "done", "ready_s": 1.0, "output_ids": [[5]],
                   "sglang_version": "9.9", "decode_tok_s": 5000.0, "reps_done": 5,
                   "decode_stats": {"tok_s": {"median": 5000.0, "spread": 0.02}}}, open(result, "w"))
    elif kind == "save":
        json.dump({"ok": False, "kind": kind, "stage": "engine"}, open(result, "w"))
        time.sleep(60)  # hangs: the parent's timeout ends it
    """
)


def test_parent_survives_a_hanging_run_and_writes_everything(bench, monkeypatch, tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(_FAKE)
    monkeypatch.setattr(bench, "MIN_RUN_S", 1)
    monkeypatch.setattr(
        bench,
        "child_argv",
        lambda kind, opts, workdir, result, deadline=None: [sys.executable, str(fake), kind, str(result)],
    )
    out, logs = tmp_path / "out" / "sglang-h200.json", tmp_path / "logs"
    argv = ["--out", str(out), "--logs", str(logs), "--workdir", str(tmp_path / "work"), "--timeout", "8"]
    assert bench.main([*argv, "--budget", "200"]) == 1

    result = json.loads(out.read_text())
    assert set(bench.FIELDS) <= set(result) and result["ok"] is False
    assert result["runs"]["stock"]["ok"] and result["ready_s_stock"] == 1.0
    assert result["decode_spread"]["stock"]["tok_s"] == 0.02 and result["decode_tok_s_stock"] == 5000.0
    assert result["model"].startswith("benchmarks/cold_start.py MODEL_CONFIG: qwen3 28 layers")
    config = json.loads((tmp_path / "work" / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 28 and config["vocab_size"] == 151936
    assert (tmp_path / "work" / "step-timer" / "foundry_bench_steps.py").is_file()
    save = result["runs"]["save"]
    assert save["timed_out"] and "timed out after 8 s in stage 'engine'" in save["error"]
    assert result["runs"]["load"]["skipped"]  # no archive to load from
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        n for kind in ("stock", "save") for n in bench.log_names(kind)
    )
    assert (logs / "sglang-h200-save.stderr.log").read_text() == "save complains\n"
    assert (tmp_path / "work" / "model" / "config.json").exists()
    assert 'mode = "auto"' in (tmp_path / "work" / "foundry.toml").read_text()


def test_parent_records_a_crash_and_stops_at_the_budget(bench, monkeypatch, tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text(
        "import sys\nprint('Traceback (most recent call last):\\nValueError: x', file=sys.stderr)\n"
    )
    crash_then_exit = [sys.executable, str(crash)]
    monkeypatch.setattr(bench, "child_argv", lambda *a: crash_then_exit)
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--logs", str(tmp_path / "logs"), "--workdir", str(tmp_path / "w")]
    monkeypatch.setattr(bench, "MIN_RUN_S", 1)
    assert bench.main([*argv, "--budget", "200", "--timeout", "20"]) == 1
    result = json.loads(out.read_text())
    stock = result["runs"]["stock"]
    assert stock["returncode"] == 0 and "before reporting" in stock["error"]
    assert "ValueError: x" in stock["stderr_tail"] and stock["log_tracebacks"] == 1

    assert bench.main([*argv, "--budget", "1"]) == 1  # no time for any run: all skipped, JSON written
    result = json.loads(out.read_text())
    assert all(result["runs"][k]["skipped"] for k in bench.RUNS)


_FAKE_PAIRED = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    from pathlib import Path

    kind, result, pair_dir, steps_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    out = {"ok": True, "kind": kind, "ready_s": 1.0}
    if pair_dir:
        spec = importlib.util.spec_from_file_location("steps", steps_path)
        steps = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(steps)
        out["saw_load_waiting"] = (Path(pair_dir) / "wait-load-0").exists()
        gate = steps.PairGate(pair_dir, kind, timeout_s=30)
        reps = []
        i = 0
        while gate.wait(i):
            time.sleep(0.05)
            reps.append(5000.0 if kind == "stock" else 5100.0)
            gate.done(i)
            i += 1
        out.update(decode_tok_s_reps=reps, reps_done=len(reps))
    json.dump(out, open(result, "w"))
    """
)


def test_paired_runs_start_stock_beside_a_waiting_load_and_alternate(bench, monkeypatch, tmp_path):
    fake = tmp_path / "fake_paired.py"
    fake.write_text(_FAKE_PAIRED)
    steps_path = str(SCRIPT.with_name("engine_steps.py"))
    monkeypatch.setattr(bench, "MIN_RUN_S", 1)
    monkeypatch.setattr(
        bench,
        "child_argv",
        lambda kind, opts, workdir, result, deadline=None, pair_dir=None: [
            sys.executable,
            str(fake),
            kind,
            str(result),
            str(pair_dir or ""),
            steps_path,
        ],
    )
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--logs", str(tmp_path / "logs"), "--workdir", str(tmp_path / "w")]
    bench.main([*argv, "--budget", "200", "--paired", "--reps", "4"])
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert runs["save"]["ok"] and "saw_load_waiting" not in runs["save"]  # SAVE alone, first
    assert runs["stock"]["saw_load_waiting"] is True  # stock started once LOAD waited
    paired = result["paired"]
    assert paired["rounds"] == 4 and paired["stopped"] == "all rounds run"
    assert paired["order"][:2] == [["stock", "load"], ["load", "stock"]]
    assert paired["tok_s_ratio"]["median"] == 1.02 and paired["tok_s_ratio"]["n"] == 4
    assert runs["stock"]["reps_done"] == 4 and runs["load"]["reps_done"] == 4
    # the KV cache is pinned in every run of a paired benchmark
    opts = bench.parse_args(["--paired"])
    assert bench.engine_kwargs(opts, "m")["max_total_tokens"] == bench.PAIRED_KV_TOKENS
    assert "max_total_tokens" not in bench.engine_kwargs(bench.parse_args([]), "m")
    with pytest.raises(SystemExit):
        bench.parse_args(["--paired", "--stock-from", "x.json"])
