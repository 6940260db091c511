"""SAVE's refusals that need no GPU to trigger: preconditions of save(), and graph nodes that cannot
be restored, walked through a stand-in for the driver's graph API."""

import enum
import types

import pytest

import foundry_core
from foundry_core import api, driver, graphs


class _Ty(enum.IntEnum):
    CU_GRAPH_NODE_TYPE_KERNEL = 0
    CU_GRAPH_NODE_TYPE_MEMCPY = 1
    CU_GRAPH_NODE_TYPE_MEMSET = 2
    CU_GRAPH_NODE_TYPE_HOST = 3
    CU_GRAPH_NODE_TYPE_GRAPH = 4
    CU_GRAPH_NODE_TYPE_EMPTY = 5
    CU_GRAPH_NODE_TYPE_WAIT_EVENT = 6
    CU_GRAPH_NODE_TYPE_EVENT_RECORD = 7
    CU_GRAPH_NODE_TYPE_MEM_ALLOC = 10
    CU_GRAPH_NODE_TYPE_MEM_FREE = 11
    CU_GRAPH_NODE_TYPE_CONDITIONAL = 13


def _fake_driver(node_types, memcpy_kinds=(2, 2)):
    """A driver whose graph holds one node per entry of ``node_types`` and no edges."""
    nodes = list(range(1, len(node_types) + 1))
    d = types.SimpleNamespace(CUgraphNodeType=_Ty)
    d.cuGraphGetNodes = lambda g, n: (0, nodes[:n] if n else None, len(nodes))
    d.cuGraphNodeGetType = lambda node: (0, node_types[node - 1])
    d.cuGraphGetEdges = lambda g, n: (0, None, None, None, 0)
    d.cuGraphMemcpyNodeGetParams = lambda node: (
        0,
        types.SimpleNamespace(srcMemoryType=memcpy_kinds[0], dstMemoryType=memcpy_kinds[1]),
    )
    return d


@pytest.fixture
def walk(monkeypatch):
    def run(node_types, **kw):
        fake = _fake_driver(node_types, **kw)
        monkeypatch.setattr(driver, "cu", lambda: fake)
        monkeypatch.setattr(graphs, "cu", lambda: fake)
        segs = graphs.Segments(0x600000000000, 1 << 30, [])
        return graphs.serialize(object(), recorded=None, segments=segs, kernels={})

    return run


@pytest.mark.parametrize(
    "ty,name",
    [
        (_Ty.CU_GRAPH_NODE_TYPE_HOST, "host"),
        (_Ty.CU_GRAPH_NODE_TYPE_MEM_ALLOC, "mem_alloc"),
        (_Ty.CU_GRAPH_NODE_TYPE_MEM_FREE, "mem_free"),
        (_Ty.CU_GRAPH_NODE_TYPE_CONDITIONAL, "conditional"),
    ],
)
def test_unrestorable_node_types_are_refused(walk, ty, name):
    with pytest.raises(graphs.GraphError, match=rf"graph node 1: node type {name} cannot be saved"):
        walk([_Ty.CU_GRAPH_NODE_TYPE_EMPTY, ty])


def test_empty_nodes_are_saved(walk):
    desc, pointers = walk([_Ty.CU_GRAPH_NODE_TYPE_EMPTY, _Ty.CU_GRAPH_NODE_TYPE_EMPTY])
    assert desc["nodes"] == [{"type": "empty"}, {"type": "empty"}] and desc["edges"] == [] and not pointers


def test_host_memory_copies_are_refused(walk):
    with pytest.raises(
        graphs.GraphError, match=r"memcpy between memory types \(1, 2\); only device-to-device"
    ):
        walk([_Ty.CU_GRAPH_NODE_TYPE_MEMCPY], memcpy_kinds=(1, 2))


def test_save_preconditions(monkeypatch, tmp_path):
    monkeypatch.setattr(api, "recording", lambda: False)
    with pytest.raises(api.SaveError, match="start_recording"):
        foundry_core.save(tmp_path / "a", graphs={"g": object()}, region=object())
    monkeypatch.setattr(api, "recording", lambda: True)
    with pytest.raises(api.SaveError, match="no graphs given"):
        foundry_core.save(tmp_path / "a", graphs={}, region=object())
    region = types.SimpleNamespace(setup_segments=None)
    with pytest.raises(api.SaveError, match=r"region.end_setup\(\)"):
        foundry_core.save(tmp_path / "a", graphs={"g": object()}, region=region)
    assert not (tmp_path / "a").exists()


def test_random_kernels_refused_without_rng_detection():
    """save(detect_rng=False) replays nothing; a graph with a Philox-drawing kernel is refused instead."""
    from foundry_core import api

    def graph(*names):
        return {"nodes": [{"type": "kernel", "name": n} for n in names] + [{"type": "empty"}], "edges": []}

    api._refuse_random_kernels(
        graph("_ZN5flash11flash_fwd_kernelI", "triton_poi_fused_add_mul_0", "nvjet_hsh")
    )
    for name in (
        "_ZN2at6native43distribution_elementwise_grid_stride_kernelIfLi4E",
        "_ZN2at6native20fused_dropout_kernelIN3c104HalfE",
        "triton_poi_fused_rand_0",
        "_ZN2at6native24sampleMultinomialOnceIfE",
    ):
        with pytest.raises(api.SaveError, match="random-number kernel"):
            api._refuse_random_kernels(graph("nvjet_hsh", name))
    nested = {"nodes": [{"type": "graph", "graph": graph("triton_poi_fused_randn_1")}], "edges": []}
    with pytest.raises(api.SaveError, match="detect_rng=False"):
        api._refuse_random_kernels(nested)
