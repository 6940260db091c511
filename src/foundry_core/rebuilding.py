"""Rebuilding an archive's code modules and graphs: the build step of a LOAD.

:func:`rebuild_archive` loads every code module of a verified archive and builds, instantiates and
(optionally) uploads every graph into a :class:`Rebuilding`. It needs no engine memory: a kernel
node holds its parameters as bytes, and nothing is launched. The driver does resolve the addresses
of memset and memcpy nodes when they are added (measured: ``cuGraphAddMemsetNode`` refuses an
unmapped destination), so ahead of the memory (``ahead=True``, what :mod:`.restore`'s background
thread asks for) those nodes are built against a stand-in allocation (:mod:`.standin`) and
re-pointed at their own addresses by :func:`finish_rebuild` once the memory is mapped. A graph that
cannot be built that way (a memory node in a child graph, a copy of several rows, the Python
builder) is left in ``deferred`` and built by :func:`finish_rebuild` after the mapping.
:func:`differences` holds rebuilt graphs against the archive's descriptions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

from .archive import Archive, ArchiveError
from .driver import CudaError
from .graph_build import Moved, NativeBuilder, Rebuilt, builder_choice, rebuild, retarget
from .graph_codec import ENCODING, decode, encode, kernel_ids
from .graph_compare import compare
from .graphs import GraphError, structure
from .modules import LoadedModules
from .progress import progress_bar
from .standin import MAX_BYTES as STANDIN_MAX_BYTES
from .standin import StandIn

logger = logging.getLogger("foundry.restore")


@dataclasses.dataclass
class Rebuilding:
    """An archive's modules and its graphs rebuilt (instantiated, not yet wrapped for replay)."""

    modules: LoadedModules
    graphs: dict[str, tuple[Rebuilt, dict | None, int]]  # name -> (graph, RNG state, nodes)
    builders: set[str]
    timings: dict[str, float]
    # Ahead of the memory (prepare): graphs the driver would not build yet, with why; rebuilt by
    # finish_rebuild once the memory is mapped.
    deferred: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    # Ahead of the memory: graphs whose memory nodes point into the stand-in until finish_rebuild.
    moved: dict[str, Moved] = dataclasses.field(default_factory=dict)
    standin: StandIn | None = None
    # Called with a graph's name each time one is built (the background thread's hand-over, Tail).
    on_built: Callable[[str], None] | None = None
    # Handed over to a LOAD that returned before the rebuild ended: the graphs it took are out of
    # ``graphs``, and the modules are the LOAD's (its Restored unloads them), not this rebuild's.
    handed: bool = False

    def discard(self) -> None:
        for rebuilt, _rng, _nodes in self.graphs.values():
            rebuilt.destroy()
        self.graphs, self.moved = {}, {}
        self._free_standin()
        if not self.handed:
            self.modules.unload()

    def repoint(self, name: str) -> bool | None:
        """Point graph ``name``'s memory nodes, built against the stand-in, at their own addresses,
        now mapped. True when it was re-pointed, None when it had nothing to re-point; False when the
        driver refused: the graph is then destroyed and left in ``deferred``, to be built again."""
        moved = self.moved.pop(name, None)
        if moved is None:
            return None
        rebuilt = self.graphs[name][0]
        try:
            retarget(rebuilt, moved)
        except GraphError as e:  # rebuilt from scratch, now that its memory is mapped
            rebuilt.destroy()
            del self.graphs[name]
            self.deferred[name] = e
            return False
        return True

    def build(self, archive: Archive, names: set[str]) -> None:
        """Build the graphs ``names`` of ``archive`` into ``graphs`` now that their memory is mapped
        (what was deferred, or a graph whose background build failed); raises as a rebuild does."""
        _rebuild_graphs(archive, self, None, False, {}, only=names)

    def build_alone(self, archive: Archive, name: str) -> Rebuilt:
        """Graph ``name`` of ``archive`` built now with this rebuild's modules, into the caller's hands."""
        one = Rebuilding(self.modules, {}, self.builders, {})
        one.build(archive, {name})
        return one.graphs[name][0]

    def _free_standin(self) -> None:
        if self.standin is not None:
            self.standin.free()
            self.standin = None


