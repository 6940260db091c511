"""The example recipe and the server CLI, as far as they run without a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang"


def _example_module():
    spec = importlib.util.spec_from_file_location("foundry_sglang_example", EXAMPLE / "run_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_configuration_is_supported(plugins_loaded):
    from foundry_core.config import load_config
    from foundry_sglang_plugin import check_supported

    module = _example_module()
    server_args = module.build_server_args("fa3", str(EXAMPLE / "foundry.toml"))
    assert server_args.enable_foundry and server_args.foundry_config.endswith("foundry.toml")
    check_supported(server_args)
    cfg = load_config(EXAMPLE / "foundry.toml")
    assert cfg.mode == "auto" and cfg.archive_dir == EXAMPLE / "archive"


def test_example_baseline_has_no_foundry_settings(plugins_loaded):
    server_args = _example_module().build_server_args("fa3", None)
    assert "enable_foundry" not in server_args.__dict__


def test_server_cli_refuses_before_starting(model_dir, foundry_toml):
    """`python -m sglang.launch_server` with the flags: parsed by SGLang, refused before any spawn."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir),
            "--device",
            "cpu",
            "--enable-foundry",
            "--foundry-config",
            str(foundry_toml),
            "--enable-pdmux",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    # One line a user can act on, at the end, and no traceback above it.
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Foundry cannot run this SGLang configuration: "), proc.stderr[-2000:]
    assert "PD multiplexing (--enable-pdmux) is not supported" in last
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
