"""Building graphs ahead of their memory, on the CPU: the native scan of an encoding's memset and
memcpy nodes (what a stand-in must hold), the builder's refusals without a driver, and the restore
flow around it (stand-in sized and freed, memory nodes re-pointed after the mapping, a graph whose
re-pointing fails rebuilt from scratch); and the SAVE walk's native reading of launch attributes.
The native parts run in a subprocess against a stand-in libcuda.so.1 (tests/helpers_native); the
real driver's part runs on the GPU: tests/gpu."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import foundry_core as fc
from foundry_core import _native, graph_build, graph_codec, graphs, rebuilding, standin
from foundry_core.graphs import GraphError

KERNELS = [["img-a", "k_add", {}]]
IDS = graph_codec.kernel_ids(KERNELS)
ROOT = Path(__file__).resolve().parents[1]


def _native_or_skip():
    if _native.graph_lib() is None:
        pytest.skip("the native library is not installed (pip install -e .)")


def _kernel():
    return {
        "type": "kernel",
        "image": "img-a",
        "name": "k_add",
        "grid": [1, 1, 1],
        "block": [32, 1, 1],
        "smem": 0,
        "layout": [[0, 8]],
        "params": "AAAAAAAAAAA=",
        "attrs": {},
    }


def _memset(width, element_size=4, pitch=0, height=1):
    return {
        "type": "memset",
        "dst": 0x600000001000,
        "pitch": pitch,
        "value": 0,
        "element_size": element_size,
        "width": width,
        "height": height,
    }


def _memcpy(width, src_x=0, dst_x=0, height=1):
    return {
        "type": "memcpy",
        "src": 0x600000002000,
        "dst": 0x600000003000,
        "src_xy": [src_x, 0, 0],
        "dst_xy": [dst_x, 0, 0],
        "src_pitch": [width + src_x if height > 1 else 0, height if height > 1 else 0],
        "dst_pitch": [width + dst_x if height > 1 else 0, height if height > 1 else 0],
        "extent": [width, height, 1],
        "kinds": [2, 2],
    }


def _chain(nodes):
    return [[i, i + 1, 0, 0, 0] for i in range(len(nodes) - 1)]


def _encode(nodes):
    return graph_codec.encode({"nodes": nodes, "edges": _chain(nodes), "events": 0}, IDS)


def _scan(nodes):
    so = _native.graph_lib()
    return graph_build.NativeBuilder(so, [1]).memory_nodes(_encode(nodes))


def test_the_scan_counts_memory_nodes_and_the_stand_in_they_need():
    _native_or_skip()
    child = {"nodes": [_memset(64)], "edges": []}
    nodes = [
        _kernel(),
        _memset(256),  # 1,024 bytes
        _memcpy(4096, dst_x=16),  # source 4,096 and destination 4,112 bytes: 2 x 4,112 of stand-in
        _memset(100, element_size=1, pitch=512, height=4),  # 3 rows of 512, then 100: 1,636 bytes
        _memcpy(64, height=2),  # two rows: the driver re-points one-row copies only
        {"type": "graph", "graph": child},
    ]
    assert _scan(nodes) == graph_build.MemoryNodes(top=4, in_children=1, not_1d=1, standin_bytes=8224)
    assert _scan([_kernel(), {"type": "empty"}]) == (0, 0, 0, 0)


def test_a_span_that_overflows_needs_more_than_any_stand_in():
    _native_or_skip()
    huge = _scan([_memset(1 << 62, element_size=8)])
    assert huge.top == 1 and huge.standin_bytes == 2**64 - 1 > standin.MAX_BYTES


def test_the_scan_refuses_a_damaged_encoding():
    _native_or_skip()
    data = _encode([_memset(16)])
    with pytest.raises(GraphError, match="truncated"):
        graph_build.NativeBuilder(_native.graph_lib(), [1]).memory_nodes(data[:-3])


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is installed here")
def test_without_a_driver_building_ahead_and_re_pointing_fail_with_the_reason():
    _native_or_skip()
    so = _native.graph_lib()
    data = _encode([_kernel(), _memset(16)])
    with pytest.raises(GraphError, match="libcuda"):
        graph_build.NativeBuilder(so, [1]).rebuild_ahead(data, 0x7F0000000000, 2 << 20, 1)
    moved = graph_build.Moved(data, (ctypes.c_void_p * 1)(), 1)

    class _Exec:
        exec = 0

    with pytest.raises(GraphError, match="libcuda"):
        graph_build.retarget(_Exec(), moved)


# --- the native builder against a stand-in libcuda (tests/helpers_native/fake_libcuda.c) ---------------

# In a fresh process whose libcuda.so.1 is the stand-in: a plain build of the encoding, the build
# ahead against a stand-in at STANDIN, re-pointing before and after the graph's memory is mapped.
_DRIVER_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    from foundry_core import _native, graph_build
    from foundry_core.graphs import GraphError

    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_log.restype = ctypes.c_char_p
    fake.fake_map.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    data = bytes.fromhex(sys.argv[1])
    standin, standin_bytes, n_memory = (int(a) for a in sys.argv[2:5])
    builder = graph_build.NativeBuilder(_native.graph_lib(), [0x1111])
    out = {}
    try:
        builder.rebuild(data, None)
        out["plain"] = "built"
    except GraphError as e:
        out["plain"] = str(e)
    fake.fake_map(standin, standin_bytes)
    try:
        rebuilt, moved = builder.rebuild_ahead(data, standin, standin_bytes, n_memory)
    except GraphError as e:
        out["ahead"] = str(e)
    else:
        out["ahead"] = "built"
        out["exec"] = int(rebuilt.exec)
        out["moved"] = [moved.nodes[i] for i in range(moved.count)]
        try:
            graph_build.retarget(rebuilt, moved)
            out["early"] = "re-pointed"
        except GraphError as e:
            out["early"] = str(e)
        fake.fake_map(0x600000000000, 1 << 20)  # the graph's own memory, mapped by the region
        graph_build.retarget(rebuilt, moved)
    out["log"] = fake.fake_log().decode().splitlines()
    print(json.dumps(out))
    """
)
STANDIN = 0x7F0000000000


