"""Collective kernels in a graph being saved (foundry_core/collectives.py): NCCL refused with its
reason before the pointer audit, symmetric-memory and custom all-reduce kernels counted per graph,
stored in the archive and shown by ``foundry inspect``. On the CPU, over a stand-in for the driver's
graph-walking calls; the kernel names are the libraries' own (mangled as nvcc mangles them)."""

from __future__ import annotations

import types

import pytest

from foundry_core import collectives, graphs

NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
SYMM = "_ZN12_GLOBAL__N_126one_shot_all_reduce_kernelIN3c108BFloat16ELi16ELi2EEEvPPT_S4_S4_mmPPjmm"
SYMM_2SHOT = "_ZN12_GLOBAL__N_133two_shot_all_reduce_kernel_inplaceIfLi16ELi4EEEvPPT_mmPPjmm"
CUSTOM = "_ZN4vllm26cross_device_reduce_1stageI13__nv_bfloat16Li2EEEvPNS_8RankDataENS_11RankSignalsEPNS_6SignalEPT_ii"
GEMM = "_Z20ampere_bf16_gemm_128PKfPfi"


@pytest.mark.parametrize(
    "name,kind",
    [
        (NCCL, "nccl"),
        ("ncclKernel_AllReduce_RING_LL_Sum_half", "nccl"),
        (SYMM, "symm_mem"),
        (SYMM_2SHOT, "symm_mem"),
        ("_ZN12_GLOBAL__N_126multimem_all_reduce_kernelIfLi16EEEvPT_mPPjmm", "symm_mem"),
        ("_ZN12_GLOBAL__N_135multimem_one_shot_all_reduce_kernelIfLi16EEEvPT_S1_mPPjmm", "symm_mem"),
        ("_ZN12_GLOBAL__N_126multimem_all_gather_kernelILi16EEEvPcS0_mPPjmm", "symm_mem"),
        (CUSTOM, "custom_all_reduce"),
        (GEMM, None),
        ("triton_poi_fused_add_all_reduce_0", None),  # an Inductor kernel named after its op: not one
    ],
)
def test_kinds_by_name(name, kind):
    assert collectives.kind_of(name) == kind


def test_only_nccl_is_refused_and_the_reason_says_what_to_do():
    why = collectives.refusal("nccl", NCCL)
    assert NCCL in why and "torch symmetric memory" in why and "--enable-torch-symm-mem" in why
    assert collectives.refusal("symm_mem", SYMM) is None
    assert collectives.refusal("custom_all_reduce", CUSTOM) is None


class _Graph:
    """A stand-in for the driver's graph-walking calls: kernel nodes with the given names."""

    KERNEL = 0
    handles: dict = {}  # name -> function handle, shared by the graphs of one test (fixture below)

    def __init__(self, names, asked=None, smem=None):
        self.names = names
        self.asked = asked if asked is not None else []  # the functions whose name was asked
        self.smem = smem or [0] * len(names)  # each node's dynamic shared memory

    def driver(self):
        names = self.names
        ok = (0,)
        asked = self.asked
        by_name = self.handles  # one function handle per function, the same in every graph
        for name in names:
            by_name.setdefault(name, 100 + len(by_name))
        name_of = {h: n for n, h in by_name.items()}

        def get_name(func):
            asked.append(func)
            return (*ok, name_of[func].encode())

        def get_nodes(graph, n):
            return (0, list(range(len(names))), len(names)) if n else (0, None, len(names))

        return types.SimpleNamespace(
            CUgraphNodeType=types.SimpleNamespace(CU_GRAPH_NODE_TYPE_KERNEL=self.KERNEL),
            cuGraphGetNodes=get_nodes,
            cuGraphNodeGetType=lambda node: (*ok, self.KERNEL),
            cuGraphKernelNodeGetParams=lambda node: (
                *ok,
                types.SimpleNamespace(
                    func=by_name[names[node]],
                    gridDimX=1,
                    gridDimY=1,
                    gridDimZ=1,
                    blockDimX=32,
                    blockDimY=1,
                    blockDimZ=1,
                    sharedMemBytes=self.smem[node],
                ),
            ),
            cuFuncGetName=get_name,
            cuGraphGetEdges=lambda graph, n: (0, None, None, None, 0),
        )


@pytest.fixture(autouse=True)
def _fresh_handles(monkeypatch):
    monkeypatch.setattr(_Graph, "handles", {})


@pytest.fixture
def walk(monkeypatch):
    """serialize() over fake kernel nodes, the parts that need a GPU stubbed."""

    def run(names, kernels=None, memo=None, asked=None, smem=None, attrs=None):
        monkeypatch.setattr(graphs, "cu", _Graph(names, asked, smem).driver)
        monkeypatch.setattr(graphs, "_param_layout", lambda func: [])
        monkeypatch.setattr(
            graphs, "_kernel_param_bytes", lambda p, layout, name, words=None, total=None: b""
        )
        monkeypatch.setattr(graphs, "_read_attrs", lambda node: {})
        monkeypatch.setattr(graphs, "function_attributes", attrs or (lambda func: {"handle": func}))
        recorded = types.SimpleNamespace(match=lambda func, name: "img")
        segments = graphs.Segments(0x600000000000, 1 << 30, [])
        return graphs.serialize("graph", recorded, segments, {} if kernels is None else kernels, memo)

    return run


