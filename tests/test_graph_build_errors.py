"""The Python graph builder's error when the driver refuses a kernel node: the kernel, its launch and
the function's limits, so that a LOAD that fails on a GPU says why without another run."""

import types

import pytest
from cuda.bindings import driver as D

from foundry_core import graph_build
from foundry_core.driver import CudaError


def test_a_refused_kernel_node_names_its_launch_and_the_functions_limits(monkeypatch):
    ok, bad = D.CUresult.CUDA_SUCCESS, D.CUresult.CUDA_ERROR_INVALID_VALUE
    limits = {
        D.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 61440,
        D.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: 1024,
    }

    def cuGraphAddKernelNode(*args):  # noqa: N802 (named as the driver's, for the message)
        return bad, None

    stand_in = types.SimpleNamespace(
        CUDA_KERNEL_NODE_PARAMS=D.CUDA_KERNEL_NODE_PARAMS,
        CUresult=D.CUresult,
        CUfunction_attribute=D.CUfunction_attribute,
        cuCtxGetCurrent=lambda: (ok, None),
        cuGraphAddKernelNode=cuGraphAddKernelNode,
        cuFuncGetAttribute=lambda attr, func: (ok, limits[attr]),
    )
    monkeypatch.setattr(graph_build, "cu", lambda: stand_in)
    modules = types.SimpleNamespace(function=lambda image, name, attrs: D.CUfunction(init_value=0x1000))
    node = {
        "type": "kernel",
        "image": "img",
        "name": "gemm_kernel",
        "grid": [4, 1, 1],
        "block": [128, 1, 1],
        "smem": 102400,
        "layout": [[0, 8]],
        "params": b"\0" * 8,
        "attrs": {},
    }
    with pytest.raises(CudaError) as refused:
        graph_build._add_nodes("graph", {"nodes": [node], "edges": []}, modules, {}, [], [])
    assert refused.value.name == "CUDA_ERROR_INVALID_VALUE"
    message = str(refused.value)
    assert message.startswith("cuGraphAddKernelNode (kernel gemm_kernel, grid (4, 1, 1), block (128, 1, 1)")
    assert "dynamic shared memory 102400 bytes (limit 61440, max threads 1024)) failed" in message
