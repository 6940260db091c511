"""The part of a LOAD that needs no engine memory: an archive's code modules and graphs, rebuilt.

Loading the kernels' modules, building each graph and instantiating it depend only on the verified
archive and the device's context, not on the memory the graphs' pointers name: a kernel node holds
its parameters as bytes, and nothing is launched. :func:`prepare` therefore runs this work on a
background thread that an engine starts once its archive is accepted and its region reserved, so
that it overlaps the engine's own setup (weights, KV cache); :func:`foundry_core.load` with ``prepared=`` then maps the
memory, restores its contents and takes the graphs, waiting only for what is not done yet. A graph
the driver will not build before its memory is mapped (untested on every node kind: copy nodes
between addresses it has to resolve are the likely case) is left for ``load`` to build after the
mapping; if the background rebuild failed as a whole for any reason other than the archive itself,
``load`` rebuilds everything synchronously, as it does without ``prepared``. The graphs a LOAD hands
back are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings

from .archive import Archive, ArchiveError
from .driver import CudaError, call, cu
from .graph_build import NativeBuilder, builder_choice, rebuild
from .graph_codec import ENCODING, decode, encode, kernel_ids
from .graphs import GraphError, Rebuilt
from .modules import LoadedModules
from .progress import Progress
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

    def discard(self) -> None:
        for rebuilt, _rng, _nodes in self.graphs.values():
            rebuilt.destroy()
        self.modules.unload()
        self.graphs = {}


def rebuild_archive(
    archive: Archive, *, upload_to: int | None = None, progress: bool | None = None, ahead: bool = False
) -> Rebuilding:
    """Load every module of ``archive`` and rebuild every graph; on failure nothing stays loaded.

    ``ahead``: the graphs' memory is not mapped yet (:func:`prepare`). A graph the driver refuses
    to build or instantiate then (a copy node between addresses it cannot resolve yet, say) is left
    in ``deferred`` for :func:`finish_rebuild` instead of failing the rest.

    Adds to the timings: modules_s, graph_read_s (reading, and decoding or encoding where the stored
    form is not the one the builder takes), graph_build_s, graph_instantiate_s, graph_upload_s.
    """
    meta = archive.meta
    timings: dict[str, float] = {}
    modules = LoadedModules()
    graphs: dict[str, tuple[Rebuilt, dict | None, int]] = {}
    t0 = time.perf_counter()
    try:
        with Progress("foundry: loading modules", len(meta["images"]), progress) as bar:
            for digest in meta["images"]:
                modules.load(digest, archive.read_bytes(f"modules/{digest}.cubin"))
                bar.advance()
        for image, name, attrs in meta["kernels"]:
            modules.function(image, name, attrs)
        timings["modules_s"] = time.perf_counter() - t0
        deferred: dict[str, BaseException] | None = {} if ahead else None
        builders = _rebuild_graphs(archive, modules, upload_to, graphs, progress, timings, deferred=deferred)
    except BaseException:
        for rebuilt, _rng, _nodes in graphs.values():  # those rebuilt before the failure
            rebuilt.destroy()
        modules.unload()
        raise
    return Rebuilding(modules, graphs, builders, timings, deferred or {})


def finish_rebuild(
    archive: Archive, rebuilding: Rebuilding, *, upload_to: int | None = None, progress: bool | None = None
) -> int:
    """Rebuild the graphs :func:`rebuild_archive` deferred (their memory is mapped now), with the
    modules it loaded; returns how many. Raises as a rebuild at this point always did."""
    names = set(rebuilding.deferred)
    if not names:
        return 0
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    builders = _rebuild_graphs(
        archive, rebuilding.modules, upload_to, rebuilding.graphs, progress, timings, only=names
    )
    rebuilding.builders |= builders
    order = [e["name"] for e in archive.meta["graphs"]]  # the archive's order, as without deferral
    rebuilding.graphs = {n: rebuilding.graphs[n] for n in order if n in rebuilding.graphs}
    first = next(iter(rebuilding.deferred.values()))
    logger.info(
        "foundry: %d graphs rebuilt after their memory was mapped (ahead of it: %s)", len(names), first
    )
    rebuilding.deferred = {}
    rebuilding.timings.update(deferred_graphs=float(len(names)), deferred_s=time.perf_counter() - t0)
    return len(names)


def _rebuild_graphs(
    archive, modules, stream, graphs, progress, timings, *, only=None, deferred=None
) -> set[str]:
    """Rebuild the graphs of the archive (those named in ``only``, or all) into ``graphs``; returns
    the builders used ("native", "python"). With ``deferred`` (ahead of the memory), a graph the
    driver refuses is recorded there, and the others go on with the same builder."""
    meta = archive.meta
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
    used: set[str] = set()
    entries = [e for e in meta["graphs"] if only is None or e["name"] in only]
    with Progress("foundry: rebuilding graphs", len(entries), progress) as bar:
        for entry in entries:
            r0 = time.perf_counter()
            encoding = entry.get("encoding")
            data = desc = None
            if encoding == ENCODING:
                data, rng = archive.read_bytes(entry["file"]), entry.get("rng_state")
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
                    rebuilt = native.rebuild(data, stream, split)
                    used.add("native")
                except GraphError as e:
                    if deferred is not None:  # ahead of the memory: retried once it is mapped
                        deferred[entry["name"]] = e
                        bar.advance()
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
                    if deferred is None:
                        raise
                    deferred[entry["name"]] = e  # ahead of the memory: retried once it is mapped
                    bar.advance()
                    continue
                used.add("python")
            graphs[entry["name"]] = (rebuilt, rng, entry["nodes"])
            bar.advance()
    timings["graph_read_s"] = read_s
    for key in ("build_s", "instantiate_s", "upload_s"):
        timings[f"graph_{key}"] = split.get(key, 0.0)
    return used


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
            self._result = rebuild_archive(self.archive, progress=False, ahead=True)
        except BaseException as e:  # load() rebuilds synchronously instead, and says why
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0

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