def _in_fake_driver_process(tmp_path, script, *args):
    """Run ``script`` in a fresh Python whose libcuda.so.1 is the stand-in; its last line of output,
    as JSON."""
    _native_or_skip()
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    lib = tmp_path / "libcuda.so.1"
    src = ROOT / "tests" / "helpers_native" / "fake_libcuda.c"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-fvisibility=hidden",
            f"-I{ROOT / 'native'}",
            str(src),
            "-o",
            str(lib),
        ],
        check=True,
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}  # searched before the system's libcuda
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _with_fake_driver(tmp_path, nodes, standin_bytes=1 << 20, n_memory=None):
    if n_memory is None:
        n_memory = sum(n["type"] in ("memset", "memcpy") for n in nodes)
    args = [_encode(nodes).hex(), str(STANDIN), str(standin_bytes), str(n_memory)]
    return _in_fake_driver_process(tmp_path, _DRIVER_SCRIPT, *args)


def test_memory_nodes_are_built_on_the_stand_in_and_re_pointed_in_the_executable_and_the_graph(tmp_path):
    nodes = [_kernel(), _memset(256), _kernel(), _memcpy(4096, dst_x=16)]
    out = _with_fake_driver(tmp_path, nodes)
    # Without the stand-in the driver refuses the first memset, as the H200's did at 4dd1cfd.
    assert "node 1 (memset): cuGraphAddMemsetNode failed: CUDA_ERROR_INVALID_VALUE" in out["plain"]
    assert out["ahead"] == "built" and len(out["moved"]) == 2
    half = STANDIN + (1 << 19)
    memset_node, memcpy_node = (f"{n:#x}" for n in out["moved"])
    log = out["log"]
    assert f"add memset {memset_node} dst={STANDIN:x} width=256" in log
    assert f"add memcpy {memcpy_node} src={STANDIN:x} dst={half:x} width=4096" in log
    # Re-pointing before the graph's memory is mapped is refused, and says which node.
    assert "node 1 (memset): cuGraphExecMemsetNodeSetParams failed: CUDA_ERROR_INVALID_VALUE" in out["early"]
    exec_ = f"{out['exec']:#x}"
    after = log[log.index(next(line for line in log if line.startswith("instantiate"))) + 1 :]
    assert after == [
        f"exec {exec_} set memset {memset_node} dst=600000001000 width=256",
        f"set memset {memset_node} dst=600000001000 width=256",
        f"exec {exec_} set memcpy {memcpy_node} src=600000002000 dst=600000003000",
        f"set memcpy {memcpy_node} src=600000002000 dst=600000003000",
    ]


