"""Fixtures for the vLLM plugin tests: the real vLLM package, a tiny local Qwen3 config, Foundry TOMLs.

On a machine without a GPU, vLLM resolves no platform (its CUDA platform module needs libcuda), so
``EngineArgs.create_engine_config`` cannot run.  There, and only there, a small stand-in platform
describing an H200 is installed as ``vllm.platforms.current_platform`` before any vLLM config module
is imported.  Everything else (argument parser, EngineArgs, VllmConfig, the plugin loader) is vLLM's
own code.
"""

from __future__ import annotations

import json
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# Asked of the installed distributions first: with tests/ on sys.path, this very directory would
# import as a namespace package called "vllm" where the real package is missing.
try:
    version("vllm")
    MISSING = None
except PackageNotFoundError:
    MISSING = "the real vLLM package is not installed (see .ci/vllm.sh): tests/vllm not collected"

if MISSING:
    collect_ignore_glob = ["test_*.py"]

    def pytest_report_header(config):
        return MISSING

    def pytest_terminal_summary(terminalreporter):
        # The modules import vLLM at the top, so they are not collected at all; say so at the end
        # too, where the skip reasons are, rather than let them vanish from the output.
        terminalreporter.write_line(f"SKIPPED tests/vllm: {MISSING}")

else:
    vllm = pytest.importorskip("vllm", reason="the real vLLM package is needed (see .ci/vllm.sh)")

    from foundry_vllm_testutil import has_gpu, install_cpu_stand_in_platform

    if not has_gpu():
        install_cpu_stand_in_platform()

from foundry_vllm_testutil import QWEN3_CONFIG, write_toml  # noqa: E402


@pytest.fixture(autouse=True)
def _no_launch_settings_left():
    """A config built with Foundry on sets the launch environment of this process (cache folders,
    ``foundry_vllm_plugin.session.launch_settings``); the next test starts without it."""
    yield
    from foundry_core.engine import undo_launch_redirect

    undo_launch_redirect()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3-tiny")
    (d / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return d


@pytest.fixture
def warnings_logged(log_records):
    """WARNING records of the plugin's logger (vLLM's logger may not propagate to the root)."""
    return log_records("vllm.foundry", logging.WARNING, logger_level=logging.INFO)


@pytest.fixture
def foundry_toml(tmp_path) -> Path:
    return write_toml(tmp_path / "foundry.toml")


@pytest.fixture
def engine_args_factory(qwen3_dir):
    from vllm.engine.arg_utils import EngineArgs

    def make(**kwargs):
        base = dict(
            model=str(qwen3_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=1024,
            seed=0,
        )
        base.update(kwargs)
        return EngineArgs(**base)

    return make


@pytest.fixture(scope="session")
def base_vllm_config(tmp_path_factory, qwen3_dir):
    """One real VllmConfig with Foundry on, built by vLLM (the tests copy it before changing it)."""
    from vllm.engine.arg_utils import EngineArgs

    toml = write_toml(tmp_path_factory.mktemp("foundry") / "foundry.toml")
    args = EngineArgs(
        model=str(qwen3_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        seed=0,
        additional_config={"foundry": {"config": str(toml)}},
    )
    return args.create_engine_config()


@pytest.fixture
def cpu_workspace_manager():
    """vLLM's own workspace manager on the CPU, reset afterwards."""
    import torch
    from vllm.v1.worker import workspace as vllm_workspace

    saved = vllm_workspace._manager
    vllm_workspace.init_workspace_manager(torch.device("cpu"), 1)
    yield vllm_workspace.current_workspace_manager()
    vllm_workspace._manager = saved
