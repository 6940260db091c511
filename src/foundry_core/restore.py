"""The part of a LOAD that needs no engine memory: an archive's code modules and graphs, rebuilt.

Loading the kernels' modules, building each graph and instantiating it depend only on the verified
archive and the device's context, not on the memory the graphs' pointers name: a kernel node holds
its parameters as bytes, and nothing is launched. :func:`prepare` therefore runs this work on a
background thread that an engine starts once its archive is accepted and its region reserved, so
that it overlaps the engine's own setup (weights, KV cache); :func:`foundry_core.load` with
``prepared=`` then maps the memory, restores its contents and takes the graphs; those the thread
is still building then are handed over as each is built (:mod:`.tail`), so ``load`` does not wait
for them. The driver does resolve the addresses of memset and memcpy nodes when they are added
(measured: ``cuGraphAddMemsetNode`` refuses an unmapped destination), so ahead of the memory those
nodes are built against a stand-in allocation (:mod:`.standin`) and re-pointed at their own addresses
by :func:`finish_rebuild`, after the mapping. A graph that cannot be built that way (a memory node in
a child graph, a copy of several rows, the Python builder) is built by :func:`finish_rebuild` after
the mapping; if the background rebuild failed as a whole for any reason other than the archive
itself, ``load`` rebuilds everything synchronously, as it does without ``prepared``. The graphs a
LOAD hands back are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable

from .archive import Archive, ArchiveError
from .driver import CudaError, call, cu
from .graph_build import Moved, NativeBuilder, builder_choice, rebuild, retarget
from .graph_codec import ENCODING, decode, encode, kernel_ids
from .graphs import GraphError, Rebuilt, compare, structure
from .modules import LoadedModules
from .progress import progress_bar
from .standin import MAX_BYTES as STANDIN_MAX_BYTES
from .standin import StandIn
from .tail import Tail
from .trust import check_location

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
    and the CUgraph ``graph_of(name)`` as the driver holds it (:func:`~.graphs.compare`; empty when
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


def _context_for(device: int):
    """The context the thread is to use: the caller's current one when it is the device's (an
    engine's thread after its device was set), else the device's primary context, retained (torch
    and the runtime use that one and keep it for the life of the process)."""
    driver = cu()
    ctx = call(driver.cuCtxGetCurrent)
    if ctx is not None and int(ctx) and int(call(driver.cuCtxGetDevice)) == device:
        return ctx
    return call(driver.cuDevicePrimaryCtxRetain, call(driver.cuDeviceGet, device))


def _bind_context(ctx) -> None:
    """Make ``ctx`` current on this (new) thread. Not ``torch.cuda.set_device``: on a new thread,
    whose current device already reads as 0, torch skips the call and binds no context."""
    call(cu().cuCtxSetCurrent, ctx)


class Prepared:
    """A rebuild of an archive's modules and graphs running on a background thread (:func:`prepare`).

    Hand it to :func:`foundry_core.load` (``prepared=``), which takes what it made; or call
    :meth:`discard` when the LOAD is abandoned. Either waits for the thread.
    """

    def __init__(self, path: str | os.PathLike, device: int, archive: Archive | None, verify_args: dict):
        self.path, self.device = os.fspath(path), device
        self.archive = archive
        self._context = _context_for(device)  # looked up here, on the caller's thread
        self.seconds: float | None = None  # the thread's run time, once it ended
        self._verify_args = verify_args
        self._result: Rebuilding | None = None
        self._error: BaseException | None = None
        self._archive_error: BaseException | None = None
        self._taken = False
        # The hand-over to a LOAD that does not wait for the whole rebuild (hand_over, Tail).
        self._lock = threading.RLock()  # the thread re-enters it: finish_rest builds, on_built finishes
        self._building = threading.Event()  # set once the modules are loaded, or the thread ended
        self._rebuilding: Rebuilding | None = None
        self._tail: Tail | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="foundry-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.archive is None:
                from .api import verify

                try:
                    self.archive = verify(self.path, device=self.device, **self._verify_args)
                except BaseException as e:  # load() verifies again itself, with its own arguments
                    self._archive_error = e
                    return
            _bind_context(self._context)
            self._result = rebuild_archive(self.archive, progress=False, ahead=True, started=self._started)
        except BaseException as e:  # load() rebuilds synchronously instead, and says why
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            with self._lock:
                self._ended = True
                if self._error is not None and self._rebuilding is not None:
                    if self._tail is not None:  # what was handed over stays; the rest is built at replay
                        self._tail.fail_rest(self._error)
                    self._rebuilding.discard()
                elif self._tail is not None:
                    self._tail.timings["prepared_s"] = self.seconds
                    self._tail.finish_rest()
                    self._result = None  # the LOAD's now
            self._building.set()

    def _started(self, rebuilding: Rebuilding) -> None:
        rebuilding.on_built = self._built
        self._rebuilding = rebuilding
        self._building.set()

    def _built(self, name: str) -> None:
        with self._lock:
            if self._tail is not None:
                self._tail.finish(name)

    def building(self) -> Archive | None:
        """Wait until the thread has verified the archive and loaded its modules, or ended; then the
        verified archive while graphs are still being built (a LOAD may :meth:`hand_over`), else
        None (:meth:`take` it whole)."""
        self._building.wait()
        with self._lock:
            return None if self._ended or self._rebuilding is None else self.archive

    def hand_over(
        self, names: list[str], timings: dict[str, float], upload_to: int | None = None
    ) -> Tail | None:
        """The memory is mapped: from now on the thread finishes each graph as it builds it (and
        uploads it to the stream ``upload_to`` unless None), and ``load`` returns without waiting.
        None when the thread ended meanwhile (:meth:`take` it)."""
        with self._lock:
            if self._ended or self._rebuilding is None:
                return None
            self._taken = True
            self._rebuilding.handed = True
            tail = self._tail = Tail(self.archive, self._rebuilding, names, timings, upload_to)
            for name in list(self._rebuilding.graphs):  # built before the memory was mapped
                tail.finish(name)
            return tail

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def take(self) -> tuple[Archive | None, Rebuilding | None, BaseException | None]:
        """Wait; then the verified archive (None when the thread's verification refused it: the
        caller verifies it itself), the rebuild (None when it failed) and why it failed. Once only:
        the caller owns what it gets."""
        self.wait()
        if self._taken:
            raise RuntimeError("this prepared LOAD was already taken or discarded")
        self._taken = True
        if self._archive_error is not None:
            return None, None, self._archive_error
        result, self._result = self._result, None
        return self.archive, result, self._error

    def discard(self) -> None:
        """Wait, then unload what the thread built (a LOAD that will not happen)."""
        self.wait()
        self._taken = True
        if self._result is not None:
            self._result.discard()
            self._result = None


def prepare(
    path: str | os.PathLike,
    *,
    device: int = 0,
    archive: Archive | None = None,
    fingerprint_model: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
) -> Prepared:
    """Start rebuilding the archive at ``path`` (its modules and graphs) on a background thread.

    Call it once the archive is accepted and the region is reserved (the thread's own driver
    allocations, code and executable graphs, must not take the region's fixed addresses), before
    the engine's own setup; pass the result to :func:`foundry_core.load` as ``prepared=``. ``archive``:
    what :func:`~foundry_core.verify` returned for ``path``; without it the thread reads and verifies
    the archive first, as :func:`~foundry_core.verify` does with the same ``fingerprint_model``,
    ``rank``, ``world_size`` and ``expected_digest`` (give them as ``load`` will get them). The
    location under ``trusted_root`` is checked here, before the thread starts. Nothing is launched
    on the GPU.
    """
    if trusted_root is not None:
        check_location(path, trusted_root)
    if archive is not None and not isinstance(archive, Archive):
        raise ArchiveError(f"archive= takes what verify() returned, not {type(archive).__name__}")
    verify_args = {
        "fingerprint_model": fingerprint_model,
        "rank": rank,
        "world_size": world_size,
        "expected_digest": expected_digest,
        "trusted_root": trusted_root,
    }
    return Prepared(path, int(device), archive, verify_args)


def take_whole(prepared: Prepared, timings: dict[str, float], ready: bool):
    """Wait for a prepared rebuild and take it whole: the archive the thread verified and the
    rebuild. The archive is None when the thread's verification refused it (the caller verifies it
    with its own arguments, and refuses it there if it is bad); the rebuild is None when it failed
    (the caller rebuilds, with a warning)."""
    verified, rebuilding, failed = prepared.take()
    timings["prepared_s"] = prepared.seconds or 0.0
    timings["prepared_ready"] = float(ready)
    timings["prepared_ok"] = float(failed is None)  # 0: everything is rebuilt by the caller instead
    if failed is not None and verified is not None:
        warnings.warn(
            f"foundry: the background rebuild failed ({type(failed).__name__}: {failed}); "
            "rebuilding the graphs now",
            stacklevel=3,  # load's caller
        )
    return verified, rebuilding


def drop(rebuilding, building: Prepared | None, tail=None) -> None:
    """A refused or failed LOAD: unload what the background rebuild made (waiting for it)."""
    if building is not None:
        building.discard()
        if tail is not None:  # what it handed over, then the modules, which were handed over too
            for pending in tail.pending.values():
                if pending.rebuilt is not None:
                    pending.rebuilt.destroy()
            tail.rebuilding.modules.unload()
    elif rebuilding is not None:
        rebuilding.discard()