def test_a_kernel_node_the_driver_refuses_is_named_with_its_launch(tmp_path):
    big = _kernel()
    big["grid"], big["smem"] = [512, 2, 1], 100 * 1024
    out = _with_fake_driver(tmp_path, [_kernel(), big])
    assert (
        "graph 0 node 1 (kernel): cuGraphAddKernelNode failed: CUDA_ERROR_INVALID_VALUE (function 0, "
        "grid 512 x 2 x 1, block 32 x 1 x 1, dynamic shared memory 102400 bytes)"
    ) in out["plain"], out


@pytest.mark.parametrize(
    "nodes,standin_bytes,refusal",
    [
        ([_kernel(), _memset(1024)], 1024, "node 1 (memset): 4096 bytes, the stand-in has 1024"),
        ([_memcpy(64, height=2)], 1 << 20, "node 0 (memcpy): not one-dimensional, not built ahead"),
        (
            [_kernel(), {"type": "graph", "graph": {"nodes": [_memset(8)], "edges": []}}],
            1 << 20,
            "graph 1 node 0 (memset): in a child graph, not built ahead",
        ),
    ],
    ids=["larger-than-the-stand-in", "several-rows", "in-a-child-graph"],
)
def test_what_cannot_be_built_ahead_is_refused_with_the_node_named(tmp_path, nodes, standin_bytes, refusal):
    out = _with_fake_driver(tmp_path, nodes, standin_bytes, n_memory=1)
    assert refusal in out["ahead"], out
    assert not [line for line in out["log"] if line.startswith("instantiate")]


# --- a SAVE's reading of launch attributes, native (graphs._read_attrs) -------------------------------

