"""Graph serialization and restore over the CUDA driver's graph API.

A captured ``cudaGraph_t`` is walked node by node into a plain description (JSON-able): kernel
launches with their code identity, launch geometry, parameter bytes and launch attributes;
memsets; device-to-device copies; event record/wait; empty nodes; child graphs; and every edge
with its edge data (programmatic dependent launch edges included). Anything else makes SAVE fail
with the node type and, where there is one, the kernel name.

While walking, every 8-byte word of every kernel parameter is audited: a word that points into
device memory must fall inside a live segment of the Foundry region, else the graph depends on an
address a fresh process cannot reproduce and SAVE fails.

SAVE stores each description in FGB1, a compact binary encoding (:func:`encode`, :func:`decode`;
docs/archive-format.md). Restore adds the nodes to a fresh graph with the reloaded kernels, then each
edge on its own (one cuGraphAddDependencies call per edge keeps each edge's data its own), and
instantiates and uploads it. Two builders do that, call for call the same: the native one
(native/graphbuild.c, one C call per graph straight from the encoding) and the Python one (one
cuda-python call per node and edge). ``FOUNDRY_BUILDER`` picks: ``auto`` (default: native, falling
back to Python with a warning where the native one is missing or fails), ``native`` or ``python``.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import os
import struct
import time
from collections.abc import Callable

from cuda.bindings import driver as _drv

from . import _native
from .driver import CudaError, call, cu
from .errors import FoundryError
from .modules import LoadedModules, Recorded, function_attributes

# The launch 'extra' keys are pointer-valued macros in cuda.h (no enum in the bindings).
CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
CU_EVENT_DISABLE_TIMING = int(_drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
# What torch instantiates its captured graphs with (CUDAGraph::instantiate). A restored graph gets
# the same, so its kernels keep the priority they were captured with rather than taking the launch
# stream's. native/graphbuild.c uses the same value.
INSTANTIATE_FLAGS = int(_drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) | int(
    _drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
)
MEMORYTYPE_DEVICE = int(_drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)
MEMORYTYPE_UNIFIED = int(_drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED)
_POINTER_FLOOR = 1 << 32  # smaller words are sizes, strides, flags; no device allocation lives there

# Launch attributes a kernel node can carry: the archive's name, the CUlaunchAttributeID, and the
# value field holding it.
_A = _drv.CUlaunchAttributeID
NODE_ATTRIBUTES = {
    "cooperative": (int(_A.CU_LAUNCH_ATTRIBUTE_COOPERATIVE), "cooperative"),
    "cluster_dim": (int(_A.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION), "clusterDim"),
    "cluster_scheduling": (
        int(_A.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE),
        "clusterSchedulingPolicyPreference",
    ),
    "priority": (int(_A.CU_LAUNCH_ATTRIBUTE_PRIORITY), "priority"),
    "mem_sync_domain_map": (int(_A.CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP), "memSyncDomainMap"),
    "mem_sync_domain": (int(_A.CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN), "memSyncDomain"),
    "preferred_cluster_dim": (int(_A.CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION), "preferredClusterDim"),
    "preferred_carveout": (int(_A.CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT), "sharedMemCarveout"),
}


class GraphError(FoundryError, RuntimeError):
    """A graph cannot be saved or rebuilt; the message names the node and kernel."""


class Segments:
    """Live region segments, for the pointer audit."""

    def __init__(self, region_base: int, region_size: int, live: list[tuple[int, int]]):
        self.base, self.size = region_base, region_size
        self._starts = [a for a, _ in sorted(live)]
        self._ends = [a + s for a, s in sorted(live)]

    def in_region(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.size

    def live(self, addr: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr < self._ends[i]


def _short(name: str, keep: int = 96) -> str:
    """A mangled kernel name cut for a message: template arguments can run to a thousand characters
    and would push the reason out of a one-line error."""
    return name if len(name) <= keep else f"{name[:keep]}..."


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _node_type_name(ty) -> str:
    return getattr(ty, "name", str(ty)).replace("CU_GRAPH_NODE_TYPE_", "").lower()


def _param_layout(func) -> list[tuple[int, int]]:
    layout = []
    driver = cu()
    while True:
        err, offset, size = driver.cuFuncGetParamInfo(func, len(layout))
        if int(err) != 0:
            return layout
        layout.append((int(offset), int(size)))


def _kernel_param_bytes(p, layout: list[tuple[int, int]], name: str) -> bytes:
    """The kernel's argument block, laid out at the offsets the function declares."""
    total = max((o + s for o, s in layout), default=0)
    buf = bytearray(total)
    kp, extra = int(p.kernelParams or 0), int(p.extra or 0)
    if kp:
        # kernelParams: one pointer per parameter.
        for i, (offset, size) in enumerate(layout):
            arg = ctypes.c_void_p.from_address(kp + 8 * i).value
            buf[offset : offset + size] = ctypes.string_at(arg, size)
    elif extra:
        # extra: (key, value) pairs; cuBLAS launches this way with one packed buffer.
        packed, packed_size, j = None, None, 0
        while True:
            key = ctypes.c_void_p.from_address(extra + 16 * j).value or 0
            if key == CU_LAUNCH_PARAM_END:
                break
            value = ctypes.c_void_p.from_address(extra + 16 * j + 8).value
            if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
                packed = value
            elif key == CU_LAUNCH_PARAM_BUFFER_SIZE:
                packed_size = ctypes.c_size_t.from_address(value).value
            j += 1
        if packed is None or packed_size is None:
            raise GraphError(f"kernel {name}: launch 'extra' carries no parameter buffer")
        if packed_size < total:
            raise GraphError(f"kernel {name}: parameter buffer of {packed_size} bytes, layout needs {total}")
        buf[:] = ctypes.string_at(packed, total)
    elif total:
        raise GraphError(
            f"kernel {name}: node has {len(layout)} parameters but neither kernelParams nor extra"
        )
    return bytes(buf)