def rebuild_archive(
    archive: Archive,
    *,
    upload_to: int | None = None,
    progress: bool | None = None,
    ahead: bool = False,
    started: Callable[[Rebuilding], None] | None = None,
) -> Rebuilding:
    """Load every module of ``archive`` and rebuild every graph; on failure nothing stays loaded.

    ``ahead``: the graphs' memory is not mapped yet (:func:`prepare`). Memory nodes are then built
    against a stand-in and listed in ``moved``; a graph the driver refuses to build or instantiate
    even so is left in ``deferred``; :func:`finish_rebuild` completes both once the memory is mapped.

    Adds to the timings: modules_s, graph_read_s (reading, and decoding or encoding where the stored
    form is not the one the builder takes), graph_build_s, graph_instantiate_s, graph_upload_s, and
    ahead of the memory standin_bytes. ``started`` is called with the rebuild once the modules are
    loaded, before the first graph is built; from then on a failure leaves the rebuild to the caller
    to discard (it may have handed some of it over already).
    """
    meta = archive.meta
    timings: dict[str, float] = {}
    rebuilding = Rebuilding(LoadedModules(), {}, set(), timings)
    t0 = time.perf_counter()
    given = False
    try:
        with progress_bar("foundry: loading modules", len(meta["images"]), progress) as bar:
            for digest in meta["images"]:
                rebuilding.modules.load(digest, archive.read_bytes(f"modules/{digest}.cubin"))
                bar.update()
        for image, name, attrs in meta["kernels"]:
            rebuilding.modules.function(image, name, attrs)
        timings["modules_s"] = time.perf_counter() - t0
        if started is not None:
            started(rebuilding)
            given = True
        _rebuild_graphs(archive, rebuilding, upload_to, progress, timings, ahead=ahead)
    except BaseException:
        if not given:
            rebuilding.discard()  # the graphs rebuilt before the failure, the stand-in, the modules
        raise
    return rebuilding


def finish_rebuild(
    archive: Archive, rebuilding: Rebuilding, *, upload_to: int | None = None, progress: bool | None = None
) -> dict[str, float]:
    """Complete a rebuild made ahead of the memory, now mapped: re-point the memory nodes of the
    graphs built against the stand-in (and free it), upload the graphs to ``upload_to`` unless it
    is None, and build the graphs the driver would not build ahead. Raises as a rebuild at this point
    always did. Returns its timings (the part of the restore on the caller's path): retarget_s,
    retargeted_graphs, deferred_graphs, deferred_s, graph_build_s, graph_instantiate_s, graph_upload_s."""
    timings = {"graph_build_s": 0.0, "graph_instantiate_s": 0.0, "graph_upload_s": 0.0}
    t0 = time.perf_counter()
    repointed = [rebuilding.repoint(name) for name in list(rebuilding.moved)]
    timings["retargeted_graphs"] = float(repointed.count(True))  # the refused ones are rebuilt below
    rebuilding._free_standin()
    t1 = time.perf_counter()
    timings["retarget_s"] = t1 - t0
    if upload_to is not None:
        for rebuilt, _rng, _nodes in rebuilding.graphs.values():
            rebuilt.upload(upload_to)
        timings["graph_upload_s"] = time.perf_counter() - t1
    names = set(rebuilding.deferred)
    if names:
        t2 = time.perf_counter()
        split: dict[str, float] = {}
        _rebuild_graphs(archive, rebuilding, upload_to, progress, split, only=names)
        order = [e["name"] for e in archive.meta["graphs"]]  # the archive's order, as without deferral
        rebuilding.graphs = {n: rebuilding.graphs[n] for n in order if n in rebuilding.graphs}
        first = next(iter(rebuilding.deferred.values()))
        logger.info(
            "foundry: %d graphs rebuilt after their memory was mapped (ahead of it: %s)", len(names), first
        )
        rebuilding.deferred = {}
        for key in ("graph_build_s", "graph_instantiate_s", "graph_upload_s"):
            timings[key] += split.get(key, 0.0)
        timings.update(deferred_graphs=float(len(names)), deferred_s=time.perf_counter() - t2)
    return timings