# Builds a graph whose kernel nodes carry the attributes given (the stand-in driver keeps them per
# node), then reads each node's back natively.
_ATTRS_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    from foundry_core import _native, graph_build, graphs

    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_attr_node.restype = ctypes.c_void_p
    builder = graph_build.NativeBuilder(_native.graph_lib(), [0x1111])
    builder.rebuild(bytes.fromhex(sys.argv[1]), None)
    read = []
    for k in range(int(sys.argv[2])):
        read.append(graphs._read_attrs_native(fake.fake_attr_node(k)))
    # A node with no attribute set, read after those that set many (the buffers are reused): {}.
    read.append(graphs._read_attrs_native(0x5000))
    print(json.dumps(read))
    """
)


def test_launch_attributes_read_natively_are_those_the_builder_set(tmp_path):
    written = [
        {
            "priority": -3,
            "cluster_dim": [2, 1, 1],
            "mem_sync_domain_map": [0, 1],
            "preferred_carveout": 4294967295,
        },
        {"cooperative": 1, "mem_sync_domain": 1, "cluster_scheduling": 2, "preferred_cluster_dim": [4, 2, 1]},
    ]
    nodes = []
    for attrs in written:
        node = _kernel()
        node["attrs"] = attrs
        nodes.append(node)
    read = _in_fake_driver_process(tmp_path, _ATTRS_SCRIPT, _encode(nodes).hex(), str(len(written)))
    assert read == [*written, {}]  # priority -3 signed, the carveout 0xFFFFFFFF unsigned, dims and maps whole


def test_native_attribute_reading_is_kept_only_once_it_agreed_on_a_node_with_attributes(monkeypatch):
    answers = iter([({}, {}), ({"priority": -1}, {"priority": -1}), ({"priority": 2}, None)])
    calls = []

    def native(node):
        got, _ = answers_now[0]
        calls.append("native")
        return got

    def python(node):
        calls.append("python")
        return answers_now[0][1]

    monkeypatch.setattr(graphs, "_read_attrs_native", native)
    monkeypatch.setattr(graphs, "_read_attrs_python", python)
    monkeypatch.setattr(graphs, "_native_attrs_ok", None)
    answers_now = [next(answers)]
    assert graphs._read_attrs(1) == {} and graphs._native_attrs_ok is None  # nothing set: not yet known
    answers_now = [next(answers)]
    assert graphs._read_attrs(2) == {"priority": -1} and graphs._native_attrs_ok is True
    answers_now = [next(answers)]
    calls.clear()
    assert graphs._read_attrs(3) == {"priority": 2} and calls == ["native"]  # native alone from now on


def test_nodes_without_attributes_are_read_both_ways_only_at_first_and_then_now_and_then(monkeypatch):
    calls = []
    monkeypatch.setattr(graphs, "_read_attrs_native", lambda node: calls.append(("native", node)) or {})
    monkeypatch.setattr(graphs, "_read_attrs_python", lambda node: calls.append(("python", node)) or {})
    monkeypatch.setattr(graphs, "_native_attrs_ok", None)
    monkeypatch.setattr(graphs, "_native_attrs_checked", 0)
    monkeypatch.setattr(graphs, "_native_attrs_read", 0)
    monkeypatch.setattr(graphs, "ATTRS_CHECK_FIRST", 4)
    monkeypatch.setattr(graphs, "ATTRS_CHECK_EVERY", 3)
    for node in range(1, 11):
        assert graphs._read_attrs(node) == {}
    both = [node for kind, node in calls if kind == "python"]
    assert both == [1, 2, 3, 4, 6, 9]  # the first four, then every third node read natively
    assert graphs._native_attrs_ok is None  # still not known: no node had an attribute
    # A node the native reading finds attributes on is always compared until one agrees.
    calls.clear()
    monkeypatch.setattr(graphs, "_read_attrs_native", lambda node: calls.append("native") or {"priority": 1})
    monkeypatch.setattr(graphs, "_read_attrs_python", lambda node: calls.append("python") or {"priority": 1})
    assert graphs._read_attrs(11) == {"priority": 1} and calls == ["native", "python"]
    assert graphs._native_attrs_ok is True


def test_native_attribute_reading_that_disagrees_is_turned_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(graphs, "_read_attrs_native", lambda node: {"priority": 4294967295})
    monkeypatch.setattr(graphs, "_read_attrs_python", lambda node: {"priority": -1})
    monkeypatch.setattr(graphs, "_native_attrs_ok", None)
    with pytest.warns(UserWarning, match="reading them the Python way"):
        assert graphs._read_attrs(1) == {"priority": -1}
    assert graphs._native_attrs_ok is False
    monkeypatch.setattr(
        graphs, "_read_attrs_native", lambda node: pytest.fail("read natively after a disagreement")
    )
    assert graphs._read_attrs(2) == {"priority": -1}


# --- the restore flow around it, with a stand-in driver ----------------------------------------------


class _Built:
    def __init__(self, name, ahead):
        self.name, self.ahead, self.destroyed = name, ahead, False
        self.exec = 1

    def destroy(self):
        self.destroyed = True


class _Archive:
    """Graphs stored in FGB1 whose bytes name the graph; memory[name] = (top nodes, stand-in bytes)."""

    def __init__(self, memory):
        self.memory = memory
        self.meta = {
            "images": [],
            "kernels": [],
            "graphs": [
                {"name": n, "file": f"graphs/{n}.fgb", "nodes": 3, "encoding": graph_codec.ENCODING}
                for n in memory
            ],
        }
        self.reads = []

    def read_bytes(self, rel):
        self.reads.append(rel)
        return rel.removeprefix("graphs/").removesuffix(".fgb").encode()


class _StandIn:
    made: list = []

    def __init__(self, nbytes):
        self.base, self.size, self.freed = 0x7F0000000000, nbytes, False
        _StandIn.made.append(self)

    def free(self):
        self.freed = True


class _Driver:
    """What the builder does: refuses memory nodes before the mapping unless they are built against a
    stand-in large enough; re-points them (or refuses to, for the names in refuse_retarget)."""

    def __init__(self, archive):
        self.archive, self.mapped, self.refuse_retarget = archive, False, set()
        self.built, self.retargeted = [], []

    def create(self, modules, kernels):
        return self

    def memory_nodes(self, data):
        top, need = self.archive.memory[data.decode()]
        return graph_build.MemoryNodes(top, 0, 0, need)

    def rebuild(self, data, stream, split):
        name = data.decode()
        if self.archive.memory[name][0] and not self.mapped:
            raise GraphError(
                f"graph 0 node 1 (memset) of {name}: cuGraphAddMemsetNode failed: CUDA_ERROR_INVALID_VALUE"
            )
        self.built.append(name)
        split["build_s"] = split.get("build_s", 0.0) + 0.5
        return _Built(name, ahead=False)

    def rebuild_ahead(self, data, base, size, n_memory, split):
        name = data.decode()
        top, need = self.archive.memory[name]
        assert n_memory == top and base == _StandIn.made[-1].base
        if need > size:
            raise GraphError(f"graph 0 node 1 (memset): {need} bytes, the stand-in has {size}")
        self.built.append(name)
        return _Built(name, ahead=True), graph_build.Moved(data, None, top)

    def retarget(self, rebuilt, moved):
        assert self.mapped and not _StandIn.made[-1].freed
        if rebuilt.name in self.refuse_retarget:
            raise GraphError(
                "re-pointing memory nodes: node 1 (memset): cuGraphExecMemsetNodeSetParams failed"
            )
        self.retargeted.append(rebuilt.name)


@pytest.fixture
def driver(monkeypatch):
    archive = _Archive(
        {
            "decode/bs=1": (0, 0),  # kernels only
            "decode/bs=8": (2, 4096),
            "decode/bs=16": (1, 8192),
            "decode/bs=512": (1, standin.MAX_BYTES + 1),  # more than a stand-in may take
        }
    )
    d = _Driver(archive)
    _StandIn.made = []
    monkeypatch.setattr(rebuilding, "builder_choice", lambda: "auto")
    monkeypatch.setattr(rebuilding.NativeBuilder, "create", d.create)
    monkeypatch.setattr(rebuilding, "StandIn", _StandIn)
    monkeypatch.setattr(rebuilding, "retarget", d.retarget)
    return d


def test_memory_nodes_are_built_against_a_stand_in_and_re_pointed_after_the_mapping(driver):
    archive = driver.archive
    ahead = rebuilding.rebuild_archive(archive, progress=False, ahead=True)
    (made,) = _StandIn.made
    assert made.size == 8192 and ahead.timings["standin_bytes"] == 8192.0  # the largest need it may meet
    assert list(ahead.graphs) == ["decode/bs=1", "decode/bs=8", "decode/bs=16"]
    assert [ahead.graphs[n][0].ahead for n in ahead.graphs] == [False, True, True]
    assert set(ahead.moved) == {"decode/bs=8", "decode/bs=16"} and list(ahead.deferred) == ["decode/bs=512"]
    # known from the scan not to fit a stand-in: left for the mapping without being tried
    assert "decode/bs=512" not in driver.built and "stand-in at most" in str(ahead.deferred["decode/bs=512"])
    assert len(archive.reads) == 4  # each encoding read once: the scan's reads are reused

    driver.mapped = True
    timings = rebuilding.finish_rebuild(archive, ahead, progress=False)
    assert driver.retargeted == ["decode/bs=8", "decode/bs=16"] and made.freed and ahead.standin is None
    assert list(ahead.graphs) == [
        "decode/bs=1",
        "decode/bs=8",
        "decode/bs=16",
        "decode/bs=512",
    ]  # archive order
    assert timings["retargeted_graphs"] == 2.0 and timings["deferred_graphs"] == 1.0
    assert timings["graph_build_s"] == 0.5  # the deferred graph's build, on the caller's path
    assert not ahead.moved and not ahead.deferred


def test_a_graph_the_driver_will_not_re_point_is_rebuilt_from_scratch(driver):
    archive = driver.archive
    ahead = rebuilding.rebuild_archive(archive, progress=False, ahead=True)
    first = ahead.graphs["decode/bs=16"][0]
    driver.mapped, driver.refuse_retarget = True, {"decode/bs=16"}
    timings = rebuilding.finish_rebuild(archive, ahead, progress=False)
    assert first.destroyed and not ahead.graphs["decode/bs=16"][0].ahead
    assert timings["retargeted_graphs"] == 1.0 and timings["deferred_graphs"] == 2.0
    assert _StandIn.made[0].freed


def test_without_stand_in_memory_the_graphs_with_memory_nodes_wait_for_the_mapping(driver, monkeypatch):
    def no_memory(nbytes):
        raise fc.CudaError("cuMemCreate", 2)

    monkeypatch.setattr(rebuilding, "StandIn", no_memory)
    ahead = rebuilding.rebuild_archive(driver.archive, progress=False, ahead=True)
    assert list(ahead.graphs) == ["decode/bs=1"] and len(ahead.deferred) == 3 and ahead.standin is None
    assert driver.built == ["decode/bs=1"]  # the others not even tried before the mapping
    driver.mapped = True
    timings = rebuilding.finish_rebuild(driver.archive, ahead, progress=False)
    assert timings["deferred_graphs"] == 3.0 and len(ahead.graphs) == 4


def test_discarding_a_rebuild_ahead_frees_its_stand_in(driver):
    ahead = rebuilding.rebuild_archive(driver.archive, progress=False, ahead=True)
    built = [rebuilt for rebuilt, _rng, _nodes in ahead.graphs.values()]
    ahead.discard()
    assert _StandIn.made[0].freed and all(b.destroyed for b in built) and not ahead.moved


def test_not_ahead_of_the_memory_no_stand_in_is_made(driver):
    driver.mapped = True
    done = rebuilding.rebuild_archive(driver.archive, progress=False)
    assert not _StandIn.made and len(done.graphs) == 4 and not done.moved
