"""Graph serialization and restore over the CUDA driver's graph API.

A captured ``cudaGraph_t`` is walked node by node into a plain description (JSON-able): kernel
launches with their code identity, launch geometry, parameter bytes and launch attributes;
memsets; device-to-device copies; event record/wait; empty nodes; child graphs; and every edge
with its edge data (programmatic dependent launch edges included). Anything else makes SAVE fail
with the node type and, where there is one, the kernel name.

While walking, every 8-byte word of every kernel parameter is audited: a word that points into
device memory must fall inside a live segment of the Foundry region, else the graph depends on an
address a fresh process cannot reproduce and SAVE fails.

Restore adds the nodes to a fresh graph with the reloaded kernels, then each edge on its own (one
cuGraphAddDependencies call per edge keeps each edge's data its own), and instantiates it.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
from collections.abc import Callable

from .driver import call, cu
from .modules import LoadedModules, Recorded, function_attributes

CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
CU_EVENT_DISABLE_TIMING = 2
MEMORYTYPE_DEVICE = 2
MEMORYTYPE_UNIFIED = 4
_POINTER_FLOOR = 1 << 32  # smaller words are sizes, strides, flags; no device allocation lives there

# Launch attributes a kernel node can carry, by CUlaunchAttributeID, with the value field holding them.
NODE_ATTRIBUTES = {
    "cooperative": (2, "cooperative"),
    "cluster_dim": (4, "clusterDim"),
    "cluster_scheduling": (5, "clusterSchedulingPolicyPreference"),
    "priority": (8, "priority"),
    "mem_sync_domain_map": (9, "memSyncDomainMap"),
    "mem_sync_domain": (10, "memSyncDomain"),
    "preferred_cluster_dim": (11, "preferredClusterDim"),
    "preferred_carveout": (14, "sharedMemCarveout"),
}


class GraphError(RuntimeError):
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

    def check_word(self, value: int, where: Callable[[], str]) -> None:
        if value < _POINTER_FLOOR:
            return
        if self.segments.in_region(value):
            if not self.segments.live(value):
                raise GraphError(
                    f"{where()} points into the Foundry region at {value:#x}, outside any live allocation"
                )
            self.pointers.add(value)
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
        call("cuGraphKernelNodeSetAttribute", node, driver.CUkernelNodeAttrID(attr_id), value)


def serialize(graph, recorded: Recorded, segments: Segments, kernels: dict) -> tuple[dict, set[int]]:
    """Describe ``graph`` (a CUgraph). ``kernels`` collects (image, name) -> function attributes.

    Returns the description and the region addresses its kernels point at.
    """
    auditor = _Auditor(segments)
    events: dict[int, int] = {}
    desc = _serialize(graph, recorded, auditor, kernels, events, path="")
    desc["events"] = len(events)
    return desc, auditor.pointers


def _serialize(graph, recorded, auditor, kernels, events, path: str) -> dict:
    driver = cu()
    T = driver.CUgraphNodeType
    n = call("cuGraphGetNodes", graph, 0)[1]
    nodes = call("cuGraphGetNodes", graph, n)[0] if n else []
    index = {int(node): i for i, node in enumerate(nodes)}
    out_nodes = []
    for i, node in enumerate(nodes):
        ty = call("cuGraphNodeGetType", node)
        label = f"graph node {path}{i}"
        if ty == T.CU_GRAPH_NODE_TYPE_KERNEL:
            p = call("cuGraphKernelNodeGetParams", node)
            func = p.func
            if not int(func):
                func = call("cuKernelGetFunction", p.kern)
            name = call("cuFuncGetName", func).decode()
            layout = _param_layout(func)
            params = _kernel_param_bytes(p, layout, name)
            auditor.check_block(
                params, lambda off, name=name, label=label: f"{label} (kernel {name}) parameter byte {off}"
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
            p = call("cuGraphMemsetNodeGetParams", node)
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
            p = call("cuGraphMemcpyNodeGetParams", node)
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
                "cuGraphEventRecordNodeGetEvent"
                if ty == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD
                else "cuGraphEventWaitNodeGetEvent"
            )
            event = int(call(getter, node))
            slot = events.setdefault(event, len(events))
            kind = "event_record" if ty == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD else "event_wait"
            out_nodes.append({"type": kind, "event": slot})
        elif ty == T.CU_GRAPH_NODE_TYPE_EMPTY:
            out_nodes.append({"type": "empty"})
        elif ty == T.CU_GRAPH_NODE_TYPE_GRAPH:
            child = call("cuGraphChildGraphNodeGetGraph", node)
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
    n_edges = call("cuGraphGetEdges", graph, 0)[-1]
    edges = []
    if n_edges:
        frm, to, data, got = call("cuGraphGetEdges", graph, n_edges)
        for a, b, d in zip(frm[:got], to[:got], data[:got]):
            edges.append([index[int(a)], index[int(b)], int(d.from_port), int(d.to_port), int(d.type)])
    return {"nodes": out_nodes, "edges": edges}


class Rebuilt:
    """A restored graph: the CUgraph, its executable, and what must stay alive with them."""

    def __init__(self, graph, exec_, events: list, keepalive: list):
        self.graph, self.exec, self.events, self._keepalive = graph, exec_, events, keepalive

    def launch(self, stream: int) -> None:
        call("cuGraphLaunch", self.exec, cu().CUstream(init_value=stream))

    def destroy(self) -> None:
        if self.exec is not None:
            call("cuGraphExecDestroy", self.exec)
            call("cuGraphDestroy", self.graph)
            for event in self.events:
                call("cuEventDestroy", event)
            self.exec = None


def rebuild(desc: dict, modules: LoadedModules, kernel_attrs: dict, stream: int) -> Rebuilt:
    events = [call("cuEventCreate", CU_EVENT_DISABLE_TIMING) for _ in range(desc.get("events", 0))]
    keepalive: list = []
    graph = _build(desc, modules, kernel_attrs, events, keepalive)
    exec_ = call("cuGraphInstantiate", graph, 0)
    call("cuGraphUpload", exec_, cu().CUstream(init_value=stream))
    return Rebuilt(graph, exec_, events, keepalive)


def _build(desc: dict, modules: LoadedModules, kernel_attrs: dict, events: list, keepalive: list):
    driver = cu()
    graph = call("cuGraphCreate", 0)
    handles = []
    ctx = call("cuCtxGetCurrent")
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
            handle = call("cuGraphAddKernelNode", graph, None, 0, p)
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
            handle = call("cuGraphAddMemsetNode", graph, None, 0, p, ctx)
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
            handle = call("cuGraphAddMemcpyNode", graph, None, 0, p, ctx)
        elif kind == "event_record":
            handle = call("cuGraphAddEventRecordNode", graph, None, 0, events[node["event"]])
        elif kind == "event_wait":
            handle = call("cuGraphAddEventWaitNode", graph, None, 0, events[node["event"]])
        elif kind == "empty":
            handle = call("cuGraphAddEmptyNode", graph, None, 0)
        elif kind == "graph":
            child = _build(node["graph"], modules, kernel_attrs, events, keepalive)
            handle = call("cuGraphAddChildGraphNode", graph, None, 0, child)
            call("cuGraphDestroy", child)  # the node holds its own clone
        else:
            raise GraphError(f"archive holds a node of unknown type {kind!r}")
        handles.append(handle)
    for a, b, from_port, to_port, dep_type in desc["edges"]:
        data = driver.CUgraphEdgeData()
        data.from_port, data.to_port, data.type = from_port, to_port, dep_type
        call("cuGraphAddDependencies", graph, [handles[a]], [handles[b]], [data], 1)
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
