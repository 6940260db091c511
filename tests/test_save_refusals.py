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
    # NVSHMEM's heap placed (foundry_core.nvshmem.place_heap) but reserved elsewhere by the driver:
    # the graphs' addresses in it could not repeat at LOAD.
    from foundry_core import nvshmem

    def misplaced():
        raise nvshmem.HeapPlacementError("NVSHMEM's heap is at 0x7f0000000000, not 0x700000000000")

    monkeypatch.setattr(nvshmem, "heap_record", misplaced)
    region = types.SimpleNamespace(setup_segments=3)
    with pytest.raises(api.SaveError, match="not saved: NVSHMEM's heap is at 0x7f0000000000"):
        foundry_core.save(tmp_path / "a", graphs={"g": object()}, region=region)
    assert not (tmp_path / "a").exists()


def test_a_save_that_expects_no_archive_stops_before_any_work_when_one_appeared(monkeypatch, tmp_path):
    from foundry_core.archive import ArchiveWriter, open_archive

    with ArchiveWriter(tmp_path / "a") as w:  # another replica's SAVE, published meanwhile
        w.add_bytes("memory/00000.bin", b"other")
        w.commit(fingerprint={"gpu_name": "NVIDIA H200"}, meta={"by": "other"})
    monkeypatch.setattr(api, "recording", lambda: pytest.fail("the check comes first"))
    with pytest.raises(foundry_core.ArchiveSuperseded, match="another SAVE published it"):
        foundry_core.save(tmp_path / "a", graphs={"g": object()}, region=object(), expected_version=None)
    assert open_archive(tmp_path / "a").meta == {"by": "other"}


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


def test_the_rng_search_looks_first_at_the_words_the_random_kernels_carry():
    """The seed and offset words are found by reading candidates back after replays, one driver call
    each: the words in the random-number kernels' parameter blocks come first (a handful), all the
    graph's region pointers only where those do not answer."""
    seed_ptr, offset_ptr, weights, not_region = 0x7000_0000_1000, 0x7000_0000_1008, 0x7000_0100_0000, 0xBEEF

    def block(*words, tail=b"\x07\x00\x00\x00\x01\x00\x00\x00"):
        return b"".join(w.to_bytes(8, "little") for w in words) + tail

    philox = {"type": "kernel", "name": "_ZN2at6native43distribution_elementwise_grid_stride_kernelIfLi4E"}
    desc = {
        "nodes": [
            {"type": "kernel", "name": "nvjet_hsh_gemm", "params": block(weights, seed_ptr + 64)},
            {**philox, "params": block(weights + 8, not_region, seed_ptr, offset_ptr)},
            {"type": "graph", "graph": {"nodes": [{**philox, "params": block(offset_ptr, seed_ptr + 3)}]}},
            {"type": "empty"},
        ]
    }
    pointers = {seed_ptr, offset_ptr, weights, weights + 8, seed_ptr + 64, seed_ptr + 3}
    # The GEMM's words stay out; so does a word that is no region pointer, and one that is unaligned.
    assert api._rng_candidates(desc, pointers) == [seed_ptr, offset_ptr, weights + 8]
    assert api._rng_candidates({"nodes": [desc["nodes"][0]]}, pointers) == []


# --- SAVE's trial build (graph_build.check_rebuilds): every graph built once as LOAD will -------------


class _Modules:
    """Stand-in for LoadedModules: what was loaded and whether it was all unloaded."""

    log: list = []

    def __init__(self):
        self.loaded = []

    def load(self, digest, data):
        if data == b"not a cubin":
            raise driver.CudaError("cuModuleLoadData", _Err())
        self.loaded.append(digest)
        _Modules.log.append(("load", digest))

    def unload(self):
        _Modules.log.append(("unload", tuple(self.loaded)))


@pytest.fixture
def trial(monkeypatch):
    """check_rebuilds with stand-in modules; ``native`` refuses the encodings in ``native_refuses``,
    the Python builder the graphs whose description says ``"python_refuses"``."""
    from foundry_core import graph_build

    _Modules.log = []
    monkeypatch.setattr(graph_build, "LoadedModules", _Modules)
    built = []

    def run(walked, blobs, native_refuses=(), with_native=True, images=None):
        class Native:
            def check(self, blob):
                built.append(("native", blob))
                if blob in native_refuses:
                    raise graphs.GraphError("native graph builder: graph 0 node 1 (kernel): refused")

        def python(desc, modules, attrs):
            built.append(("python", desc["id"]))
            if desc.get("python_refuses"):
                raise driver.CudaError("cuGraphAddKernelNode (kernel k, smem 102400)", _Err())

        monkeypatch.setattr(
            graph_build.NativeBuilder, "create", lambda m, k: Native() if with_native else None
        )
        monkeypatch.setattr(graph_build, "_check_python", python)
        images = images or {"img-a": b"a", "img-b": b"b"}
        graph_build.check_rebuilds(images, [["img-a", "k", {}]], walked, blobs)
        return built

    return run