class _Auditor:
    """Checks that every device pointer a node carries lies in a live region segment."""

    def __init__(self, segments: Segments):
        self.segments = segments
        self.pointers: set[int] = set()  # region pointers seen, for the RNG-state search
        # Words inside the region's address range that no live allocation covers. A kernel that
        # dereferenced one would fault or read freed memory in the engine's own replay too, so these
        # are data that happens to look like an address (struct padding left uninitialised, packed
        # integers): seen on FlashAttention-3's parameter struct, differently in every process.
        # The bytes are restored as they were, so LOAD behaves exactly as the captured graph did.
        self.dead_words = 0

    def check_word(self, value: int, where: Callable[[], str]) -> None:
        if value < _POINTER_FLOOR:
            return
        if self.segments.in_region(value):
            if self.segments.live(value):
                self.pointers.add(value)
            else:
                self.dead_words += 1
            return
        err, _ = cu().cuPointerGetAttribute(cu().CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, value)
        if int(err) == 0:
            raise GraphError(
                f"{where()} points to memory at {value:#x} outside the Foundry region; allocate everything the "
                "graph uses inside Region.routing() (or capture with pool=region.graph_pool_id())"
            )

    def check_block(self, data: bytes, where: Callable[[int], str]) -> None:
        for off in range(0, len(data) - 7, 8):
            value = int.from_bytes(data[off : off + 8], "little")
            if value >= _POINTER_FLOOR:
                self.check_word(value, lambda off=off: where(off))


def _read_attrs(node) -> dict:
    attrs = {}
    driver = cu()
    for key, (attr_id, field) in NODE_ATTRIBUTES.items():
        err, value = driver.cuGraphKernelNodeGetAttribute(node, driver.CUkernelNodeAttrID(attr_id))
        if int(err) != 0:
            continue
        v = getattr(value, field)
        if key in ("cluster_dim", "preferred_cluster_dim"):
            dims = [int(v.x), int(v.y), int(v.z)]
            if any(dims):
                attrs[key] = dims
        elif key == "mem_sync_domain_map":
            pair = [int(v.default_), int(v.remote)]
            if any(pair):
                attrs[key] = pair
        else:
            iv = int(v)
            if iv:
                attrs[key] = iv
    return attrs


def _write_attrs(node, attrs: dict) -> None:
    driver = cu()
    for key, raw in attrs.items():
        attr_id, field = NODE_ATTRIBUTES[key]
        value = driver.CUkernelNodeAttrValue()
        if key in ("cluster_dim", "preferred_cluster_dim"):
            dims = getattr(value, field)
            dims.x, dims.y, dims.z = raw
            setattr(value, field, dims)
        elif key == "mem_sync_domain_map":
            m = getattr(value, field)
            m.default_, m.remote = raw
            setattr(value, field, m)
        else:
            current = getattr(value, field)
            setattr(value, field, type(current)(raw) if not isinstance(current, int) else raw)
        call(driver.cuGraphKernelNodeSetAttribute, node, driver.CUkernelNodeAttrID(attr_id), value)


def serialize(graph, recorded: Recorded, segments: Segments, kernels: dict) -> tuple[dict, set[int]]:
    """Describe ``graph`` (a CUgraph). ``kernels`` collects (image, name) -> function attributes.

    Returns the description and the region addresses its kernels point at.
    """
    auditor = _Auditor(segments)
    events: dict[int, int] = {}
    desc = _serialize(graph, recorded, auditor, kernels, events, path="")
    desc["events"] = len(events)
    if auditor.dead_words:
        desc["unmapped_region_words"] = auditor.dead_words
    return desc, auditor.pointers


