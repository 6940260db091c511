"""A kernel built with NVSHMEM device code, loaded by its library and set up by NVSHMEM, captured:
SAVE, then LOAD in fresh processes (needs a GPU, nvcc and the nvidia-nvshmem wheel's headers and
device library). The restored module gets its NVSHMEM device state from the LOAD process's NVSHMEM
(one PE, brought up by torch's NVSHMEM symmetric memory, as an engine's DeepEP buffer would): the
kernel then reads one PE, where a module nobody set up reads zero. A LOAD in a process without
NVSHMEM is refused with the reason; so is one whose NVSHMEM heap is not where SAVE placed it."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

KERNEL = textwrap.dedent(
    """
    #include <nvshmem.h>
    extern "C" __global__ void pes(int* out) {
      out[0] = nvshmem_my_pe();
      out[1] = nvshmem_n_pes();
      out[2] = 7;  // the kernel ran
    }
    """
)

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import torch
    import foundry_core as fc
    from foundry_core import nvshmem
    from foundry_core.driver import call
    from cuda.bindings import driver as cu

    mode, cubin, archive, port = sys.argv[1:5]
    HEAP_BASE = 0x620000000000  # past the region below; HEAP_BASE of the test
    if mode.endswith("+heap"):  # NVSHMEM's heap placed, before anything starts NVSHMEM
        mode = mode.removesuffix("+heap")
        nvshmem.place_heap(HEAP_BASE)

    def start_nvshmem():
        # One PE, brought up the way torch brings NVSHMEM up for its symmetric memory: at its first
        # allocation. No rendezvous: torch 2.11's wants two ranks or more (on the H200 at 6640e28:
        # "Expected global_ranks.size() > 1"), and one PE has no peer to exchange handles with.
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        symm_mem.set_backend("NVSHMEM")
        return symm_mem.empty(1 << 20, dtype=torch.uint8, device="cuda:0")

    if mode == "heap":  # NVSHMEM's heap placed at a fixed base, the same in every fresh process
        nvshmem.place_heap(HEAP_BASE)
        torch.cuda.set_device(0)
        heap = start_nvshmem()
        print(json.dumps({"heap": nvshmem.check_heap(HEAP_BASE), "ptr": heap.data_ptr()}), flush=True)
        os._exit(0)

    fc.start_recording()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    heap = start_nvshmem() if mode in ("save", "load") else None
    region = fc.Region(0x600000000000, 1 << 30, 0)
    with region.routing():
        out = torch.zeros(3, dtype=torch.int32, device="cuda")
    region.end_setup()

    def replay(graph):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return out.tolist()

    result = {}
    if mode == "save":
        # As a library that loads its own NVSHMEM module does: load it, have NVSHMEM set it up.
        module = call(cu.cuModuleLoadData, open(cubin, "rb").read())
        nvshmem.init_module(module, "test-kernel")
        pes = call(cu.cuModuleGetFunction, module, b"pes")
        with region.routing():
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                stream = torch.cuda.current_stream().cuda_stream
                call(cu.cuLaunchKernel, pes, 1, 1, 1, 1, 1, 1, 0, stream, ((out.data_ptr(),), (ctypes.c_void_p,)), 0)
        result["out"] = replay(g)
        fc.save(archive, graphs={"g": g}, region=region, tensors={"out": out}, detect_rng=False)
        from foundry_core.archive import open_archive

        meta = open_archive(archive).meta
        result["nvshmem_images"], result["nvshmem_heap"] = meta.get("nvshmem_images"), meta.get("nvshmem_heap")
    else:
        try:
            restored = fc.load(archive, region=region)
        except Exception as e:  # the refusal is the result of a LOAD without NVSHMEM
            result["error"] = f"{type(e).__name__}: {e}"
        else:
            result["out"] = replay(restored.graphs["g"])
    print(json.dumps(result), flush=True)
    os._exit(0)  # NVSHMEM's teardown at exit is not under test
    """
)


#: Where the heap test places NVSHMEM's heap (the child script has the same value).
HEAP_BASE = 0x620000000000