class _Err(int):
    name = "CUDA_ERROR_INVALID_VALUE"

    def __new__(cls):
        return int.__new__(cls, 1)


def test_the_trial_build_builds_every_graph_natively_and_unloads_what_it_loaded(trial):
    walked = [("decode/size=512", {"id": 0}), ("decode/size=1", {"id": 1})]
    assert trial(walked, [b"g0", b"g1"]) == [("native", b"g0"), ("native", b"g1")]
    assert _Modules.log == [("load", "img-a"), ("load", "img-b"), ("unload", ("img-a", "img-b"))]


def test_a_graph_no_builder_can_rebuild_fails_the_trial_naming_it(trial):
    walked = [("decode/size=1", {"id": 1}), ("decode/size=512", {"id": 0, "python_refuses": True})]
    with pytest.raises(graphs.GraphError) as refused:
        trial(walked, [b"g1", b"g0"], native_refuses={b"g0"})
    assert str(refused.value).startswith("graph 'decode/size=512' would not restore: cuGraphAddKernelNode")
    assert "CUDA_ERROR_INVALID_VALUE" in str(refused.value)
    assert _Modules.log[-1] == ("unload", ("img-a", "img-b"))  # unloaded on the way out too


def test_what_the_python_builder_rebuilds_passes_as_it_would_at_load(trial):
    # LOAD falls back to the Python builder where the native one fails: so does the trial.
    walked = [("decode/size=512", {"id": 0})]
    assert trial(walked, [b"g0"], native_refuses={b"g0"}) == [("native", b"g0"), ("python", 0)]


def test_graphs_kept_in_json_form_are_tried_with_the_python_builder(trial):
    walked = [("a", {"id": 0}), ("b", {"id": 1})]
    assert trial(walked, [None, None], with_native=True) == [("python", 0), ("python", 1)]
    assert trial([("c", {"id": 2})], [b"g"], with_native=False)[-1] == ("python", 2)


def test_a_code_image_the_driver_will_not_load_fails_the_trial_naming_it(trial):
    from foundry_core.modules import ModuleError

    with pytest.raises(ModuleError, match=r"code image img-b does not load: cuModuleLoadData failed"):
        trial([("a", {"id": 0})], [b"g"], images={"img-a": b"a", "img-b": b"not a cubin"})
    assert _Modules.log[-1] == ("unload", ("img-a",))


class _Generator:
    def __init__(self):
        self.seed, self.offset = 1, 0

    def get_state(self):
        return (self.seed, self.offset)

    def set_state(self, state):
        self.seed, self.offset = state

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset

    def manual_seed(self, seed):
        self.seed = seed


@pytest.mark.parametrize("named", [True, False], ids=["philox-kernel-named", "unnamed-random-kernel"])
def test_the_rng_search_replays_twice_more_only_when_the_named_kernels_do_not_answer(monkeypatch, named):
    seed_word, offset_word, other = 0x7000_0000_1000, 0x7000_0000_1008, 0x7000_0000_2000
    memory, replays, read = {}, [], []
    gen = _Generator()

    class Graph:
        def replay(self):  # what a captured Philox kernel's graph does: publish seed and offset
            replays.append(1)
            memory[seed_word], memory[offset_word], memory[other] = gen.seed, gen.offset, 7
            gen.offset += 4

    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(default_generators=[gen], synchronize=lambda device: None)
    )
    monkeypatch.setattr(api, "_torch", lambda: fake_torch)
    monkeypatch.setattr(
        api, "_read_words", lambda addrs: read.append(len(addrs)) or [memory[a] for a in addrs]
    )
    name = "_ZN2at6native43distribution_elementwise_grid_stride_kernelIfLi4E" if named else "my_sampler"
    block = b"".join(w.to_bytes(8, "little") for w in (seed_word, offset_word))
    desc = {"nodes": [{"type": "kernel", "name": name, "params": block}]}
    found = api._find_rng_state(Graph(), desc, {seed_word, offset_word, other}, 0)
    assert found == {"increment": 4, "seed_ptr": seed_word, "offset_ptr": offset_word}
    assert len(replays) == 3  # an unnamed kernel: no narrow round at all, all pointers at once
    assert read == ([2, 2] if named else [3, 3])
    assert gen.get_state() == (1, 0)  # the generator is given back as it was before the search

    # Named, but the words it carries are not the ones that follow the generator: all pointers next.
    replays.clear(), read.clear()
    decoy = {"type": "kernel", "name": "philox_decoy", "params": other.to_bytes(8, "little")}
    found = api._find_rng_state(Graph(), {"nodes": [decoy]}, {seed_word, offset_word, other}, 0)
    assert found["seed_ptr"] == seed_word and len(replays) == 5 and read == [1, 1, 3, 3]