def _serialize(graph, recorded, auditor, kernels, events, path: str) -> dict:
    driver = cu()
    T = driver.CUgraphNodeType
    n = call(driver.cuGraphGetNodes, graph, 0)[1]
    nodes = call(driver.cuGraphGetNodes, graph, n)[0] if n else []
    index = {int(node): i for i, node in enumerate(nodes)}
    out_nodes = []
    for i, node in enumerate(nodes):
        ty = call(driver.cuGraphNodeGetType, node)
        label = f"graph node {path}{i}"
        if ty == T.CU_GRAPH_NODE_TYPE_KERNEL:
            p = call(driver.cuGraphKernelNodeGetParams, node)
            func = p.func
            if not int(func):
                func = call(driver.cuKernelGetFunction, p.kern)
            name = call(driver.cuFuncGetName, func).decode()
            layout = _param_layout(func)
            params = _kernel_param_bytes(p, layout, name)
            auditor.check_block(
                params,
                lambda off, name=name, label=label: f"{label} (kernel {_short(name)}) parameter byte {off}",
            )
            image = recorded.match(func, name)
            kernels.setdefault((image, name), function_attributes(func))
            out_nodes.append(
                {
                    "type": "kernel",
                    "image": image,
                    "name": name,
                    "grid": [int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)],
                    "block": [int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)],
                    "smem": int(p.sharedMemBytes),
                    "layout": layout,
                    "params": _b64(params),
                    "attrs": _read_attrs(node),
                }
            )
        elif ty == T.CU_GRAPH_NODE_TYPE_MEMSET:
            p = call(driver.cuGraphMemsetNodeGetParams, node)
            dst = int(p.dst)
            auditor.check_word(dst, lambda label=label: f"{label} (memset) destination")
            out_nodes.append(
                {
                    "type": "memset",
                    "dst": dst,
                    "pitch": int(p.pitch),
                    "value": int(p.value),
                    "element_size": int(p.elementSize),
                    "width": int(p.width),
                    "height": int(p.height),
                }
            )
        elif ty == T.CU_GRAPH_NODE_TYPE_MEMCPY:
            p = call(driver.cuGraphMemcpyNodeGetParams, node)
            kinds = (int(p.srcMemoryType), int(p.dstMemoryType))
            if any(k not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED) for k in kinds):
                raise GraphError(
                    f"{label}: memcpy between memory types {kinds}; only device-to-device copies can be saved"
                )
            src, dst = int(p.srcDevice), int(p.dstDevice)
            for which, addr in (("source", src), ("destination", dst)):
                if not auditor.segments.in_region(addr) or not auditor.segments.live(addr):
                    raise GraphError(
                        f"{label}: memcpy {which} {addr:#x} is not in a live Foundry region allocation"
                    )
                auditor.pointers.add(addr)
            out_nodes.append(
                {
                    "type": "memcpy",
                    "src": src,
                    "dst": dst,
                    "src_xy": [int(p.srcXInBytes), int(p.srcY), int(p.srcZ)],
                    "dst_xy": [int(p.dstXInBytes), int(p.dstY), int(p.dstZ)],
                    "src_pitch": [int(p.srcPitch), int(p.srcHeight)],
                    "dst_pitch": [int(p.dstPitch), int(p.dstHeight)],
                    "extent": [int(p.WidthInBytes), int(p.Height), int(p.Depth)],
                    "kinds": list(kinds),
                }
            )
        elif ty in (T.CU_GRAPH_NODE_TYPE_EVENT_RECORD, T.CU_GRAPH_NODE_TYPE_WAIT_EVENT):
            getter = (
                driver.cuGraphEventRecordNodeGetEvent
                if ty == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD
                else driver.cuGraphEventWaitNodeGetEvent
            )
            event = int(call(getter, node))
            slot = events.setdefault(event, len(events))
            kind = "event_record" if ty == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD else "event_wait"
            out_nodes.append({"type": kind, "event": slot})
        elif ty == T.CU_GRAPH_NODE_TYPE_EMPTY:
            out_nodes.append({"type": "empty"})
        elif ty == T.CU_GRAPH_NODE_TYPE_GRAPH:
            child = call(driver.cuGraphChildGraphNodeGetGraph, node)
            out_nodes.append(
                {
                    "type": "graph",
                    "graph": _serialize(child, recorded, auditor, kernels, events, path=f"{path}{i}."),
                }
            )
        else:
            raise GraphError(
                f"{label}: node type {_node_type_name(ty)} cannot be saved (host callbacks, host copies, "
                "graph memory alloc/free and conditional nodes have no portable restore)"
            )
    n_edges = call(driver.cuGraphGetEdges, graph, 0)[-1]
    edges = []
    if n_edges:
        frm, to, data, got = call(driver.cuGraphGetEdges, graph, n_edges)
        for a, b, d in zip(frm[:got], to[:got], data[:got]):
            edges.append([index[int(a)], index[int(b)], int(d.from_port), int(d.to_port), int(d.type)])
    return {"nodes": out_nodes, "edges": edges}


class Rebuilt:
    """A restored graph: the CUgraph, its executable, and what must stay alive with them."""

    def __init__(self, graph, exec_, events: list, keepalive: list):
        self.graph, self.exec, self.events, self._keepalive = graph, exec_, events, keepalive
        # Replay is on the serving loop's host path: look the driver function up once, and make a
        # stream handle object only when the stream changes (engines replay on one stream).
        self._launch = cu().cuGraphLaunch
        self._stream: tuple[int, object] | None = None

    def launch(self, stream: int) -> None:
        if self._stream is None or self._stream[0] != stream:
            self._stream = (stream, cu().CUstream(init_value=stream))
        (err,) = self._launch(self.exec, self._stream[1])
        if int(err):
            raise CudaError("cuGraphLaunch", err)

    def destroy(self) -> None:
        if self.exec is not None:
            call(cu().cuGraphExecDestroy, self.exec)
            call(cu().cuGraphDestroy, self.graph)
            for event in self.events:
                call(cu().cuEventDestroy, event)
            self.exec = None


