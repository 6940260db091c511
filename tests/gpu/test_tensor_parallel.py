"""``foundry tp``: SAVE per rank, LOAD in fresh processes, all-reduce through torch symmetric memory
inside the decode graph (needs as many GPUs as ranks; one GPU runs a group of one)."""

import json
import subprocess
import sys
import types

import pytest

from foundry_core import symmetric
from foundry_core.config import DEFAULT_REGION_BASE, DEFAULT_REGION_SIZE
from tool_commands import register_tool_commands

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tool_commands(monkeypatch, tmp_path_factory):
    """``foundry FOO`` finds FOO through foundry_graphs.commands: declared here for the processes the
    tests start, also where the installed packaging metadata predates the group."""
    register_tool_commands(monkeypatch, tmp_path_factory.mktemp("entry_points"))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _tp(tmp_path, world: int, *extra):
    out = tmp_path / "tp.json"
    cmd = [
        sys.executable,
        "-m",
        "foundry_core.cli",
        "tp",
        "--world-size",
        str(world),
        "--workdir",
        str(tmp_path),
    ]
    proc = subprocess.run([*cmd, "--out", str(out), *extra], capture_output=True, text=True, timeout=900)
    assert out.exists(), f"tp wrote no result\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_decode_restores_bit_exact(tmp_path, world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpus()}")
    result, proc = _tp(tmp_path, world, "--preset", "tiny", "--reproduce")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    region = types.SimpleNamespace(base=DEFAULT_REGION_BASE, size=DEFAULT_REGION_SIZE)
    window, size = symmetric.window(region)
    for rank in result["ranks"]:
        assert rank["outputs_identical"] and rank["load_decode_captures"] == 0
        assert rank["symm_mem_collectives"] > 0 and rank["nccl_kernels"] == 0
        # the engine layer's gather (sum of zero-padded shards) in a graph of its own
        assert rank["gather_identical_save"] and rank["gather_identical_load"]
        placed = rank["symmetric"]  # every mapping in the window, the address arrays in the region
        assert all(window <= p < window + size for p in placed["buffer_ptrs"]), placed
        assert DEFAULT_REGION_BASE <= placed["buffer_ptrs_dev"] < DEFAULT_REGION_BASE + DEFAULT_REGION_SIZE
    assert result["reproduce"]["fingerprints_equal"] and result["reproduce"]["offsets_equal"]


def test_two_ranks_sharing_one_gpu_restore_bit_exact(tmp_path):
    """TP=2 on one GPU (--share-gpus): two processes, each mapping the other's symmetric buffer, the
    one-shot all-reduce reading it inside the graph; LOAD in fresh processes, logits equal on both
    ranks, the mappings placed in the window. Everything of the two-GPU case but NVLink."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    result, proc = _tp(tmp_path, 2, "--preset", "tiny", "--share-gpus", "--all-reduce", "one_shot")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    window, size = symmetric.window(types.SimpleNamespace(base=DEFAULT_REGION_BASE, size=DEFAULT_REGION_SIZE))
    for rank in result["ranks"]:
        assert rank["outputs_identical"] and rank["load_decode_captures"] == 0 and rank["nccl_kernels"] == 0
        assert rank["symm_mem_collectives"] > 0
        assert rank["gather_identical_save"] and rank["gather_identical_load"]
        assert all(window <= p < window + size for p in rank["symmetric"]["buffer_ptrs"])
    assert result["ranks_agree"] and result["share_gpus"] is True


def _worker(tmp_path, phase: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "foundry_tools.tp", "worker", phase, "--rank", "0", "--world-size", "1"]
    cmd += ["--port", "29517", "--archive", str(tmp_path / "rank0"), "--reference", str(tmp_path / "ref.pt")]
    return subprocess.run([*cmd, "--preset", "tiny", *extra], capture_output=True, text=True, timeout=600)


def test_load_refuses_symmetric_memory_elsewhere(tmp_path):
    """A LOAD whose symmetric buffer is mapped elsewhere than at SAVE (another buffer placed first, so
    the buffer takes the window's next slot) is refused before any graph is built, naming the
    difference."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    proc = _worker(tmp_path, "save")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _worker(tmp_path, "load", "--shift-symmetric")
    assert proc.returncode != 0
    assert "SymmetricMismatch" in proc.stderr and "buffer_ptrs[0]" in proc.stderr, proc.stderr[-3000:]
