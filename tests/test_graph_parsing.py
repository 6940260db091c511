"""CPU tests of the parsers SAVE relies on: kernel argument blocks (both launch forms), the pointer
audit, cubin symbol tables, and LOAD's placement check. No GPU: driver calls are not reached or are
replaced where a test says so."""

import ctypes
import shutil
import subprocess
import types

import pytest

from foundry_core import graph_build, graph_compare, graphs, modules
from foundry_core.region import PlacementError, Region, Segment


def _params(kernel_params=0, extra=0):
    return types.SimpleNamespace(kernelParams=kernel_params, extra=extra)


def test_kernel_params_from_pointer_array():
    a = ctypes.c_uint64(0x1122334455667788)
    b = ctypes.c_int32(-5)
    argv = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    layout = [(0, 8), (8, 4)]
    data = graphs._kernel_param_bytes(_params(kernel_params=ctypes.addressof(argv)), layout, "k")
    assert data == (0x1122334455667788).to_bytes(8, "little") + (-5).to_bytes(4, "little", signed=True)


def test_kernel_params_native_and_python_copies_agree(monkeypatch):
    """Padding between parameters stays zero, and the native packer gives the Python loop's bytes."""
    values = [ctypes.c_uint64(0xA1A2A3A4A5A6A7A8), ctypes.c_int32(-7), ctypes.c_uint64(3), ctypes.c_uint8(9)]
    argv = (ctypes.c_void_p * 4)(*[ctypes.addressof(v) for v in values])
    layout = [(0, 8), (8, 4), (16, 8), (24, 1)]  # 4 bytes of padding after the int32
    p = _params(kernel_params=ctypes.addressof(argv))
    native = graphs._kernel_param_bytes(p, layout, "k", graphs._packed_layout(layout))
    monkeypatch.setattr(graphs._native, "graph_lib", lambda: None)
    assert graphs._kernel_param_bytes(p, layout, "k") == native
    assert len(native) == 25 and native[12:16] == bytes(4) and native[24] == 9


def test_kernel_params_from_packed_extra_buffer():
    packed = ctypes.create_string_buffer(bytes(range(24)), 24)
    size = ctypes.c_size_t(24)
    extra = (ctypes.c_void_p * 5)(
        graphs.CU_LAUNCH_PARAM_BUFFER_POINTER,
        ctypes.addressof(packed),
        graphs.CU_LAUNCH_PARAM_BUFFER_SIZE,
        ctypes.addressof(size),
        graphs.CU_LAUNCH_PARAM_END,
    )
    data = graphs._kernel_param_bytes(_params(extra=ctypes.addressof(extra)), [(0, 24)], "nvjet")
    assert data == bytes(range(24))


def test_kernel_params_refuse_short_or_missing_buffer():
    packed = ctypes.create_string_buffer(8)
    size = ctypes.c_size_t(8)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(packed), 2, ctypes.addressof(size), 0)
    with pytest.raises(graphs.GraphError, match="parameter buffer of 8 bytes"):
        graphs._kernel_param_bytes(_params(extra=ctypes.addressof(extra)), [(0, 16)], "k")
    with pytest.raises(graphs.GraphError, match="neither kernelParams nor extra"):
        graphs._kernel_param_bytes(_params(), [(0, 8)], "k")