def test_serialize_counts_collectives_per_kind(walk):
    desc, _ = walk([GEMM, SYMM, GEMM, SYMM_2SHOT, CUSTOM])
    assert desc["collectives"] == {"custom_all_reduce": 1, "symm_mem": 2}
    assert [n["name"] for n in desc["nodes"]] == [GEMM, SYMM, GEMM, SYMM_2SHOT, CUSTOM]


def test_a_graph_without_collectives_records_none(walk):
    desc, _ = walk([GEMM, GEMM])
    assert "collectives" not in desc


def test_an_nccl_kernel_refuses_the_graph_naming_the_node(walk):
    with pytest.raises(
        graphs.GraphError, match=r"graph node 1: kernel ncclDevKernel_AllReduce.* NCCL collective"
    ):
        walk([GEMM, NCCL])


def test_totals_for_the_archive():
    from foundry_core.api import _collective_totals

    descs = [{"collectives": {"symm_mem": 2}}, {}, {"collectives": {"symm_mem": 1, "custom_all_reduce": 3}}]
    assert _collective_totals(descs) == {"custom_all_reduce": 3, "symm_mem": 3}
    assert _collective_totals([{}, {}]) == {}


def test_inspect_shows_each_graphs_collectives_and_the_totals(tmp_path, capsys):
    import json

    from foundry_core.archive import ArchiveWriter
    from foundry_core.cli import main

    desc = {
        "nodes": [{"type": "kernel", "name": SYMM}, {"type": "kernel", "name": SYMM}],
        "edges": [[0, 1, 0, 0, 0]],
    }
    meta = {
        "kind": "foundry-graphs",
        "graphs": [
            {
                "name": "decode/bs=8",
                "nodes": 2,
                "rng": False,
                "file": "graphs/0000.json",
                "collectives": {"symm_mem": 2},
            },
            {"name": "decode/bs=1", "nodes": 2, "rng": False, "file": "graphs/0001.json"},
        ],
        "kernels": [],
        "images": [],
        "collectives": {"symm_mem": 2},
        "symmetric": [
            {
                "name": "tp",
                "rank": 0,
                "world_size": 2,
                "buffer_size": 64 << 20,
                "signal_pad_size": 9216,
                "buffer_ptrs": [0x7F0000000000, 0x7F0040000000],
                "signal_pad_ptrs": [0x7F0004000000, 0x7F0044000000],
                "buffer_ptrs_dev": 0x600000001000,
                "signal_pad_ptrs_dev": 0x600000001200,
                "multicast_ptr": 0,
            }
        ],
    }
    with ArchiveWriter(tmp_path / "a") as w:
        w.add_bytes("graphs/0000.json", json.dumps(desc).encode())
        w.add_bytes("graphs/0001.json", json.dumps(desc).encode())
        w.commit(fingerprint={"gpu_name": "H200"}, meta=meta)
    assert main(["inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("decode/")}
    assert rows["decode/bs=8"].rstrip().endswith("symm_mem 2") and rows["decode/bs=1"].rstrip().endswith("-")
    assert "collective kernels: symm_mem 2 (NCCL kernels are refused at SAVE)" in out
    assert (
        "symmetric tp: rank 0 of 2, 64.0 MiB per rank at 0x7f0000000000, 0x7f0040000000; multicast 0x0" in out
    )


def test_the_driver_is_asked_about_each_function_once_per_save(walk):
    """A save's graphs repeat the same functions at every layer and batch size: their name, layout,
    image and attributes are read once, and the descriptions are the same as without the cache."""
    asked, kernels, memo = [], {}, graphs.WalkMemo()
    first, _ = walk([GEMM, SYMM, GEMM, GEMM], kernels, memo, asked)
    second, _ = walk([SYMM, GEMM], kernels, memo, asked)
    assert sorted(asked) == [100, 101]  # two functions, each asked once across both graphs
    assert [n["name"] for n in first["nodes"]] == [GEMM, SYMM, GEMM, GEMM]
    assert [n["name"] for n in second["nodes"]] == [SYMM, GEMM]
    assert second["collectives"] == {"symm_mem": 1} and first["collectives"] == {"symm_mem": 1}
    assert kernels == {("img", GEMM): {"handle": 100}, ("img", SYMM): {"handle": 101}}
    uncached, _ = walk([GEMM, SYMM, GEMM, GEMM])
    assert uncached["nodes"] == first["nodes"]


def test_the_shared_memory_limit_saved_covers_every_nodes_need(walk):
    """A launcher that sets a kernel's dynamic shared memory limit on every launch (FlashInfer's
    RMSNorm, at two widths per forward) leaves it at the last launch's need after capture; the
    archive must hold the largest, or LOAD's cuGraphAddKernelNode refuses the bigger nodes
    (CUDA_ERROR_INVALID_VALUE)."""
    kernels, memo = {}, graphs.WalkMemo()
    last_set = lambda func: {"max_dynamic_shared": 61440, "preferred_carveout": -1}  # noqa: E731
    big, _ = walk([GEMM, SYMM], kernels, memo, smem=[102400, 0], attrs=last_set)
    small, _ = walk([GEMM, SYMM], kernels, memo, smem=[61440, 0], attrs=last_set)
    assert [n["smem"] for n in big["nodes"]] == [102400, 0] and small["nodes"][0]["smem"] == 61440
    assert kernels[("img", GEMM)] == {"max_dynamic_shared": 102400, "preferred_carveout": -1}
    assert kernels[("img", SYMM)]["max_dynamic_shared"] == 61440  # never lowered
    # Where the driver did not say, nothing is made up.
    bare = {}
    walk([GEMM], bare, smem=[4096])
    assert "max_dynamic_shared" not in bare[("img", GEMM)]
