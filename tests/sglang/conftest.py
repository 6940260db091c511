"""Shared fixtures for the SGLang plugin tests: the real SGLang package, no GPU.

Tests that need a fresh process (SGLang loads plugins once per process) run a snippet with this
interpreter in a subprocess; the rest share one process in which SGLang's own ``load_plugins()``
ran once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _sglang_missing() -> str | None:
    # Asked of the installed distributions, not by importing: with tests/ on sys.path, this very
    # directory would import as a namespace package called "sglang".
    try:
        version("sglang")
    except PackageNotFoundError:
        return "the real SGLang package is not installed (see .ci/sglang.sh)"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "no_cuda_stand_in: the machine's own CUDA device count is used")


def pytest_collection_modifyitems(config, items):
    reason = _sglang_missing()
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.sglang)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


# The 4-layer Qwen3 of the engine examples.
MODEL_CONFIG = HERE.parents[1] / "examples" / "qwen3-tiny" / "config.json"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    shutil.copyfile(MODEL_CONFIG, d / "config.json")
    return d


@pytest.fixture(scope="session")
def foundry_toml(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("foundry")
    path = d / "foundry.toml"
    path.write_text(f'mode = "auto"\narchive_dir = "{d / "archive"}"\n')
    return path


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own plugin loader, run once in this process (as ``sglang.Engine`` does)."""
    import sglang.srt.entrypoints.engine  # noqa: F401  (as when an Engine is being built)
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture
def parse(plugins_loaded, model_dir, foundry_toml):
    """Parse argv with SGLang's real parser; Foundry flags and a model path are added."""
    from sglang.srt.server_args import prepare_server_args

    def _parse(*argv: str, foundry: bool = True):
        args = ["--model-path", str(model_dir), "--device", "cuda", *argv]
        if foundry:
            args += ["--enable-foundry", "--foundry-config", str(foundry_toml)]
        return prepare_server_args(args)

    return _parse


@pytest.fixture
def logged(log_records):
    """Records of the plugin's logger (on the logger itself: SGLang resets the root's handlers)."""
    return log_records("foundry.sglang", logging.DEBUG)


@pytest.fixture(autouse=True)
def _a_cuda_device(request, monkeypatch):
    """The launch checks here stand for a GPU machine: the plugin is told one CUDA device is visible
    (it refuses a launch on a machine without one). ``@pytest.mark.no_cuda_stand_in`` keeps the
    machine's real answer (none, on the CPU runners)."""
    if request.node.get_closest_marker("no_cuda_stand_in") is None:
        from foundry_sglang_plugin import support

        monkeypatch.setattr(support, "cuda_device_count", lambda: 1)


@pytest.fixture(autouse=True)
def _no_foundry_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("FOUNDRY_"):
            monkeypatch.delenv(key)


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def fresh_python():
    """``run(code, env=None) -> dict``: run ``code`` in a fresh interpreter (SGLang loads plugins once
    per process); the snippet prints one JSON object as its last line."""
    return _run_python


@pytest.fixture
def cfg(foundry_toml, tmp_path):
    """The launch's Foundry config with the archive directory in this test's tmp_path."""
    from foundry_core.config import load_config

    return dataclasses.replace(load_config(foundry_toml), archive_dir=tmp_path / "archive")
