"""start_recording / stop_recording around real captures (needs a GPU)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import torch
    import foundry_core as fc

    x = torch.zeros(16, device="cuda")

    def capture():
        g = torch.cuda.CUDAGraph()
        x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            x.mul_(2)
        return g

    fc.start_recording(keep_images=False)
    capture()
    counted = sum(fc.stream_captures().values())
    assert counted >= 1, counted
    fc.stop_recording()
    fc.stop_recording()  # idempotent
    g = capture()  # not counted: CUPTI is detached
    assert sum(fc.stream_captures().values()) == counted
    x.fill_(1)
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 16, "a graph captured after stop_recording replays"
    fc.start_recording(keep_images=False)  # a later start subscribes anew
    capture()
    assert sum(fc.stream_captures().values()) > counted
    fc.stop_recording()
    print("ok")
    """
)


def test_stop_recording_detaches_and_restarts():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