def described(archive: Archive, entry: dict) -> dict:
    """The description SAVE wrote for the graph ``entry`` of the archive's manifest, decoded."""
    encoding = entry.get("encoding")
    if encoding == ENCODING:
        return decode(archive.read_bytes(entry["file"]), archive.meta["kernels"])
    if encoding is None:
        return archive.read_json(entry["file"])
    raise ArchiveError(f"graph {entry['name']!r} is stored in encoding {encoding!r}, unknown here")


def differences(
    archive: Archive, graph_of: Callable[[str], object], *, addresses: bool = True
) -> dict[str, str]:
    """``{graph name: first difference}`` between the archive's description of each of its graphs
    and the CUgraph ``graph_of(name)`` as the driver holds it (:func:`~.graph_compare.compare`; empty when
    all agree). ``addresses``: as in ``compare``, off for graphs captured at other addresses."""
    out = {}
    for entry in archive.meta["graphs"]:
        why = compare(described(archive, entry), structure(graph_of(entry["name"])), addresses=addresses)
        if why is not None:
            out[entry["name"]] = why
    return out


def _rebuild_graphs(archive, rebuilding, stream, progress, timings, *, only=None, ahead=False) -> None:
    """Rebuild the graphs of the archive (those named in ``only``, or all) into ``rebuilding.graphs``,
    adding the builders used ("native", "python") to ``rebuilding.builders`` as it goes (a LOAD that
    returned while the thread still builds reports them). ``ahead`` (of the memory): memory nodes are built
    against a stand-in (native builder) and a graph the driver refuses is recorded in
    ``rebuilding.deferred``, the others go on with the same builder."""
    meta = archive.meta
    modules, graphs = rebuilding.modules, rebuilding.graphs
    kernel_attrs = {(image, name): attrs for image, name, attrs in meta["kernels"]}
    choice = builder_choice()
    native = None
    if choice != "python":
        native = NativeBuilder.create(modules, meta["kernels"])
        if native is None:
            if choice == "native":
                raise GraphError(
                    "FOUNDRY_BUILDER=native, but the native library has no graph builder: rebuild it"
                )
            warnings.warn(
                "foundry: the native library has no graph builder; using the Python builder", stacklevel=3
            )
    ids = None
    split: dict[str, float] = {}
    read_s = 0.0
    used = rebuilding.builders
    entries = [e for e in meta["graphs"] if only is None or e["name"] in only]
    preread: dict[str, bytes] = {}  # encodings read by _plan_standin, taken by the loop below
    memory = _plan_standin(archive, rebuilding, native, entries, timings, preread) if ahead and native else {}
    with progress_bar("foundry: rebuilding graphs", len(entries), progress) as bar:
        for entry in entries:
            if ahead and entry["name"] in rebuilding.deferred:  # known not to build before the mapping
                preread.pop(entry["name"], None)
                bar.update()
                continue
            r0 = time.perf_counter()
            encoding = entry.get("encoding")
            data = desc = None
            if encoding == ENCODING:
                data = preread.pop(entry["name"], None) or archive.read_bytes(entry["file"])
                rng = entry.get("rng_state")
            elif encoding is None:
                desc = archive.read_json(entry["file"])
                rng = desc["rng"]
            else:
                raise ArchiveError(
                    f"graph {entry['name']!r} is stored in encoding {encoding!r}, unknown here"
                )
            rebuilt = None
            if native is not None:
                try:
                    if data is None:
                        ids = ids or kernel_ids(meta["kernels"])
                        data = encode({k: v for k, v in desc.items() if k != "rng"}, ids)
                    read_s += time.perf_counter() - r0
                    n_memory = memory.get(entry["name"], 0)
                    if n_memory and rebuilding.standin is not None:
                        standin = rebuilding.standin
                        rebuilt, moved = native.rebuild_ahead(
                            data, standin.base, standin.size, n_memory, split
                        )
                        if moved.count:
                            rebuilding.moved[entry["name"]] = moved
                    else:
                        rebuilt = native.rebuild(data, stream, split)
                    used.add("native")
                except GraphError as e:
                    if ahead:  # retried once the memory is mapped
                        rebuilding.deferred[entry["name"]] = e
                        bar.update()
                        continue
                    if choice == "native":
                        raise GraphError(f"graph {entry['name']!r}: {e}") from None
                    warnings.warn(
                        f"foundry: graph {entry['name']!r}: {e}; falling back to the Python builder",
                        stacklevel=3,
                    )
                    native = None
                r0 = time.perf_counter()
            if rebuilt is None:
                if desc is None:
                    desc = decode(data, meta["kernels"])
                read_s += time.perf_counter() - r0
                try:
                    rebuilt = rebuild(desc, modules, kernel_attrs, stream, split)
                except (GraphError, CudaError) as e:
                    if not ahead:
                        raise
                    rebuilding.deferred[entry["name"]] = e  # retried once the memory is mapped
                    bar.update()
                    continue
                used.add("python")
            graphs[entry["name"]] = (rebuilt, rng, entry["nodes"])
            if rebuilding.on_built is not None:
                rebuilding.on_built(entry["name"])
            bar.update()
    timings["graph_read_s"] = read_s
    for key in ("build_s", "instantiate_s", "upload_s"):
        timings[f"graph_{key}"] = split.get(key, 0.0)