def _nvshmem_root() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        path = Path(root) / "nvshmem"
        if (path / "include" / "nvshmem.h").exists() and (path / "lib" / "libnvshmem_device.a").exists():
            return path
    return None


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _child(mode: str, cubin: Path, archive: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(cubin), str(archive), _port()],
        capture_output=True,
        text=True,
        timeout=300,
        # one PE on one GPU: no network transport to look for (the lent machines have none)
        env={**os.environ, "NVSHMEM_REMOTE_TRANSPORT": "none"},
    )
    assert proc.returncode == 0, f"{mode}: {proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build the kernel")
def test_a_restored_nvshmem_module_gets_the_load_process_nvshmem_state(tmp_path):
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        pytest.skip("torch's NVSHMEM is not available here (the nvidia-nvshmem wheel)")
    cubin = _build_cubin(tmp_path)
    archive = tmp_path / "archive"
    saved = _child("save", cubin, archive)
    assert saved["out"] == [0, 1, 7], "at SAVE, NVSHMEM set the module up: PE 0 of 1"
    assert len(saved["nvshmem_images"] or []) == 1, "the archive names the module NVSHMEM sets up"
    assert saved["nvshmem_heap"] is None, "the heap was not placed: nothing recorded"
    refused = _child("load-bare", cubin, archive)
    assert "error" in refused and "NVSHMEM" in refused["error"], refused
    assert refused["error"].startswith("ModuleError"), refused
    loaded = _child("load", cubin, archive)
    assert loaded.get("out") == [0, 1, 7], (
        "the restored module read the LOAD process's NVSHMEM state (a module nobody set up reads 0 PEs)",
        loaded,
    )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build the kernel")
def test_a_placed_heap_is_recorded_at_save_and_required_at_load(tmp_path):
    """SAVE with NVSHMEM's heap placed records its base and size; a LOAD whose NVSHMEM put the heap
    where the driver chose is refused before anything is mapped; one that placed it restores."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        pytest.skip("torch's NVSHMEM is not available here (the nvidia-nvshmem wheel)")
    cubin = _build_cubin(tmp_path)
    archive = tmp_path / "archive"
    saved = _child("save+heap", cubin, archive)
    assert saved["out"] == [0, 1, 7]
    assert saved["nvshmem_heap"]["base"] == HEAP_BASE and saved["nvshmem_heap"]["size"] >= 1 << 30, saved
    refused = _child("load", cubin, archive)
    assert refused.get("error", "").startswith("HeapPlacementError"), refused
    assert "did not place it" in refused["error"], refused
    loaded = _child("load+heap", cubin, archive)
    assert loaded.get("out") == [0, 1, 7], loaded


def _build_cubin(tmp_path: Path) -> Path:
    root = _nvshmem_root()
    if root is None:
        pytest.skip("the nvidia-nvshmem wheel here has no headers or no device library to build with")
    src, obj, cubin = tmp_path / "k.cu", tmp_path / "k.o", tmp_path / "k.cubin"
    src.write_text(KERNEL)
    # NVSHMEM's device code is a static library of relocatable device code: compile relocatable,
    # then device-link against it into one executable cubin that a library loads as a module.
    nvcc = ["nvcc", "-arch=sm_90"]
    subprocess.run(
        [*nvcc, "-rdc=true", "-I", str(root / "include"), "-c", str(src), "-o", str(obj)], check=True
    )
    subprocess.run(
        [*nvcc, "-dlink", "-cubin", str(obj), "-L", str(root / "lib"), "-lnvshmem_device", "-o", str(cubin)],
        check=True,
    )
    return cubin


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (the NVSHMEM test's environment)")
def test_nvshmem_places_its_heap_at_the_same_base_in_every_process(tmp_path):
    """native/nvshmem_cuda.c as NVSHMEM's driver: the heap (one PE, brought up by torch's NVSHMEM
    symmetric memory) is reserved at the armed base, and the same first allocation gets the same
    address in two fresh processes, as a DeepEP buffer captured at SAVE must at LOAD."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        pytest.skip("torch's NVSHMEM is not available here (the nvidia-nvshmem wheel)")
    first = _child("heap", tmp_path / "none", tmp_path / "none")
    second = _child("heap", tmp_path / "none", tmp_path / "none")
    assert first["heap"]["base"] == second["heap"]["base"] == HEAP_BASE, (first, second)
    assert first["ptr"] == second["ptr"] and HEAP_BASE <= first["ptr"] < HEAP_BASE + first["heap"]["size"]
