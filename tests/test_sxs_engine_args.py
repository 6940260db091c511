"""The side-by-side harness's command lines against the real engine CLIs (run in the engine's venv):
every mode's server command and the benchmark client's command parse with the engine's own parser,
the Foundry flags included (through the plugin the shim lets the engine find). Nothing starts: the
parser's result is where each check stops.

    PYTHONPATH=$PWD/src /work/main/.venv-sglang/bin/python -m pytest -q tests/test_sxs_engine_args.py
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD/src /work/main/.venv-vllm/bin/python -m pytest -q tests/test_sxs_engine_args.py
"""

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sxs_modes as modes  # noqa: E402  (benchmarks/ is no package)
import sxs_serving  # noqa: E402

# Runs each [module, argv...] of a JSON list in this one process, with the module's argparse parser
# stopped right after it parsed; prints {"ok": [...], "errors": [...]}.
CHECKER = r"""
import argparse, contextlib, io, json, runpy, sys
class Parsed(BaseException):
    pass
_orig = argparse.ArgumentParser.parse_args
def _parse(self, args=None, namespace=None):
    _orig(self, args, namespace)
    raise Parsed()
argparse.ArgumentParser.parse_args = _parse
report = {"ok": [], "errors": []}
for module, *argv in json.load(open(sys.argv[1])):
    sys.argv = [module, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        report["errors"].append([module, "parsed nothing"])
    except Parsed:
        report["ok"].append(module)
    except SystemExit as e:
        report["errors"].append([module, (err.getvalue().strip().splitlines() or [str(e)])[-1]])
print("SXS-REPORT " + json.dumps(report))
"""


def _engine() -> str:
    # the installed distribution, not a module: tests/sglang and tests/vllm are on the path too
    for engine in modes.ENGINES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(engine)
            return engine
    pytest.skip("neither SGLang nor vLLM is installed here (run in an engine's venv)")


def _check(tmp_path: Path, engine: str, commands: list[list[str]], env: dict[str, str]) -> dict:
    (tmp_path / "commands.json").write_text(json.dumps(commands))
    (tmp_path / "checker.py").write_text(CHECKER)
    env = dict(env, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "checker.py"), str(tmp_path / "commands.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("SXS-REPORT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_every_mode_and_the_client_parse_with_the_engines_own_cli(tmp_path):
    engine = _engine()
    model = tmp_path / "model"
    model.mkdir()
    where = modes.Where(
        model_dir=model,
        home=tmp_path / "h",
        tmp=tmp_path / "t",
        port=8123,
        shim=modes.write_shim(tmp_path / "shim", engine),
        toml=modes.foundry_toml(tmp_path / "f.toml", "load", tmp_path / "archive", "8GiB"),
        peer_site=tmp_path / "site-peer",
    )
    for d in (where.home, where.tmp):
        d.mkdir()
    commands = []
    for mode in modes.MODES:
        if mode == "peer":
            continue  # upstream Foundry adds no flag: its server command is stock_best's minus ours
        launch = modes.launch(engine, mode, where, mode == "stock_default", dict(os.environ), ROOT / "src")
        assert launch.argv[1] == "-m"
        commands.append(launch.argv[2:])
    client = sxs_serving.client_argv(engine, "http://127.0.0.1:8123", model, "inf", 8, tmp_path / "r.json")
    commands.append(client[2:])
    commands.append([*commands[0], "--no-such-flag", "1"])  # the check itself can fail
    foundry_env = modes.launch(engine, "foundry", where, False, dict(os.environ), ROOT / "src").env
    report = _check(tmp_path, engine, commands, foundry_env)
    assert len(report["ok"]) == len(commands) - 1, report
    assert report["errors"] and "--no-such-flag" in report["errors"][0][1], report