def _plan_standin(archive, rebuilding, native, entries, timings, preread) -> dict[str, int]:
    """Ahead of the memory: how many memory nodes each graph's top level has (graphs that have some
    are built against the stand-in), and the stand-in itself, as large as the largest need. A graph
    whose memory nodes the stand-in cannot serve (in a child graph, a copy of several rows, more
    than :data:`.standin.MAX_BYTES`) is put in ``rebuilding.deferred`` at once, not tried, as are
    all graphs with memory nodes when no stand-in can be had. The encodings it reads are left in
    ``preread``."""
    memory: dict[str, int] = {}
    need = 0
    for entry in entries:
        if entry.get("encoding") != ENCODING:
            continue  # a JSON description: built after the mapping if it has memory nodes
        data = preread[entry["name"]] = archive.read_bytes(entry["file"])
        nodes = native.memory_nodes(data)
        why = None
        if nodes.in_children:
            why = f"{nodes.in_children} memory nodes in child graphs"
        elif nodes.not_1d:
            why = f"{nodes.not_1d} copies of more than one row"
        elif nodes.standin_bytes > STANDIN_MAX_BYTES:
            why = (
                f"its memory nodes span {nodes.standin_bytes} bytes, the stand-in at most {STANDIN_MAX_BYTES}"
            )
        if why is not None:
            rebuilding.deferred[entry["name"]] = GraphError(f"not built ahead of the memory: {why}")
        elif nodes.top:
            memory[entry["name"]] = nodes.top
            need = max(need, nodes.standin_bytes)
    if memory:
        try:
            rebuilding.standin = StandIn(max(need, 1))
        except CudaError as e:  # the graphs with memory nodes are then built after the mapping
            logger.info("foundry: no stand-in memory for building ahead (%s)", e)
            for name in memory:
                rebuilding.deferred[name] = e
            return {}
        timings["standin_bytes"] = float(rebuilding.standin.size)
    return memory