def test_pointer_audit(monkeypatch):
    base = 0x600000000000
    segs = graphs.Segments(base, 1 << 30, [(base, 2 << 20), (base + (8 << 20), 2 << 20)])
    auditor = graphs._Auditor(segs)
    ok = (base + 64).to_bytes(8, "little") + (7).to_bytes(8, "little")
    auditor.check_block(ok, lambda off: f"word {off}")
    assert auditor.pointers == {base + 64}
    # A word in the region's range that no allocation covers is data (it is kept as it was), counted.
    hole = (base + (4 << 20)).to_bytes(8, "little")
    auditor.check_block(hole, lambda off: f"word {off}")
    assert auditor.pointers == {base + 64} and auditor.dead_words == 1

    asked = []

    class FakeDriver:  # the driver recognises this word as device memory outside the region
        class CUpointer_attribute:
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2

        @staticmethod
        def cuPointerGetAttribute(attr, value):
            asked.append(value)
            return (0, 2) if value == 0x7F0000000000 else (1, None)

    monkeypatch.setattr(graphs, "cu", lambda: FakeDriver)
    with pytest.raises(graphs.GraphError, match="outside the Foundry region"):
        auditor.check_block((0x7F0000000000).to_bytes(8, "little"), lambda off: f"word {off}")
    # Not memory: asked once, then known for the rest of the SAVE (here, a second graph's auditor
    # sharing the set); device memory is asked, and refused, every time.
    pair = (16 << 32 | 8).to_bytes(8, "little")  # two int32 packed: looks like an address
    auditor.check_block(pair + (0x7E0000000000).to_bytes(8, "little") + pair, lambda off: f"word {off}")
    second = graphs._Auditor(segs, graphs.WalkMemo(not_memory=auditor.not_memory))
    second.check_block(pair, lambda off: f"word {off}")
    assert asked == [0x7F0000000000, 16 << 32 | 8, 0x7E0000000000]
    with pytest.raises(graphs.GraphError, match="outside the Foundry region"):
        second.check_block((0x7F0000000000).to_bytes(8, "little"), lambda off: f"word {off}")
    assert asked[-1] == 0x7F0000000000


def test_pointer_audit_looks_at_each_word_once_per_save(monkeypatch):
    base = 0x600000000000
    segs = graphs.Segments(base, 1 << 30, [(base, 2 << 20)])
    looked = []
    live = segs.live
    monkeypatch.setattr(segs, "live", lambda addr: looked.append(addr) or live(addr))
    memo = graphs.WalkMemo()
    first = graphs._Auditor(segs, memo)
    ptr, hole = (base + 64).to_bytes(8, "little"), (base + (4 << 20)).to_bytes(8, "little")
    first.check_block(ptr + hole + ptr + hole + hole, lambda off: f"word {off}")
    assert first.pointers == {base + 64} and first.dead_words == 3  # every occurrence counted
    assert looked == [base + 64, base + (4 << 20)]  # each distinct word looked at once
    second = graphs._Auditor(segs, memo)  # the next graph of the same SAVE
    second.check_block(ptr, lambda off: f"word {off}")
    assert second.pointers == {base + 64} and len(looked) == 2  # known live: not looked at again

    class Driver:  # two words that are device memory outside the region: the first one is named
        class CUpointer_attribute:
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2

        @staticmethod
        def cuPointerGetAttribute(attr, value):
            return 0, 2

    monkeypatch.setattr(graphs, "cu", lambda: Driver)
    block = (0x7F0000000000 + 8).to_bytes(8, "little") + ptr + (0x7F0000000000).to_bytes(8, "little")
    with pytest.raises(graphs.GraphError, match="word 0 points to memory at 0x7f0000000008"):
        second.check_block(block, lambda off: f"word {off}")


