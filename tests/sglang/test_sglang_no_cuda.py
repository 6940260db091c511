"""A valid Foundry launch on a machine with no CUDA device is refused at SGLang's launch check, in
one line, before any mode is settled or subprocess spawned (it used to settle SAVE and die in the
scheduler, where CUPTI failed to attach with an error asking whether a profiler was attached)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.no_cuda_stand_in


@pytest.fixture
def no_cuda_here():
    import torch

    if torch.cuda.device_count() > 0:
        pytest.skip("this machine has a CUDA device")


def test_a_valid_launch_without_a_cuda_device_is_refused_up_front(no_cuda_here, parse):
    from foundry_sglang_plugin import FoundryUnsupportedError, check_supported

    server_args = parse("--cuda-graph-backend-prefill", "disabled")
    check_supported(server_args)  # valid: nothing in the configuration is refused
    server_args.resolve_once()  # as SGLang's launcher does before its checks
    with pytest.raises(FoundryUnsupportedError) as err:
        server_args.check_server_args()
    line = str(err.value)
    assert isinstance(err.value, SystemExit)  # `sglang serve` ends with this line, not a traceback
    assert "\n" not in line
    assert "no CUDA device is visible on this machine" in line
    assert "FOUNDRY_MODE" not in os.environ  # nothing settled, nothing exported for schedulers


def test_configuration_refusals_still_come_first(no_cuda_here, parse):
    from foundry_sglang_plugin import FoundryUnsupportedError

    server_args = parse("--cuda-graph-backend-prefill", "disabled", "--pp-size", "2")
    server_args.resolve_once()
    with pytest.raises(FoundryUnsupportedError, match="pipeline parallelism"):
        server_args.check_server_args()


def test_without_foundry_the_launch_check_is_sglangs_own(no_cuda_here, parse):
    server_args = parse("--cuda-graph-backend-prefill", "disabled", foundry=False)
    server_args.resolve_once()
    server_args.check_server_args()  # no Foundry: nothing refused by the plugin


def test_the_server_cli_ends_with_the_one_line(no_cuda_here, model_dir, foundry_toml):
    """`python -m sglang.launch_server` with a valid Foundry launch, on this machine without CUDA."""
    import subprocess
    import sys

    argv = ["--model-path", str(model_dir), "--device", "cuda", "--cuda-graph-backend-prefill", "disabled"]
    argv += ["--enable-foundry", "--foundry-config", str(foundry_toml)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Foundry cannot run this SGLang configuration: no CUDA device"), (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr and "CUPTI" not in proc.stderr, proc.stderr[-2000:]