def rebuild(
    desc: dict, modules: LoadedModules, kernel_attrs: dict, stream: int | None, timings: dict | None = None
) -> Rebuilt:
    """The Python builder: one driver call per node and per edge. Uploads the executable to
    ``stream`` unless it is None. ``timings`` accumulates seconds."""
    t0 = time.perf_counter()
    events = [call(cu().cuEventCreate, CU_EVENT_DISABLE_TIMING) for _ in range(desc.get("events", 0))]
    keepalive: list = []
    try:
        graph = _build(desc, modules, kernel_attrs, events, keepalive)
    except BaseException:
        for event in events:
            call(cu().cuEventDestroy, event)
        raise
    t1 = time.perf_counter()
    exec_ = call(cu().cuGraphInstantiate, graph, INSTANTIATE_FLAGS)
    t2 = time.perf_counter()
    if stream is not None:
        call(cu().cuGraphUpload, exec_, cu().CUstream(init_value=stream))
    t3 = time.perf_counter()
    if timings is not None:
        _add_times(timings, t1 - t0, t2 - t1, t3 - t2)
    return Rebuilt(graph, exec_, events, keepalive)


def _add_times(timings: dict, build: float, instantiate: float, upload: float) -> None:
    for key, value in (("build_s", build), ("instantiate_s", instantiate), ("upload_s", upload)):
        timings[key] = timings.get(key, 0.0) + value


def _build(desc: dict, modules: LoadedModules, kernel_attrs: dict, events: list, keepalive: list):
    driver = cu()
    graph = call(driver.cuGraphCreate, 0)
    handles = []
    ctx = call(driver.cuCtxGetCurrent)
    for node in desc["nodes"]:
        kind = node["type"]
        if kind == "kernel":
            func = modules.function(
                node["image"], node["name"], kernel_attrs.get((node["image"], node["name"]), {})
            )
            params = _unb64(node["params"])
            block = ctypes.create_string_buffer(params, max(len(params), 1))
            argv = (ctypes.c_void_p * max(len(node["layout"]), 1))()
            base = ctypes.addressof(block)
            for i, (offset, _size) in enumerate(node["layout"]):
                argv[i] = base + offset
            p = driver.CUDA_KERNEL_NODE_PARAMS()
            p.func = func
            p.gridDimX, p.gridDimY, p.gridDimZ = node["grid"]
            p.blockDimX, p.blockDimY, p.blockDimZ = node["block"]
            p.sharedMemBytes = node["smem"]
            p.kernelParams = ctypes.addressof(argv) if node["layout"] else 0
            p.extra = 0
            handle = call(driver.cuGraphAddKernelNode, graph, None, 0, p)
            keepalive.append((block, argv))
            if node["attrs"]:
                _write_attrs(handle, node["attrs"])
        elif kind == "memset":
            p = driver.CUDA_MEMSET_NODE_PARAMS()
            p.dst = node["dst"]
            p.pitch = node["pitch"]
            p.value = node["value"]
            p.elementSize = node["element_size"]
            p.width = node["width"]
            p.height = node["height"]
            handle = call(driver.cuGraphAddMemsetNode, graph, None, 0, p, ctx)
        elif kind == "memcpy":
            p = driver.CUDA_MEMCPY3D()
            p.srcMemoryType = driver.CUmemorytype(node["kinds"][0])
            p.dstMemoryType = driver.CUmemorytype(node["kinds"][1])
            p.srcDevice, p.dstDevice = node["src"], node["dst"]
            p.srcXInBytes, p.srcY, p.srcZ = node["src_xy"]
            p.dstXInBytes, p.dstY, p.dstZ = node["dst_xy"]
            p.srcPitch, p.srcHeight = node["src_pitch"]
            p.dstPitch, p.dstHeight = node["dst_pitch"]
            p.WidthInBytes, p.Height, p.Depth = node["extent"]
            handle = call(driver.cuGraphAddMemcpyNode, graph, None, 0, p, ctx)
        elif kind == "event_record":
            handle = call(driver.cuGraphAddEventRecordNode, graph, None, 0, events[node["event"]])
        elif kind == "event_wait":
            handle = call(driver.cuGraphAddEventWaitNode, graph, None, 0, events[node["event"]])
        elif kind == "empty":
            handle = call(driver.cuGraphAddEmptyNode, graph, None, 0)
        elif kind == "graph":
            child = _build(node["graph"], modules, kernel_attrs, events, keepalive)
            handle = call(driver.cuGraphAddChildGraphNode, graph, None, 0, child)
            call(driver.cuGraphDestroy, child)  # the node holds its own clone
        else:
            raise GraphError(f"archive holds a node of unknown type {kind!r}")
        handles.append(handle)
    for a, b, from_port, to_port, dep_type in desc["edges"]:
        data = driver.CUgraphEdgeData()
        data.from_port, data.to_port, data.type = from_port, to_port, dep_type
        call(driver.cuGraphAddDependencies, graph, [handles[a]], [handles[b]], [data], 1)
    return graph


def count_nodes(desc: dict) -> int:
    return sum(1 + (count_nodes(n["graph"]) if n["type"] == "graph" else 0) for n in desc["nodes"])


def kernel_names(desc: dict) -> list[str]:
    names = []
    for n in desc["nodes"]:
        if n["type"] == "kernel":
            names.append(n["name"])
        elif n["type"] == "graph":
            names += kernel_names(n["graph"])
    return names


# ---- FGB1: the binary graph encoding (native/graphbuild.h, docs/archive-format.md) ----------------

