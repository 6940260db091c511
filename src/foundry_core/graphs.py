"""Describing CUDA graphs: a captured graph walked into a plain description, and a restored one.

A captured ``cudaGraph_t`` is walked node by node into a plain description: kernel launches with
their code identity, launch geometry, parameter bytes and launch attributes;
memsets; device-to-device copies; event record/wait; empty nodes; child graphs; and every edge
with its edge data (programmatic dependent launch edges included). Anything else makes SAVE fail
with the node type and, where there is one, the kernel name.

While walking, every 8-byte word of every kernel parameter is audited: a word that points into
device memory must fall inside a live segment of the Foundry region, else the graph depends on an
address a fresh process cannot reproduce and SAVE fails.

SAVE stores each description in FGB1, a compact binary encoding (graph_codec.py); the walk leaves
each kernel's parameters as bytes, which the encoding stores as they are (:func:`json_form` gives
the JSON form, base64 text, as descriptions read back from the driver or an archive hold them).
Restore builds a graph from it (graph_build.py); :func:`structure` reads a built graph back from
the driver, for graph_compare.py to hold against the description.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import dataclasses
import itertools
import struct
import threading
import warnings
from collections.abc import Callable

from cuda.bindings import driver as _drv

from . import _native, collectives
from .driver import call, cu
from .errors import FoundryError
from .modules import Recorded, function_attributes

# The launch 'extra' keys are pointer-valued macros in cuda.h (no enum in the bindings).
CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
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
    """Live region segments, for the pointer audit; ``outside``: (start, size, what) of the ranges
    outside the region that the graphs may address too (torch symmetric memory, recorded with the
    archive and checked at LOAD: symmetric.py)."""

    def __init__(
        self,
        region_base: int,
        region_size: int,
        live: list[tuple[int, int]],
        outside: list[tuple[int, int, str]] | None = None,
    ):
        self.base, self.size = region_base, region_size
        self._starts = [a for a, _ in sorted(live)]
        self._ends = [a + s for a, s in sorted(live)]
        outside = sorted(outside or [])
        self._out_starts = [a for a, _n, _w in outside]
        self._out_ends = [a + n for a, n, _w in outside]

    def outside(self, addr: int) -> bool:
        """True when ``addr`` lies in one of the recorded ranges outside the region."""
        i = bisect.bisect_right(self._out_starts, addr) - 1
        return i >= 0 and addr < self._out_ends[i]

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


def param_bytes(value: str | bytes) -> bytes:
    """A kernel node's ``params``: bytes as :func:`serialize` leaves them, or base64 text where the
    description is in its JSON form."""
    return value if isinstance(value, bytes) else base64.b64decode(value)


def json_form(desc: dict) -> dict:
    """``desc`` with every kernel's parameter bytes as base64 text (child graphs too): what the
    JSON graph form stores (FOUNDRY_GRAPH_ENCODING=json)."""
    nodes = []
    for node in desc["nodes"]:
        if node["type"] == "kernel" and isinstance(node["params"], bytes):
            node = {**node, "params": _b64(node["params"])}
        elif node["type"] == "graph":
            node = {**node, "graph": json_form(node["graph"])}
        nodes.append(node)
    return {**desc, "nodes": nodes}


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


def _packed_layout(layout: list[tuple[int, int]]):
    """``layout`` as the native packer takes it: n x {offset, size} 32-bit words."""
    return (ctypes.c_uint32 * max(2 * len(layout), 1))(*itertools.chain.from_iterable(layout))


def _param_total(layout: list[tuple[int, int]]) -> int:
    return max((o + s for o, s in layout), default=0)


def _kernel_param_bytes(
    p, layout: list[tuple[int, int]], name: str, layout_words=None, total: int | None = None
) -> bytes:
    """The kernel's argument block, laid out at the offsets the function declares. ``layout_words``
    (the layout from :func:`_packed_layout`) and ``total`` (:func:`_param_total`): made once per
    function by a caller that has many nodes."""
    if total is None:
        total = _param_total(layout)
    kp, extra = int(p.kernelParams or 0), int(p.extra or 0)
    if kp:
        # kernelParams: one pointer per parameter, copied in one native call where the library is
        # there (about 2 µs a node instead of about 15 µs for a dozen parameters in Python).
        so = _native.graph_lib()
        if so is not None:
            out = ctypes.create_string_buffer(max(total, 1))
            words = layout_words if layout_words is not None else _packed_layout(layout)
            so.foundry_graph_pack_params(kp, words, len(layout), out)
            return out.raw[:total]
        buf = bytearray(total)
        for i, (offset, size) in enumerate(layout):
            arg = ctypes.c_void_p.from_address(kp + 8 * i).value
            buf[offset : offset + size] = ctypes.string_at(arg, size)
        return bytes(buf)
    if extra:
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
        return ctypes.string_at(packed, total)
    if total:
        raise GraphError(
            f"kernel {name}: node has {len(layout)} parameters but neither kernelParams nor extra"
        )
    return b""


class _Function:
    """What the walk keeps of one kernel function: asked of the driver once per SAVE."""

    __slots__ = ("name", "kind", "layout", "image", "layout_words", "param_total")

    def __init__(self, name: str, kind: str | None, layout: list[tuple[int, int]]):
        self.name = name
        self.kind = kind  # collective kind (collectives.py) or None
        self.layout = layout  # the parameters' (offset, size)
        self.image = None  # digest of the code image that holds it, once matched
        self.layout_words = _packed_layout(layout)
        self.param_total = _param_total(layout)


@dataclasses.dataclass
class WalkMemo:
    """What one SAVE learns once and every graph it walks reuses. The SAVE allocates nothing while it
    walks, so the driver's answers hold for all its graphs: the same few hundred functions and the
    same parameter words recur in every graph (each decode graph of an engine points at the same
    buffers)."""

    #: int(CUfunction) -> what the walk keeps of it
    functions: dict[int, _Function] = dataclasses.field(default_factory=dict)
    #: Words outside the region that the driver said are not device memory (sizes and strides
    #: packed in pairs, flags: a FlashAttention parameter block holds dozens; each question is a
    #: driver call).
    not_memory: set[int] = dataclasses.field(default_factory=set)
    #: Words found inside a live region allocation.
    live: set[int] = dataclasses.field(default_factory=set)


class _Auditor:
    """Checks that every device pointer a node carries lies in a live region segment."""

    def __init__(self, segments: Segments, memo: WalkMemo | None = None):
        memo = WalkMemo() if memo is None else memo
        self.segments = segments
        self.pointers: set[int] = set()  # this graph's region pointers, for the RNG-state search
        # Words inside the region's address range that no live allocation covers. A kernel that
        # dereferenced one would fault or read freed memory in the engine's own replay too, so these
        # are data that happens to look like an address (struct padding left uninitialised, packed
        # integers): seen on FlashAttention-3's parameter struct, differently in every process.
        # The bytes are restored as they were, so LOAD behaves exactly as the captured graph did.
        self.dead_words = 0
        self.collectives: dict[str, int] = {}  # collective kind -> kernel nodes (collectives.py)
        self.symmetric: set[int] = set()  # words pointing into recorded symmetric memory
        self.functions, self.not_memory, self.live = memo.functions, memo.not_memory, memo.live

    def check_word(self, value: int, where: Callable[[], str]) -> bool:
        """Raises if ``value`` is device memory outside the region. True when it is a dead word
        (in the region's range, in no live allocation), counted once here."""
        if value < _POINTER_FLOOR:
            return False
        if self.segments.in_region(value):
            if self.segments.live(value):
                self.pointers.add(value)
                self.live.add(value)
                return False
            self.dead_words += 1
            return True
        if value in self.not_memory or self.symmetric_word(value):
            return False
        err, _ = cu().cuPointerGetAttribute(cu().CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, value)
        if int(err) == 0:
            raise GraphError(
                f"{where()} points to memory at {value:#x} outside the Foundry region; allocate everything the "
                "graph uses inside Region.routing() (or capture with pool=region.graph_pool_id())"
            )
        self.not_memory.add(value)
        return False

    def symmetric_word(self, value: int) -> bool:
        """True (and counted) when ``value`` points into the recorded symmetric memory."""
        if self.segments.outside(value):
            self.symmetric.add(value)
            return True
        return False

    def check_block(self, data: bytes, where: Callable[[int], str]) -> None:
        # Every aligned 8-byte word, unpacked at once: a save walks millions of them. Each distinct
        # word is looked at once, and words met before in this SAVE (live allocations, words that
        # are not memory) with set operations, without a Python step per word.
        words = struct.unpack_from(f"<{len(data) // 8}Q", data)
        new = {v for v in words if v >= _POINTER_FLOOR}
        new -= self.not_memory
        new -= self.symmetric
        known = new & self.live
        self.pointers |= known
        new -= known
        for value in sorted(new, key=words.index):  # in block order: the first bad word is named
            if self.check_word(value, lambda value=value: where(8 * words.index(value))):
                self.dead_words += words.count(value) - 1  # every occurrence, as the bytes hold them


def _read_attrs(node) -> dict:
    """The kernel node's launch attributes that differ from the default: the archive's names and values.

    Read natively in one call (the SAVE walks some 100,000 nodes, and the Python reading costs a
    driver call and a value object of about 3 µs per attribute, 8 per node). Until a node with an
    attribute set has been read both ways and both agree, nodes are also read the Python way (and
    that answer used): every node the native reading finds attributes on, the first
    :data:`ATTRS_CHECK_FIRST` nodes, and every :data:`ATTRS_CHECK_EVERY`-th after them (graphs
    whose kernels set no launch attribute at all were otherwise read twice at every node: about
    24 µs each). A disagreement turns the native reading off for the process."""
    global _native_attrs_ok, _native_attrs_checked, _native_attrs_read
    if _native_attrs_ok is not False:
        got = _read_attrs_native(node)
        if got is not None:
            if _native_attrs_ok:
                return got
            _native_attrs_read += 1
            if (
                not got
                and _native_attrs_checked >= ATTRS_CHECK_FIRST
                and _native_attrs_read % ATTRS_CHECK_EVERY
            ):
                return got
            expected = _read_attrs_python(node)
            _native_attrs_checked += 1
            if got != expected:
                _native_attrs_ok = False
            elif expected:
                _native_attrs_ok = True
            if _native_attrs_ok is False:
                warnings.warn(
                    f"foundry: native launch-attribute reading gave {got}, the driver's Python binding "
                    f"{expected}; reading them the Python way",
                    stacklevel=2,
                )
            return expected
        _native_attrs_ok = False
    return _read_attrs_python(node)


_native_attrs_ok: bool | None = None  # None: not compared yet on a node with attributes
_native_attrs_checked = 0  # nodes read both ways (all agreed, none with attributes) in this process
_native_attrs_read = 0  # nodes read natively while _native_attrs_ok is None
ATTRS_CHECK_FIRST = 256
ATTRS_CHECK_EVERY = 256
_ATTR_KEYS = tuple(NODE_ATTRIBUTES)
_ATTR_IDS = (ctypes.c_int32 * len(_ATTR_KEYS))(*[NODE_ATTRIBUTES[k][0] for k in _ATTR_KEYS])
_UNSIGNED_ATTRS = ("preferred_carveout",)  # a C unsigned int; the other scalar ones are int or enums


_attr_buffers = threading.local()  # one (words, error) pair per thread, reused node after node
_NO_ATTR_WORDS = bytes(4 * 3 * len(_ATTR_KEYS))


def _read_attrs_native(node) -> dict | None:
    so = _native.graph_lib()
    if so is None:
        return None
    buffers = getattr(_attr_buffers, "pair", None)
    if buffers is None:
        buffers = _attr_buffers.pair = (
            (ctypes.c_uint32 * (3 * len(_ATTR_KEYS)))(),
            ctypes.create_string_buffer(256),
        )
    words, err = buffers
    mask = so.foundry_graph_node_attrs(int(node), _ATTR_IDS, len(_ATTR_KEYS), words, err, len(err))
    if mask < 0:
        return None
    if bytes(words) == _NO_ATTR_WORDS:  # every attribute at its default: most nodes, in one compare
        return {}
    attrs = {}
    for a, key in enumerate(_ATTR_KEYS):
        if not (mask >> a) & 1:
            continue
        w = words[3 * a : 3 * a + 3]
        if key in ("cluster_dim", "preferred_cluster_dim"):
            if any(w):
                attrs[key] = list(w)
        elif key == "mem_sync_domain_map":
            if any(w[:2]):
                attrs[key] = list(w[:2])
        else:
            value = w[0] if key in _UNSIGNED_ATTRS else ctypes.c_int32(w[0]).value
            if value:
                attrs[key] = value
    return attrs


def _read_attrs_python(node) -> dict:
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


def block_auditor(segments: Segments, memo: WalkMemo) -> Callable[[bytes, Callable[[int], str]], None]:
    """``audit(data, where)``: checks a block of words the graphs' kernels read besides their
    parameters (a module's variables) as a kernel's parameters are checked; ``where(offset)`` names
    the place of a refused word."""
    return _Auditor(segments, memo).check_block


def serialize(
    graph,
    recorded: Recorded,
    segments: Segments,
    kernels: dict,
    memo: WalkMemo | None = None,
) -> tuple[dict, set[int]]:
    """Describe ``graph`` (a CUgraph). ``kernels`` collects (image, name) -> function attributes;
    ``memo``: what the walk learns once, kept across the graphs of one save.

    Returns the description and the region addresses its kernels point at.
    """
    auditor = _Auditor(segments, memo)
    events: dict[int, int] = {}
    desc = _serialize(graph, recorded, auditor, kernels, events, path="")
    desc["events"] = len(events)
    if auditor.dead_words:
        desc["unmapped_region_words"] = auditor.dead_words
    if auditor.collectives:
        desc["collectives"] = dict(sorted(auditor.collectives.items()))
    if auditor.symmetric:  # distinct addresses into symmetric memory (foundry inspect)
        desc["symmetric_pointers"] = len(auditor.symmetric)
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
            # What the driver says about a function is the same at every node that launches it
            # (tens of thousands of nodes, a few hundred functions): asked once per save.
            info = auditor.functions.get(int(func))
            if info is None:
                name = call(driver.cuFuncGetName, func).decode()
                info = auditor.functions[int(func)] = _Function(
                    name, collectives.kind_of(name), _param_layout(func)
                )
            name, kind, layout = info.name, info.kind, info.layout
            if kind is not None:
                why = collectives.refusal(kind, name)
                if why is not None:
                    raise GraphError(f"{label}: {why}")
                auditor.collectives[kind] = auditor.collectives.get(kind, 0) + 1
            params = _kernel_param_bytes(p, layout, name, info.layout_words, info.param_total)
            auditor.check_block(
                params,
                lambda off, name=name, label=label: f"{label} (kernel {_short(name)}) parameter byte {off}",
            )
            image = info.image
            if image is None:
                image = info.image = recorded.match(func, name)
                if (image, name) not in kernels:
                    kernels[(image, name)] = function_attributes(func)
            # Some launchers set a kernel's dynamic shared memory limit to exactly what the launch
            # at hand needs (FlashInfer's RMSNorm does, on every launch), so after capture the
            # limit holds the last launch's need, not the largest. LOAD sets the limit once per
            # kernel: it must cover every node's need (a node above it is refused by
            # cuGraphAddKernelNode with CUDA_ERROR_INVALID_VALUE, the likely cause of the
            # Qwen3-Next LOAD that failed on SGLang, docs/performance.md).
            smem = int(p.sharedMemBytes)
            attrs = kernels[(image, name)]
            if smem > attrs.get("max_dynamic_shared", smem):
                attrs["max_dynamic_shared"] = smem
            out_nodes.append(
                {
                    "type": "kernel",
                    "image": image,
                    "name": name,
                    "grid": [int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)],
                    "block": [int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)],
                    "smem": smem,
                    "layout": layout,
                    "params": params,  # bytes: the encoding stores them as they are (json_form)
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
                if auditor.symmetric_word(addr):  # a copy into (or out of) a symmetric buffer
                    continue
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


def count_nodes(desc: dict) -> int:
    return sum(1 + (count_nodes(n["graph"]) if n["type"] == "graph" else 0) for n in desc["nodes"])


def kernel_nodes(desc: dict):
    """The kernel nodes of a description, child graphs' included, in order."""
    for n in desc["nodes"]:
        if n["type"] == "kernel":
            yield n
        elif n["type"] == "graph":
            yield from kernel_nodes(n["graph"])


def kernel_names(desc: dict) -> list[str]:
    return [n["name"] for n in kernel_nodes(desc)]


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
