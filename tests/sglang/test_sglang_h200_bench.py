"""benchmarks/sglang_h200.py without a GPU: its arguments, the runs' configuration and environment,
result assembly, and the parent's handling of runs that fail, hang or never start (fake runs)."""

from __future__ import annotations

import importlib.util
import json
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
    assert opts.timeout == 240 and opts.budget <= 560  # three runs inside a 600 s device call
    assert opts.max_bs == 8 and opts.decode_tokens == 128 and len(bench.PROMPTS) == 8


def test_bad_counts_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--reps", "0"])


def test_every_run_has_the_same_engine_configuration(bench, plugins_loaded, tmp_path):
    from sglang.srt.server_args import ServerArgs

    opts = bench.parse_args([])
    kwargs = bench.engine_kwargs(opts, str(tmp_path))
    assert kwargs["cuda_graph_backend_prefill"] == "disabled"
    assert kwargs["random_seed"] == 0 and kwargs["load_format"] == "dummy"
    # msgspec record (0.5.20+) or dataclass (before)
    fields = getattr(ServerArgs, "__struct_fields__", None) or tuple(ServerArgs.__dataclass_fields__)
    missing = [name for name in kwargs if name not in fields]
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
    # device="cpu": resolution must not look for a GPU here (older releases do when it is unset)
    server_args = ServerArgs(**bench.engine_kwargs(opts, str(model_dir)), device="cpu")
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


def test_decode_throughput_subtracts_the_prefill(bench, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def generate(prompts, n):
        clock[0] += 0.05 + 0.002 * (n - 1)  # 50 ms prefill, 2 ms per decode step
        return [[0] * n for _ in prompts]

    got = bench.measure_decode(generate, bench.PROMPTS, 128, 3)
    assert got["decode_tokens"] == 8 * 128
    assert got["decode_tok_s"] == pytest.approx(8 / 0.002)


def _run(ok=True, ids=((1, 2),), **extra):
    return {"ok": ok, "output_ids": [list(x) for x in ids], "ready_s": 10.0, "decode_tok_s": 1234.56, **extra}


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
    json.dumps(out)


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


# --- the parent with fake runs ---------------------------------------------------------------------

_FAKE = textwrap.dedent(
    """
    import json, sys, time
    kind, result = sys.argv[1], sys.argv[2]
    print(kind, "says hello"); print(kind, "complains", file=sys.stderr)
    if kind == "stock":
        json.dump({"ok": True, "kind": kind, "stage": "done", "ready_s": 1.0, "output_ids": [[5]],
                   "sglang_version": "9.9"}, open(result, "w"))
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
        lambda kind, opts, workdir, result: [sys.executable, str(fake), kind, str(result)],
    )
    out, logs = tmp_path / "out" / "sglang-h200.json", tmp_path / "logs"
    argv = ["--out", str(out), "--logs", str(logs), "--workdir", str(tmp_path / "work"), "--timeout", "8"]
    assert bench.main([*argv, "--budget", "200"]) == 1

    result = json.loads(out.read_text())
    assert set(bench.FIELDS) <= set(result) and result["ok"] is False
    assert result["runs"]["stock"]["ok"] and result["ready_s_stock"] == 1.0
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
