"""A Foundry start that cannot go on ends ``vllm serve`` with one line and exit status 1, no traceback.

The configuration cases run vLLM's own command line (``vllm.entrypoints.cli.main``, what the
``vllm serve`` console script runs) in a fresh interpreter on this CPU machine
(``VLLM_TARGET_DEVICE=cpu``): each error is found while vLLM turns the flags into engine arguments.
A valid Foundry start there (no CUDA device) is refused before vLLM builds its config. Refusals of an
engine configuration need a CUDA platform to be reached: test_vllm_serve_refusals.py runs every one that
flags reach through the same ``vllm serve`` parser, under the tests' CUDA stand-in (conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from foundry_vllm_testutil import write_toml

pytestmark = pytest.mark.vllm

_MAIN = """
import sys
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", *sys.argv[1:]]
main()
"""


def _serve(qwen3_dir: Path, *argv: str, env: dict | None = None):
    script = textwrap.dedent(_MAIN)
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_LOGGING_LEVEL": "WARNING",
        **(env or {}),
    }
    if "FOUNDRY_CONFIG" not in (env or {}):
        full_env.pop("FOUNDRY_CONFIG", None)
    common = ["--model", str(qwen3_dir), "--load-format", "dummy", "--skip-tokenizer-init"]
    common += ["--max-model-len", "1024", "--port", "0"]
    return subprocess.run(
        [sys.executable, "-c", script, *common, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=full_env,
    )


def _one_line(proc) -> str:
    """The refusal: exit status 1, no traceback, the error as the last line of stderr."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-3000:]
    return last


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_file", "does not exist"),
        ("bad_mode", "mode"),
        ("unknown_key", "unknown key 'archve_digest'"),
        ("invalid_toml", "foundry.toml"),
        ("config_without_enable", "--foundry-config was given without --enable-foundry"),
        ("enable_without_config", "--enable-foundry needs --foundry-config PATH (or FOUNDRY_CONFIG"),
        ("bad_env_config", "does not exist"),
    ],
)
def test_a_bad_foundry_config_ends_vllm_serve_with_one_line(qwen3_dir, tmp_path, case, expected):
    toml = tmp_path / "foundry.toml"
    env: dict[str, str] = {}
    flags = ["--enable-foundry", "--foundry-config", str(toml)]
    if case == "missing_file":
        flags[-1] = str(tmp_path / "nope.toml")
    elif case == "bad_mode":
        write_toml(toml, mode="sometimes")
    elif case == "unknown_key":
        write_toml(toml, extra="archve_digest = 1\n")
    elif case == "invalid_toml":
        toml.write_text('mode = "auto\narchive_dir = [\n')
    elif case == "config_without_enable":
        write_toml(toml)
        flags = ["--foundry-config", str(toml)]
    elif case == "enable_without_config":
        flags = ["--enable-foundry"]
    elif case == "bad_env_config":
        flags, env = ["--enable-foundry"], {"FOUNDRY_CONFIG": str(tmp_path / "nope.toml")}
    line = _one_line(_serve(qwen3_dir, *flags, env=env))
    assert expected in line, line


def test_a_valid_foundry_start_without_a_cuda_device_is_refused_up_front(qwen3_dir, foundry_toml):
    line = _one_line(_serve(qwen3_dir, "--enable-foundry", "--foundry-config", str(foundry_toml)))
    assert line == (
        "error: Foundry cannot run this vLLM configuration: no CUDA device: vLLM runs on its 'cpu' "
        "platform here, and Foundry persists CUDA graphs only"
    ), line


def test_the_same_check_in_process_refuses_before_vllm_builds_its_config(
    engine_args_factory, foundry_toml, monkeypatch
):
    """The no-device refusal comes before vLLM's own config step (which would look at the model)."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    from foundry_core.config import ConfigError
    from foundry_vllm_plugin import engine_args

    monkeypatch.setattr(vllm.platforms, "current_platform", CpuPlatform())
    called = []
    monkeypatch.setattr(engine_args, "prepare_engine_args", lambda a: called.append("prepare"))
    args = engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}})
    with pytest.raises(ConfigError, match="no CUDA device: vLLM runs on its 'cpu' platform") as err:
        args.create_engine_config()
    assert isinstance(err.value, SystemExit) and called == []