FGB_MAGIC = b"FGB1"
FGB_VERSION = 1
ENCODING = "fgb1"  # the value of a graph entry's "encoding" in archive meta
_NODE_CODES = {
    "kernel": 1,
    "memset": 2,
    "memcpy": 3,
    "event_record": 4,
    "event_wait": 5,
    "empty": 6,
    "graph": 7,
}
_NODE_NAMES = {code: name for name, code in _NODE_CODES.items()}
_ATTR_IDS = {key: attr_id for key, (attr_id, _field) in NODE_ATTRIBUTES.items()}
_ATTR_KEYS = {attr_id: key for key, attr_id in _ATTR_IDS.items()}
_SIGNED_ATTRS = {"cooperative", "cluster_scheduling", "priority", "mem_sync_domain"}  # C int members
_HEADER = struct.Struct("<4s5I")
_KERNEL_ENTRY = struct.Struct("<4I")
_LAYOUT_ENTRY = struct.Struct("<2I")
_SECTION = struct.Struct("<2I")
_NODE_HEADER = struct.Struct("<BBH")
_KERNEL_FIXED = struct.Struct("<8I")
_ATTR = struct.Struct("<4I")
_MEMSET = struct.Struct("<QQIIQQ")
_MEMCPY = struct.Struct("<II15Q")
_U32 = struct.Struct("<I")
_EDGE = struct.Struct("<IIBBBB")
_MAX_PARAM_BYTES = 65536


class EncodingError(GraphError):
    """A graph description cannot be encoded, or an encoding is malformed."""


def kernel_ids(kernels: list) -> dict[tuple[str, str], int]:
    """(image, name) -> function index, from archive meta's ``kernels`` list ([image, name, attrs] rows)."""
    return {(row[0], row[1]): i for i, row in enumerate(kernels)}