def test_graph_description_counts():
    desc = {
        "nodes": [
            {"type": "kernel", "name": "a"},
            {
                "type": "graph",
                "graph": {"nodes": [{"type": "kernel", "name": "b"}, {"type": "empty"}], "edges": []},
            },
        ],
        "edges": [[0, 1, 0, 0, 0]],
    }
    assert graphs.count_nodes(desc) == 4
    assert graphs.kernel_names(desc) == ["a", "b"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build a real cubin")
def test_elf_functions_on_a_real_cubin(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(
        'extern "C" __global__ void foundry_probe_add(float* x, float y) { x[threadIdx.x] += y; }\n'
        "template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= N; }\n"
        "template __global__ void scale<3>(float*);\n"
        'extern "C" __global__ void foundry_probe_big(float* x) {\n'
        "  float a[32];\n"
        "#pragma unroll\n"
        "  for (int i = 0; i < 32; i++) a[i] = x[threadIdx.x * 32 + i] * (i + 1);\n"
        "  float s = 0;\n"
        "#pragma unroll\n"
        "  for (int i = 0; i < 32; i++) for (int j = 0; j < 32; j++) s += a[i] * a[j] * (i ^ j);\n"
        "  x[threadIdx.x] = s;\n"
        "}\n"
    )
    cubin = tmp_path / "k.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(src), "-o", str(cubin)], check=True)
    funcs = modules.elf_functions(cubin.read_bytes())
    assert "foundry_probe_add" in funcs
    assert "_Z5scaleILi3EEvPf" in funcs
    assert all(0 < regs < 256 for regs in funcs.values()), funcs
    assert funcs["foundry_probe_big"] > 4 * funcs["foundry_probe_add"]  # counts belong to the right kernel


def test_elf_functions_rejects_non_elf():
    assert modules.elf_functions(b"not an elf at all" * 10) == {}
    assert modules.elf_functions(b"\x7fELF" + b"\x02" + b"\0" * 10) == {}


def _region(segments, base=0x600000000000, size=1 << 30):
    r = object.__new__(Region)
    r.base, r.size, r.device, r.setup_segments = base, size, 0, None
    r.segments = lambda: segments
    return r


def _layout(rows, setup=None, base=0x600000000000):
    return {
        "base": base,
        "size": 1 << 30,
        "device": 0,
        "cursor": 0,
        "setup_segments": setup,
        "segments": rows,
    }


B = 0x600000000000
SAVED = [
    [B, 2 << 20, 1, "weights", "eager"],
    [B + (2 << 20), 2 << 20, 1, "kv_cache", "eager"],
    [B + (4 << 20), 4 << 20, 0, "warmup", "eager"],
    [B + (8 << 20), 2 << 20, 1, "capture", "graph"],
]


def _seg(i, row, live=None):
    s = Segment.from_json(i, row)
    return Segment(s.index, s.addr, s.size, s.live if live is None else live, s.label, s.kind)


def test_placement_refuses_divergent_address():
    current = [_seg(0, SAVED[0]), Segment(1, B + (6 << 20), 2 << 20, True, "kv_cache")]
    with pytest.raises(PlacementError, match=r"allocation #1 diverged"):
        _region(current).restore_layout(_layout(SAVED))


def test_placement_refuses_extra_allocations_and_wrong_label():
    current = [_seg(i, SAVED[i]) for i in range(4)] + [Segment(4, B + (10 << 20), 2 << 20, True, "x")]
    with pytest.raises(PlacementError, match="has no counterpart at SAVE"):
        _region(current).restore_layout(_layout(SAVED))
    relabelled = [_seg(0, SAVED[0]), Segment(1, B + (2 << 20), 2 << 20, True, "static")]
    with pytest.raises(PlacementError, match="'static'"):
        _region(relabelled).restore_layout(_layout(SAVED))


def test_placement_refuses_freed_segment_and_setup_count():
    current = [_seg(0, SAVED[0]), _seg(1, SAVED[1], live=False)]
    with pytest.raises(PlacementError, match="live at SAVE but has been freed"):
        _region(current).restore_layout(_layout(SAVED))
    with pytest.raises(PlacementError, match="made 1 allocations before restoring, the SAVE's setup made 2"):
        _region([_seg(0, SAVED[0])]).restore_layout(_layout(SAVED, setup=2))


def test_placement_refuses_other_region_settings():
    with pytest.raises(PlacementError, match="region base"):
        _region([]).restore_layout(_layout(SAVED, base=0x400000000000))


def test_launch_makes_one_stream_handle_per_stream_and_names_the_error(monkeypatch):
    import enum

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_ILLEGAL_ADDRESS = 700

    made, launched = [], []

    class FakeDriver:
        class CUstream:
            def __init__(self, init_value):
                made.append(init_value)
                self.value = init_value

        @staticmethod
        def cuGraphLaunch(exec_, stream):
            launched.append((exec_, stream.value))
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS if stream.value == 9 else CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(graph_build, "cu", lambda: FakeDriver)
    rebuilt = graph_build.Rebuilt("graph", "exec", [], [])
    for stream in (5, 5, 5, 7, 7):
        rebuilt.launch(stream)
    assert made == [5, 7] and launched == [("exec", 5)] * 3 + [("exec", 7)] * 2
    with pytest.raises(graph_build.CudaError, match="cuGraphLaunch failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        rebuilt.launch(9)


def _saved_graph():
    kernel = {
        "type": "kernel",
        "image": "abc",
        "name": "gemm",
        "grid": [4, 1, 1],
        "block": [128, 1, 1],
        "smem": 0,
        "layout": [[0, 8]],
        "params": "AAAAAAAAYAA=",
        "attrs": {"priority": 1},
    }
    memset = {"type": "memset", "dst": 0x600000001000, "pitch": 0, "value": 0, "element_size": 4}
    memset.update(width=16, height=1)
    child = {"nodes": [{"type": "empty"}, {"type": "event_wait", "event": 0}], "edges": [[0, 1, 0, 0, 0]]}
    return {
        "nodes": [kernel, memset, {"type": "graph", "graph": child}],
        "edges": [[1, 0, 0, 0, 0], [0, 2, 0, 0, 1]],
    }


def _as_built(saved):
    """What structure() reads back for the same graph: the driver's type names, edges sorted, no
    image or layout, memset/memcpy fields as it reads them."""
    import copy

    built = copy.deepcopy(saved)
    for node in built["nodes"]:
        node.pop("image", None)
        node.pop("layout", None)
        if node["type"] == "graph":
            node["graph"] = _as_built(node["graph"])
        elif node["type"] == "event_wait":
            node["type"] = "wait_event"
            node.pop("event")
    built["edges"] = sorted(built["edges"])
    return built


def test_compare_a_restored_graph_with_its_description():
    saved = _saved_graph()
    assert graph_compare.compare(saved, _as_built(saved)) is None

    built = _as_built(saved)
    built["nodes"][0]["grid"] = [8, 1, 1]
    assert graph_compare.compare(saved, built) == "node 0 (gemm): grid [4, 1, 1] saved, [8, 1, 1] built"

    built = _as_built(saved)
    built["nodes"][0]["attrs"] = {}  # a launch attribute lost
    assert "attrs {'priority': 1} saved, {} built" in graph_compare.compare(saved, built)

    built = _as_built(saved)
    built["edges"] = built["edges"][:1]  # a dependency lost: kernels could overlap
    why = graph_compare.compare(saved, built)
    assert why.startswith("graph top: 2 edges saved, 1 built") and "first saved only" in why

    built = _as_built(saved)
    next(e for e in built["edges"] if e[4] == 1)[4] = 0  # a programmatic edge became a plain one
    assert "edges" in graph_compare.compare(saved, built)

    built = _as_built(saved)
    built["nodes"][2]["graph"]["nodes"][1]["type"] = "event_record"
    assert graph_compare.compare(saved, built) == "node 2.1: event_wait saved, event_record built"

    built = _as_built(saved)
    built["nodes"].pop()
    assert graph_compare.compare(saved, built) == "graph top: 3 nodes saved, 2 built"

    # Addresses (parameter bytes, memset and copy pointers) differ in a graph captured elsewhere:
    # compared unless told not to.
    built = _as_built(saved)
    built["nodes"][0]["params"] = "AAAAAAAAcAA="
    built["nodes"][1]["dst"] = 0x700000001000
    assert "params" in graph_compare.compare(saved, built)
    assert graph_compare.compare(saved, built, addresses=False) is None


def test_restored_check_reads_every_graph_back(monkeypatch):
    """Restored.check compares each graph as the driver holds it with what the archive describes."""
    import types

    import foundry_core.api as api

    saved = _saved_graph()
    wrong = _as_built(saved)
    wrong["nodes"][0]["block"] = [64, 1, 1]
    held = {"g-ok": _as_built(saved), "g-wrong": wrong}
    import foundry_core.rebuilding as rebuilding

    monkeypatch.setattr(rebuilding, "structure", lambda graph: held[graph])
    monkeypatch.setattr(rebuilding, "described", lambda archive, entry: saved)
    archive = types.SimpleNamespace(meta={"graphs": [{"name": "g-ok"}, {"name": "g-wrong"}]})
    graphs_ = {name: api.RestoredGraph(name, types.SimpleNamespace(graph=name), 0, None, 3) for name in held}
    restored = api.Restored(archive, None, graphs_, {}, {}, [], None, {})
    assert restored.check() == {"g-wrong": "node 0 (gemm): block [128, 1, 1] saved, [64, 1, 1] built"}
