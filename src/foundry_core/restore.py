"""The plan of a LOAD that overlaps the engine's setup: an archive rebuilt on a background thread.

Loading the kernels' modules, building each graph and instantiating it depend only on the verified
archive and the device's context, not on the memory the graphs' pointers name (:mod:`.rebuilding`
builds the memory nodes against a stand-in). :func:`foundry_core.prepare` therefore starts a
:class:`Prepared`: a thread that an engine starts once its archive is accepted and its region
reserved, so that it overlaps the engine's own setup (weights, KV cache). :func:`foundry_core.load`
with ``prepared=`` then maps the memory, restores its contents and takes the graphs; those the
thread is still building then are handed over as each is built (:mod:`.tail`), so ``load`` does not
wait for them. If the background rebuild failed as a whole for any reason other than the archive
itself, ``load`` rebuilds everything synchronously, as it does without ``prepared``. The graphs a
LOAD hands back are the same either way.

The LOAD path, top down: :mod:`.api` (``load``: checks, memory, the graphs taken) -> this module (the
background plan) -> :mod:`.rebuilding` (modules and graphs built) -> :mod:`.tail` (the hand-over of
graphs still being built when ``load`` returns).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable

from .archive import Archive
from .driver import call, cu
from .rebuilding import Rebuilding, rebuild_archive
from .tail import Tail


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

    def __init__(
        self,
        path: str | os.PathLike,
        device: int,
        archive: Archive | None,
        verify_args: dict,
        verify: Callable[..., Archive] | None = None,
    ):
        # ``verify``: what reads and verifies the archive on the thread when ``archive`` is None
        # (:func:`foundry_core.verify`, given by :func:`foundry_core.prepare`, which sits above).
        self.path, self.device = os.fspath(path), device
        self._verify = verify
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
                try:
                    self.archive = self._verify(self.path, device=self.device, **self._verify_args)
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