def _u32(value: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value < 1 << 32:
        raise EncodingError(f"{what} = {value!r} does not fit 32 bits")
    return value


def _u64(value: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise EncodingError(f"{what} = {value!r} does not fit 64 bits")
    return value


def _attr_words(key: str, raw, where: str) -> tuple[int, int, int]:
    if key in ("cluster_dim", "preferred_cluster_dim", "mem_sync_domain_map"):
        values = list(raw) + [0] * (3 - len(raw))
        limit = 1 << 8 if key == "mem_sync_domain_map" else 1 << 32
        if len(raw) != (2 if key == "mem_sync_domain_map" else 3) or any(
            not isinstance(v, int) or not 0 <= v < limit for v in values
        ):
            raise EncodingError(f"{where}: attribute {key} = {raw!r} is malformed")
        return values[0], values[1], values[2]
    if not isinstance(raw, int) or not -(1 << 31) <= raw < 1 << 32:
        raise EncodingError(f"{where}: attribute {key} = {raw!r} does not fit 32 bits")
    return raw & 0xFFFFFFFF, 0, 0


def encode(desc: dict, ids: dict[tuple[str, str], int]) -> bytes:
    """The FGB1 encoding of a graph description (``serialize``'s output; ``rng`` is not part of it).

    ``ids`` maps (image, name) to the function index the encoding refers to (:func:`kernel_ids`).
    """
    entries: dict[tuple, int] = {}
    kernel_rows: list[bytes] = []
    layout_rows: list[bytes] = []
    n_layout = 0
    n_events = desc.get("events", 0)
    order = [desc]  # graph index -> description; children get the next index when first met
    sections: list[bytes] = []
    g = 0
    while g < len(order):
        graph = order[g]
        out = bytearray()
        nodes, edges = graph["nodes"], graph["edges"]
        out += _SECTION.pack(len(nodes), len(edges))
        for i, node in enumerate(nodes):
            where = f"graph {g} node {i}"
            kind = node.get("type")
            code = _NODE_CODES.get(kind)
            if code is None:
                raise EncodingError(f"{where}: unknown node type {kind!r}")
            if kind == "kernel":
                ref = ids.get((node["image"], node["name"]))
                if ref is None:
                    raise EncodingError(f"{where}: kernel {node['name']} is not in the archive's kernel list")
                layout = tuple((_u32(o, "offset"), _u32(n, "size")) for o, n in node["layout"])
                total = max((o + n for o, n in layout), default=0)
                if total > _MAX_PARAM_BYTES:
                    raise EncodingError(f"{where}: {total} parameter bytes")
                key = (ref, layout)
                entry = entries.get(key)
                if entry is None:
                    entry = entries[key] = len(kernel_rows)
                    kernel_rows.append(_KERNEL_ENTRY.pack(ref, n_layout, len(layout), total))
                    layout_rows += [_LAYOUT_ENTRY.pack(o, n) for o, n in layout]
                    n_layout += len(layout)
                params = _unb64(node["params"])
                if len(params) != total:
                    raise EncodingError(f"{where}: {len(params)} parameter bytes, the layout needs {total}")
                attrs = sorted(node.get("attrs", {}).items(), key=lambda kv: _ATTR_IDS.get(kv[0], -1))
                if len(attrs) > 16:
                    raise EncodingError(f"{where}: {len(attrs)} launch attributes")
                out += _NODE_HEADER.pack(code, len(attrs), 0)
                grid = [_u32(v, f"{where} grid") for v in node["grid"]]
                block = [_u32(v, f"{where} block") for v in node["block"]]
                if len(grid) != 3 or len(block) != 3:
                    raise EncodingError(f"{where}: grid and block need 3 dimensions")
                out += _KERNEL_FIXED.pack(entry, *grid, *block, _u32(node["smem"], f"{where} smem"))
                for akey, raw in attrs:
                    if akey not in _ATTR_IDS:
                        raise EncodingError(f"{where}: unknown launch attribute {akey!r}")
                    out += _ATTR.pack(_ATTR_IDS[akey], *_attr_words(akey, raw, where))
                out += params
                continue
            out += _NODE_HEADER.pack(code, 0, 0)
            if kind == "memset":
                out += _MEMSET.pack(
                    _u64(node["dst"], "dst"),
                    _u64(node["pitch"], "pitch"),
                    _u32(node["value"], "value"),
                    _u32(node["element_size"], "element_size"),
                    _u64(node["width"], "width"),
                    _u64(node["height"], "height"),
                )
            elif kind == "memcpy":
                kinds = node["kinds"]
                if len(kinds) != 2 or any(k not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED) for k in kinds):
                    raise EncodingError(f"{where}: memcpy memory types {kinds!r}")
                words = [
                    node["src"],
                    node["dst"],
                    *node["src_xy"],
                    *node["dst_xy"],
                    *node["src_pitch"],
                    *node["dst_pitch"],
                    *node["extent"],
                ]
                if len(words) != 15:
                    raise EncodingError(f"{where}: memcpy description is malformed")
                out += _MEMCPY.pack(*kinds, *(_u64(w, f"{where} memcpy field") for w in words))
            elif kind in ("event_record", "event_wait"):
                slot = _u32(node["event"], f"{where} event")
                if slot >= n_events:
                    raise EncodingError(f"{where}: event slot {slot} of {n_events}")
                out += _U32.pack(slot)
            elif kind == "graph":
                out += _U32.pack(len(order))
                order.append(node["graph"])
        for e, edge in enumerate(edges):
            a, b, from_port, to_port, dep_type = edge
            if not (0 <= a < len(nodes) and 0 <= b < len(nodes)):
                raise EncodingError(f"graph {g} edge {e}: {a} -> {b}, the graph has {len(nodes)} nodes")
            for v in (from_port, to_port, dep_type):
                if not 0 <= v < 256:
                    raise EncodingError(f"graph {g} edge {e}: edge data {edge[2:]!r} does not fit a byte")
            out += _EDGE.pack(a, b, from_port, to_port, dep_type, 0)
        sections.append(bytes(out))
        g += 1
    header = _HEADER.pack(FGB_MAGIC, FGB_VERSION, len(order), n_events, len(kernel_rows), n_layout)
    return b"".join([header, *kernel_rows, *layout_rows, *sections])


def decode(data: bytes, kernels: list) -> dict:
    """The graph description an FGB1 encoding holds (``kernels``: archive meta's list)."""
    try:
        return _decode(memoryview(data), kernels)
    except struct.error as e:
        raise EncodingError(f"graph encoding is truncated or malformed ({e})") from None


def _decode(data: memoryview, kernels: list) -> dict:
    magic, version, n_graphs, n_events, n_kernels, n_layout = _HEADER.unpack_from(data, 0)
    if magic != FGB_MAGIC:
        raise EncodingError("not a Foundry graph encoding (no FGB1 magic)")
    if version != FGB_VERSION:
        raise EncodingError(f"graph encoding version {version} is not supported (this Foundry reads 1)")
    if not 1 <= n_graphs <= 4096:
        raise EncodingError(f"graph encoding declares {n_graphs} graphs")
    pos = _HEADER.size
    if n_kernels * 16 + n_layout * 8 > len(data) - pos:
        raise EncodingError("graph encoding truncated in its kernel table")
    entries = [_KERNEL_ENTRY.unpack_from(data, pos + 16 * k) for k in range(n_kernels)]
    pos += 16 * n_kernels
    layout_pool = [_LAYOUT_ENTRY.unpack_from(data, pos + 8 * j) for j in range(n_layout)]
    pos += 8 * n_layout
    tables = []
    for k, (ref, first, n, total) in enumerate(entries):
        if ref >= len(kernels) or first + n > n_layout:
            raise EncodingError(f"kernel entry {k} refers outside the kernel list or layout")
        layout = [list(pair) for pair in layout_pool[first : first + n]]
        if max((o + s for o, s in layout), default=0) != total:
            raise EncodingError(f"kernel entry {k}: parameter layout and size disagree")
        tables.append((kernels[ref][0], kernels[ref][1], layout, total))
    graphs: list[dict] = [{} for _ in range(n_graphs)]
    referenced = [False] * n_graphs
    for g in range(n_graphs):
        if g and not referenced[g]:
            raise EncodingError(f"graph {g} is not referenced by any child-graph node before it")
        n_nodes, n_edges = _SECTION.unpack_from(data, pos)
        pos += _SECTION.size
        nodes = []
        for i in range(n_nodes):
            code, n_attrs, reserved = _NODE_HEADER.unpack_from(data, pos)
            pos += _NODE_HEADER.size
            kind = _NODE_NAMES.get(code)
            where = f"graph {g} node {i}"
            if kind is None or reserved or (n_attrs and kind != "kernel"):
                raise EncodingError(f"{where}: malformed node header")
            if kind == "kernel":
                entry, gx, gy, gz, bx, by, bz, smem = _KERNEL_FIXED.unpack_from(data, pos)
                pos += _KERNEL_FIXED.size
                if entry >= n_kernels:
                    raise EncodingError(f"{where}: kernel entry {entry} of {n_kernels}")
                attrs = {}
                for _ in range(n_attrs):
                    attr_id, v0, v1, v2 = _ATTR.unpack_from(data, pos)
                    pos += _ATTR.size
                    key = _ATTR_KEYS.get(attr_id)
                    if key is None:
                        raise EncodingError(f"{where}: unknown launch attribute id {attr_id}")
                    if key in ("cluster_dim", "preferred_cluster_dim"):
                        attrs[key] = [v0, v1, v2]
                    elif key == "mem_sync_domain_map":
                        attrs[key] = [v0, v1]
                    else:
                        attrs[key] = v0 - (1 << 32) if key in _SIGNED_ATTRS and v0 >= 1 << 31 else v0
                image, name, layout, total = tables[entry]
                if pos + total > len(data):
                    raise EncodingError(f"{where}: truncated parameters")
                params = bytes(data[pos : pos + total])
                pos += total
                nodes.append(
                    {
                        "type": "kernel",
                        "image": image,
                        "name": name,
                        "grid": [gx, gy, gz],
                        "block": [bx, by, bz],
                        "smem": smem,
                        "layout": [list(p) for p in layout],
                        "params": _b64(params),
                        "attrs": attrs,
                    }
                )
            elif kind == "memset":
                dst, pitch, value, element_size, width, height = _MEMSET.unpack_from(data, pos)
                pos += _MEMSET.size
                nodes.append(
                    {
                        "type": "memset",
                        "dst": dst,
                        "pitch": pitch,
                        "value": value,
                        "element_size": element_size,
                        "width": width,
                        "height": height,
                    }
                )
            elif kind == "memcpy":
                k0, k1, *w = _MEMCPY.unpack_from(data, pos)
                pos += _MEMCPY.size
                if any(k not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED) for k in (k0, k1)):
                    raise EncodingError(f"{where}: memcpy memory types {(k0, k1)}")
                nodes.append(
                    {
                        "type": "memcpy",
                        "src": w[0],
                        "dst": w[1],
                        "src_xy": w[2:5],
                        "dst_xy": w[5:8],
                        "src_pitch": w[8:10],
                        "dst_pitch": w[10:12],
                        "extent": w[12:15],
                        "kinds": [k0, k1],
                    }
                )
            elif kind in ("event_record", "event_wait"):
                (slot,) = _U32.unpack_from(data, pos)
                pos += 4
                if slot >= n_events:
                    raise EncodingError(f"{where}: event slot {slot} of {n_events}")
                nodes.append({"type": kind, "event": slot})
            elif kind == "empty":
                nodes.append({"type": "empty"})
            else:
                (child,) = _U32.unpack_from(data, pos)
                pos += 4
                if not g < child < n_graphs or referenced[child]:
                    raise EncodingError(f"{where}: bad child graph reference {child}")
                referenced[child] = True
                nodes.append({"type": "graph", "graph": graphs[child]})
        edges = []
        for e in range(n_edges):
            a, b, from_port, to_port, dep_type, pad = _EDGE.unpack_from(data, pos)
            pos += _EDGE.size
            if a >= n_nodes or b >= n_nodes or pad:
                raise EncodingError(f"graph {g} edge {e}: {a} -> {b} is malformed")
            edges.append([a, b, from_port, to_port, dep_type])
        graphs[g]["nodes"] = nodes
        graphs[g]["edges"] = edges
    if pos != len(data):
        raise EncodingError(f"graph encoding has {len(data) - pos} bytes after its last graph")
    top = graphs[0]
    top["events"] = n_events
    return top


