"""Restoring graphs: the two graph builders and the choice between them.

Restore adds the nodes to a fresh graph with the reloaded kernels, then each edge on its own (one
cuGraphAddDependencies call per edge keeps each edge's data its own), and instantiates and uploads
it. Two builders do that, call for call the same: the native one (:class:`NativeBuilder`,
native/graphbuild.c, one C call per graph straight from the FGB1 encoding) and the Python one
(:func:`rebuild`, one cuda-python call per node and edge). ``FOUNDRY_BUILDER`` picks
(:func:`builder_choice`): ``auto`` (default: native, falling back to Python with a warning where the
native one is missing or fails), ``native`` or ``python``.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import NamedTuple

from cuda.bindings import driver as _drv

from . import _native
from .driver import CudaError, call, cu
from .graph_codec import _HEADER, encoded_events
from .graphs import INSTANTIATE_FLAGS, NODE_ATTRIBUTES, GraphError, param_bytes
from .modules import LoadedModules, ModuleError

CU_EVENT_DISABLE_TIMING = int(_drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)


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

    def launcher(self, current_stream, device: int):
        """``launch`` on ``current_stream(device)`` as one closure over the executable: what a replay
        without random state runs, with no attribute lookups or method calls of its own. Valid until
        :meth:`destroy`; the caller drops it then."""
        launch, exec_, cu_stream = self._launch, self.exec, cu().CUstream
        last_stream, handle = None, None

        def replay() -> None:
            nonlocal last_stream, handle
            stream = current_stream(device)
            if stream != last_stream:
                last_stream, handle = stream, cu_stream(init_value=stream)
            (err,) = launch(exec_, handle)
            if int(err):
                raise CudaError("cuGraphLaunch", err)

        return replay

    def upload(self, stream: int) -> None:
        """Upload the executable graph to the device now (cuGraphUpload) instead of at its first launch."""
        call(cu().cuGraphUpload, self.exec, cu().CUstream(init_value=stream))

    def destroy(self) -> None:
        if self.exec is not None:
            call(cu().cuGraphExecDestroy, self.exec)
            call(cu().cuGraphDestroy, self.graph)
            for event in self.events:
                call(cu().cuEventDestroy, event)
            self.exec = None


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


def _launch_of(node: dict, func) -> str:
    """A kernel node's launch, for the error when the driver refuses it: the kernel, its
    configuration and the limits its function has now (a dynamic shared memory request above the
    function's limit is one way to CUDA_ERROR_INVALID_VALUE)."""
    driver = cu()
    limits = []
    for label, attr in (
        ("limit", driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
        ("max threads", driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
    ):
        err, value = driver.cuFuncGetAttribute(attr, func)
        limits.append(f"{label} {value if int(err) == 0 else err.name}")
    return (
        f"kernel {node['name']}, grid {tuple(node['grid'])}, block {tuple(node['block'])}, "
        f"dynamic shared memory {node['smem']} bytes ({', '.join(limits)})"
    )


def rebuild(
    desc: dict, modules: LoadedModules, kernel_attrs: dict, stream: int | None, timings: dict | None = None
) -> Rebuilt:
    """The Python builder: one driver call per node and per edge. Uploads the executable to
    ``stream`` unless it is None. ``timings`` accumulates seconds."""
    t0 = time.perf_counter()
    events = [call(cu().cuEventCreate, CU_EVENT_DISABLE_TIMING) for _ in range(desc.get("events", 0))]
    keepalive: list = []
    graph = exec_ = None
    try:
        graph = _build(desc, modules, kernel_attrs, events, keepalive)
        t1 = time.perf_counter()
        exec_ = call(cu().cuGraphInstantiate, graph, INSTANTIATE_FLAGS)
        t2 = time.perf_counter()
        if stream is not None:
            call(cu().cuGraphUpload, exec_, cu().CUstream(init_value=stream))
        t3 = time.perf_counter()
    except BaseException:  # nothing of a graph that failed stays behind (a deferred one is retried)
        if exec_ is not None:
            cu().cuGraphExecDestroy(exec_)
        if graph is not None:
            cu().cuGraphDestroy(graph)
        for event in events:
            cu().cuEventDestroy(event)
        raise
    if timings is not None:
        _add_times(timings, t1 - t0, t2 - t1, t3 - t2)
    return Rebuilt(graph, exec_, events, keepalive)


def _add_times(timings: dict, build: float, instantiate: float, upload: float) -> None:
    for key, value in (("build_s", build), ("instantiate_s", instantiate), ("upload_s", upload)):
        timings[key] = timings.get(key, 0.0) + value


def _build(desc: dict, modules: LoadedModules, kernel_attrs: dict, events: list, keepalive: list):
    driver = cu()
    graph = call(driver.cuGraphCreate, 0)
    try:
        return _add_nodes(graph, desc, modules, kernel_attrs, events, keepalive)
    except BaseException:
        driver.cuGraphDestroy(graph)  # with the nodes added so far
        raise


def _add_nodes(graph, desc: dict, modules: LoadedModules, kernel_attrs: dict, events: list, keepalive: list):
    driver = cu()
    handles = []
    ctx = call(driver.cuCtxGetCurrent)
    for node in desc["nodes"]:
        kind = node["type"]
        if kind == "kernel":
            func = modules.function(
                node["image"], node["name"], kernel_attrs.get((node["image"], node["name"]), {})
            )
            params = param_bytes(node["params"])
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
            try:
                handle = call(driver.cuGraphAddKernelNode, graph, None, 0, p)
            except CudaError as e:
                raise CudaError(f"{e.call} ({_launch_of(node, func)})", driver.CUresult(e.code)) from None
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
        flags = _BUILD_INSTANTIATE | (_BUILD_UPLOAD if stream is not None else 0)
        return self._build(self._so.foundry_graph_build, data, (stream or 0, flags), timings)

    def check(self, data: bytes) -> None:
        """Build the graph ``data`` encodes, without instantiating it, and throw it away: raises
        :class:`GraphError` with the driver's refusal where a node cannot be added."""
        rebuilt = self._build(self._so.foundry_graph_build, data, (0, 0), None)
        call(cu().cuGraphDestroy, rebuilt.graph)
        for event in rebuilt.events:
            call(cu().cuEventDestroy, event)

    def memory_nodes(self, data: bytes) -> MemoryNodes:
        """What building ``data`` ahead of its memory takes (native/graphbuild.c)."""
        counts = (ctypes.c_uint64 * 4)()
        err = ctypes.create_string_buffer(512)
        buf = ctypes.c_char_p(data)
        if self._so.foundry_graph_memory_nodes(
            ctypes.cast(buf, ctypes.c_void_p), len(data), counts, err, len(err)
        ):
            raise GraphError(f"native graph builder: {err.value.decode(errors='replace')}")
        return MemoryNodes(*(int(c) for c in counts))

    def rebuild_ahead(
        self, data: bytes, standin: int, standin_bytes: int, n_memory: int, timings: dict | None = None
    ) -> tuple[Rebuilt, Moved]:
        """Build and instantiate the graph ``data`` encodes before its memory is mapped, its
        ``n_memory`` memory nodes pointing into the stand-in; :func:`retarget` finishes it."""
        moved = (ctypes.c_void_p * max(n_memory, 1))()
        n_moved = ctypes.c_size_t()
        extra = (standin, standin_bytes, moved, n_memory, ctypes.byref(n_moved))
        rebuilt = self._build(self._so.foundry_graph_build_ahead, data, extra, timings)
        return rebuilt, Moved(data, moved, n_moved.value)

    def _build(self, fn, data: bytes, extra: tuple, timings: dict | None) -> Rebuilt:
        """One native build call: the encoding, the functions and fresh events, ``extra`` (what the
        call takes besides), then the graph, its executable, the times and the error buffer."""
        n_events = encoded_events(data) if len(data) >= _HEADER.size else 0
        events = [call(cu().cuEventCreate, CU_EVENT_DISABLE_TIMING) for _ in range(n_events)]
        handles = (ctypes.c_void_p * max(n_events, 1))(*[int(e) for e in events])
        graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
        times = (ctypes.c_double * 3)()
        err = ctypes.create_string_buffer(1024)
        buf = ctypes.c_char_p(data)
        rc = fn(
            ctypes.cast(buf, ctypes.c_void_p),
            len(data),
            self._funcs,
            self.n_funcs,
            handles,
            n_events,
            *extra,
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
        # ctypes reads a NULL handle back as None (a build not asked to instantiate): keep it 0.
        return Rebuilt(
            driver.CUgraph(init_value=graph.value or 0),
            driver.CUgraphExec(init_value=exec_.value or 0),
            events,
            [],
        )


class MemoryNodes(NamedTuple):
    """A graph encoding's memset and memcpy nodes, as building it ahead of its memory sees them."""

    top: int  # in the top graph: built against the stand-in, re-pointed later
    in_children: int  # in child graphs: the graph is built after the mapping instead
    not_1d: int  # copies of more than one row in the top graph: likewise
    standin_bytes: int  # the stand-in the top graph's memory nodes need


class Moved(NamedTuple):
    """The memory nodes of a graph built ahead, to be pointed at their own addresses."""

    data: bytes
    nodes: ctypes.Array
    count: int


def retarget(rebuilt: Rebuilt, moved: Moved) -> None:
    """Point the memory nodes of a graph built ahead at their own addresses (mapped by now), in its
    executable and in the graph it was instantiated from. Raises :class:`GraphError`; the graph is
    then not to be replayed."""
    so = _native.graph_lib()
    if so is None:
        raise GraphError("the native library has no graph builder (rebuild it)")
    err = ctypes.create_string_buffer(1024)
    buf = ctypes.c_char_p(moved.data)
    rc = so.foundry_graph_retarget(
        ctypes.cast(buf, ctypes.c_void_p),
        len(moved.data),
        int(rebuilt.exec),
        moved.nodes,
        moved.count,
        err,
        len(err),
    )
    if rc != 0:
        raise GraphError(f"re-pointing memory nodes: {err.value.decode(errors='replace')}")


def check_rebuilds(images: dict[str, bytes], kernels: list, walked: list, blobs: list) -> None:
    """Build every graph of a SAVE once the way LOAD will, from what the archive is about to hold
    (its code images loaded afresh, the kernels resolved in them with the recorded attributes, the
    encodings), and throw the builds away. The driver checks each node as it is added (a kernel's
    launch against its function's limits, memory nodes against their memory), so a graph that a
    LOAD could not rebuild is refused here, before anything is published, instead of failing every
    later start. Not instantiated: that is LOAD's cost and checks nothing more of the archive.

    ``kernels``: the archive's [image, name, attrs] list; ``walked``: (name, description) pairs;
    ``blobs``: their encodings (None where the JSON form is stored). Raises :class:`GraphError`
    naming the graph (or :class:`~foundry_core.modules.ModuleError` for a kernel's code)."""
    modules = LoadedModules()
    try:
        for digest, data in images.items():
            try:
                modules.load(digest, data)
            except CudaError as e:
                raise ModuleError(f"code image {digest[:12]} does not load: {e}") from None
        native = NativeBuilder.create(modules, kernels) if None not in blobs else None
        attrs = {(image, name): a for image, name, a in kernels}
        for (name, desc), blob in zip(walked, blobs):
            try:
                if native is not None:
                    try:
                        native.check(blob)
                        continue
                    except GraphError:
                        pass  # LOAD falls back to the Python builder too: its answer decides
                _check_python(desc, modules, attrs)
            except (GraphError, CudaError) as e:
                raise GraphError(f"graph {name!r} would not restore: {e}") from None
    finally:
        modules.unload()


def _check_python(desc: dict, modules: LoadedModules, kernel_attrs: dict) -> None:
    events = [call(cu().cuEventCreate, CU_EVENT_DISABLE_TIMING) for _ in range(desc.get("events", 0))]
    try:
        call(cu().cuGraphDestroy, _build(desc, modules, kernel_attrs, events, []))
    finally:
        for event in events:
            cu().cuEventDestroy(event)
