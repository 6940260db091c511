"""The graphs of a background rebuild that a LOAD hands over after it returned.

:func:`foundry_core.load` with ``prepared=`` maps the memory and returns; when the background thread
(:class:`foundry_core.restore.Prepared`) is still building graphs then, :class:`Tail` lets it finish
each one as it is built and publish it to its :class:`Pending`, and a graph's first replay waits for
that graph alone. Apart from :mod:`.restore` because it is the LOAD's side of the hand-over (what
replays wait on), not the plan; what is still to build, it builds through the
:class:`~.rebuilding.Rebuilding` it was handed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .driver import CudaError
from .graph_build import Rebuilt

if TYPE_CHECKING:
    from .archive import Archive

logger = logging.getLogger("foundry.restore")


class Pending:
    """A graph that a :class:`Tail` completes after ``load`` returned; its first replay waits for it."""

    def __init__(self, tail: Tail, name: str):
        self._tail, self.name = tail, name
        self._ready = threading.Event()
        self.rebuilt: Rebuilt | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._ready.is_set()

    def publish(self, rebuilt: Rebuilt) -> None:
        self.rebuilt = rebuilt
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._ready.set()

    def take(self) -> Rebuilt:
        """Wait for the graph; one the background rebuild could not finish is built here, now (its
        memory is mapped), and raises as a rebuild does when even that fails."""
        self._ready.wait()
        if self.rebuilt is None:
            logger.warning(
                "foundry: graph %r rebuilt at its first replay (in the background: %s)", self.name, self.error
            )
            self.rebuilt = self._tail.build_now(self.name)
        return self.rebuilt


class Tail:
    """The graphs a prepared rebuild had not finished when ``load`` had mapped the memory.

    So that ``load`` need not wait for them, the background thread completes each one as it is built
    (re-points its memory nodes, which are mapped now) and publishes it to its :class:`Pending`, in
    the archive's order; the graphs the driver would not build ahead are built last, the same way.
    A replay of a graph that is not published yet waits for that graph alone. Every method but
    :meth:`build_now` runs under the :class:`Prepared`'s lock.
    """

    def __init__(
        self,
        archive: Archive,
        rebuilding,  # the rebuilding.Rebuilding handed over; not imported: the hand-over sits below the build
        names: list[str],
        timings: dict[str, float],
        upload_to: int | None = None,
    ):
        self.archive, self.rebuilding, self.timings = archive, rebuilding, timings
        self.pending = {name: Pending(self, name) for name in names}
        self._t0 = time.perf_counter()
        self._retargeted = 0
        # load(upload=True): each graph is uploaded to the LOAD's stream as it is handed over
        self._upload_to = upload_to
        self._upload_s = 0.0

    def finish(self, name: str) -> None:
        """Re-point graph ``name``, built, and hand it over (a refused one is built again at the end)."""
        pending = self.pending.get(name)
        if pending is None or pending.done or name not in self.rebuilding.graphs:
            return
        repointed = self.rebuilding.repoint(name)
        if repointed is False:
            return
        self._retargeted += bool(repointed)
        rebuilt = self.rebuilding.graphs.pop(name)[0]  # the LOAD's now, no longer the rebuild's to discard
        if self._upload_to is not None:
            t0 = time.perf_counter()
            try:
                rebuilt.upload(self._upload_to)
            except CudaError as e:  # optional: its first launch uploads it instead
                logger.warning("foundry: graph %r not uploaded ahead of its first replay (%s)", name, e)
            self._upload_s += time.perf_counter() - t0
        pending.publish(rebuilt)

    def finish_rest(self) -> None:
        """Once the thread built every graph it could: hand over the rest, then build the graphs the
        driver would not build ahead (the memory is mapped now) and hand those over."""
        self._finish_built()
        self.rebuilding._free_standin()
        deferred = set(self.rebuilding.deferred)
        if deferred:
            self.rebuilding.deferred = {}
            error = None
            try:
                self.rebuilding.build(self.archive, deferred)
            except BaseException as e:  # those not built are built at their first replay
                error = e
            self._finish_built()
            if error is not None:
                self.fail_rest(error)
            self.timings["deferred_graphs"] = float(len(deferred))
        self.timings.update({f"background_{k}": v for k, v in self.rebuilding.timings.items()})
        self.timings["background_graph_upload_s"] = self._upload_s
        self.timings["retargeted_graphs"] = float(self._retargeted)
        self.timings["tail_s"] = time.perf_counter() - self._t0

    def _finish_built(self) -> None:
        """Hand over every graph built so far that is not handed over yet."""
        for name in list(self.rebuilding.graphs):
            self.finish(name)

    def fail_rest(self, error: BaseException) -> None:
        """The thread failed: every graph not handed over is built at its first replay instead."""
        self.timings["prepared_ok"] = 0.0
        for pending in self.pending.values():
            if not pending.done:
                pending.fail(error)

    def build_now(self, name: str) -> Rebuilt:
        return self.rebuilding.build_alone(self.archive, name)