def encoded_events(data: bytes) -> int:
    return _HEADER.unpack_from(data, 0)[3]


def validate_encoding(data: bytes, n_funcs: int, n_events: int | None = None) -> dict:
    """Check an encoding with the native validator; returns its counts. Raises :class:`EncodingError`."""
    so = _native.graph_lib()
    if so is None:
        raise EncodingError("the native library has no graph builder (rebuild it)")
    counts = (ctypes.c_uint64 * 5)()
    err = ctypes.create_string_buffer(512)
    buf = ctypes.c_char_p(data)
    rc = so.foundry_graph_validate(
        ctypes.cast(buf, ctypes.c_void_p),
        len(data),
        n_funcs,
        (1 << 32) if n_events is None else n_events,
        counts,
        err,
        len(err),
    )
    if rc != 0:
        raise EncodingError(err.value.decode(errors="replace"))
    return dict(zip(("graphs", "nodes", "edges", "kernels", "events"), (int(c) for c in counts)))


# ---- choosing and running a builder -----------------------------------------------------------------

BUILDERS = ("auto", "native", "python")
_BUILD_INSTANTIATE, _BUILD_UPLOAD = 1, 2


def builder_choice() -> str:
    choice = os.environ.get("FOUNDRY_BUILDER", "auto").strip().lower() or "auto"
    if choice not in BUILDERS:
        raise GraphError(f"FOUNDRY_BUILDER={choice!r}: choose one of {', '.join(BUILDERS)}")
    return choice


class NativeBuilder:
    """Builds graphs from FGB1 encodings in one native call each (native/graphbuild.c)."""

    def __init__(self, so, funcs: list):
        self._so = so
        self.n_funcs = len(funcs)
        self._funcs = (ctypes.c_void_p * max(len(funcs), 1))(*[int(f) for f in funcs])

    @classmethod
    def create(cls, modules: LoadedModules, kernels: list) -> NativeBuilder | None:
        """None where the native library lacks the builder."""
        so = _native.graph_lib()
        if so is None:
            return None
        funcs = [modules.function(image, name, attrs) for image, name, attrs in kernels]
        return cls(so, funcs)

    def rebuild(self, data: bytes, stream: int | None, timings: dict | None = None) -> Rebuilt:
        """Build and instantiate the graph ``data`` encodes; upload it to ``stream`` unless None."""
        n_events = encoded_events(data) if len(data) >= _HEADER.size else 0
        events = [call(cu().cuEventCreate, CU_EVENT_DISABLE_TIMING) for _ in range(n_events)]
        handles = (ctypes.c_void_p * max(n_events, 1))(*[int(e) for e in events])
        graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
        times = (ctypes.c_double * 3)()
        err = ctypes.create_string_buffer(1024)
        buf = ctypes.c_char_p(data)
        rc = self._so.foundry_graph_build(
            ctypes.cast(buf, ctypes.c_void_p),
            len(data),
            self._funcs,
            self.n_funcs,
            handles,
            n_events,
            stream or 0,
            _BUILD_INSTANTIATE | (_BUILD_UPLOAD if stream is not None else 0),
            ctypes.byref(graph),
            ctypes.byref(exec_),
            times,
            err,
            len(err),
        )
        if rc != 0:
            for event in events:
                call(cu().cuEventDestroy, event)
            raise GraphError(f"native graph builder: {err.value.decode(errors='replace')}")
        if timings is not None:
            _add_times(timings, times[0], times[1], times[2])
        driver = cu()
        return Rebuilt(
            driver.CUgraph(init_value=graph.value), driver.CUgraphExec(init_value=exec_.value), events, []
        )


def read_description(archive, entry: dict) -> dict:
    """The description of graph ``entry`` (a row of archive meta's ``graphs``), in either stored form."""
    encoding = entry.get("encoding")
    if encoding is None:
        return archive.read_json(entry["file"])
    if encoding != ENCODING:
        raise EncodingError(f"graph {entry.get('name')!r} is stored in encoding {encoding!r}, unknown here")
    desc = decode(archive.read_bytes(entry["file"]), archive.meta.get("kernels", []))
    desc["rng"] = entry.get("rng_state")
    return desc


def structure(graph) -> dict:
    """What a built CUgraph holds, read back from the driver: nodes in order (type, kernel, geometry,
    parameter bytes, launch attributes, memset/memcpy fields, child graphs) and its edges with their
    data, sorted. Two builders that made the same graph give equal structures (the GPU tests compare
    the native and the Python builder's this way)."""
    driver = cu()
    T = driver.CUgraphNodeType
    n = call(driver.cuGraphGetNodes, graph, 0)[1]
    nodes = call(driver.cuGraphGetNodes, graph, n)[0] if n else []
    index = {int(node): i for i, node in enumerate(nodes)}
    out = []
    for node in nodes:
        ty = call(driver.cuGraphNodeGetType, node)
        item: dict = {"type": _node_type_name(ty)}
        if ty == T.CU_GRAPH_NODE_TYPE_KERNEL:
            p = call(driver.cuGraphKernelNodeGetParams, node)
            func = p.func if int(p.func) else call(driver.cuKernelGetFunction, p.kern)
            name = call(driver.cuFuncGetName, func).decode()
            layout = _param_layout(func)
            item.update(
                name=name,
                grid=[int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)],
                block=[int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)],
                smem=int(p.sharedMemBytes),
                params=_b64(_kernel_param_bytes(p, layout, name)),
                attrs=_read_attrs(node),
            )
        elif ty == T.CU_GRAPH_NODE_TYPE_MEMSET:
            p = call(driver.cuGraphMemsetNodeGetParams, node)
            item.update(
                dst=int(p.dst),
                pitch=int(p.pitch),
                value=int(p.value),
                element_size=int(p.elementSize),
                width=int(p.width),
                height=int(p.height),
            )
        elif ty == T.CU_GRAPH_NODE_TYPE_MEMCPY:
            p = call(driver.cuGraphMemcpyNodeGetParams, node)
            item.update(
                src=int(p.srcDevice),
                dst=int(p.dstDevice),
                extent=[int(p.WidthInBytes), int(p.Height), int(p.Depth)],
            )
        elif ty == T.CU_GRAPH_NODE_TYPE_GRAPH:
            item["graph"] = structure(call(driver.cuGraphChildGraphNodeGetGraph, node))
        out.append(item)
    n_edges = call(driver.cuGraphGetEdges, graph, 0)[-1]
    edges = []
    if n_edges:
        frm, to, data, got = call(driver.cuGraphGetEdges, graph, n_edges)
        for a, b, d in zip(frm[:got], to[:got], data[:got]):
            edges.append([index[int(a)], index[int(b)], int(d.from_port), int(d.to_port), int(d.type)])
    return {"nodes": out, "edges": sorted(edges)}
