"""What a LOAD hands back: the restored graphs, replayed like torch's, and the tensors over their memory.

:class:`Restored` holds the graphs (:class:`RestoredGraph`), the named tensors (:func:`tensor_at`,
over memory Foundry mapped), the engine's slots and the restore's timings, and unloads them all.
Apart from :mod:`.api` because it is the serving side of a LOAD: a replay runs on the serving
loop's host path, and nothing here checks or builds anything.
"""

from __future__ import annotations

import functools
import time

from .graph_build import Rebuilt
from .rebuilding import differences
from .region import Region, Segment


def _torch():
    import torch

    return torch


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class _DeviceSpan:
    """An owner of nothing: presents [addr, addr + nbytes) to torch.as_tensor."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


def tensor_at(addr: int, shape, stride, dtype, device: int):
    """A tensor over memory Foundry mapped (it does not own it: keep the Restored object alive)."""
    torch = _torch()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    item = torch.empty((), dtype=dtype, device="meta").element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    nbytes = max(extent, 1) * item
    flat = torch.as_tensor(_DeviceSpan(addr, nbytes), device=f"cuda:{device}")
    return flat.view(dtype).as_strided(tuple(shape), tuple(stride))


@functools.cache
def _current_stream_getter():
    """``device -> raw handle of its current stream``, as torch's own replay reads it: no Stream
    object per replay (replay is on the serving loop's host path)."""
    torch = _torch()
    return getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda device: torch.cuda.current_stream(device).cuda_stream
    )


class RestoredGraph:
    """A graph rebuilt from an archive; replays on the current torch stream like ``torch.cuda.CUDAGraph``."""

    def __init__(
        self, name: str, rebuilt: Rebuilt | None, device: int, rng: dict | None, nodes: int, pending=None
    ):
        self.name, self.device, self.nodes = name, device, nodes
        self._rebuilt = rebuilt
        # Still being rebuilt in the background when load() returned (restore.Pending): the first
        # replay waits for this graph; waited_s says how long it did.
        self._pending = pending
        self.waited_s = 0.0
        self._rng = rng
        self._current_stream = _current_stream_getter()
        if rng:
            self._seed = tensor_at(rng["seed_ptr"], (1,), (1,), "int64", device)
            self._offset = tensor_at(rng["offset_ptr"], (1,), (1,), "int64", device)

    def _take(self) -> Rebuilt:
        """The graph, waiting for it (or building it now) when it was handed over unfinished."""
        if self._rebuilt is None:
            t0 = time.perf_counter()
            self._rebuilt = self._pending.take()
            self.waited_s = time.perf_counter() - t0
        return self._rebuilt

    def replay(self) -> None:
        rebuilt = self._rebuilt or self._take()
        if self._rng:
            # What torch's own replay does before launching: publish seed and offset, then advance.
            gen = _torch().cuda.default_generators[self.device]
            offset = gen.get_offset()
            self._seed.fill_(_signed64(gen.initial_seed()))
            self._offset.fill_(offset)
            gen.set_offset(offset + self._rng["increment"])
            rebuilt.launch(self._current_stream(self.device))
            return
        # No random state (the engines' decode graphs): from now on ``replay`` is the launch alone,
        # an instance attribute over this method, so the serving loop's host path does what torch's
        # replay does and nothing more. _destroy removes it again.
        self.replay = rebuilt.launcher(self._current_stream, self.device)
        self.replay()

    def _destroy(self) -> None:
        self.__dict__.pop("replay", None)  # a replay after unload goes through the checks above
        rebuilt = self._rebuilt or (self._pending.rebuilt if self._pending is not None else None)
        if rebuilt is not None:
            rebuilt.destroy()

    def __repr__(self) -> str:
        return f"RestoredGraph({self.name!r}, nodes={self.nodes})"


class Restored:
    """What :func:`load` hands back: graphs, named tensors, engine slots, and timing."""

    def __init__(
        self, archive, region: Region, graphs, tensors, slots, mapped: list[Segment], modules, timings
    ):
        self.archive, self.region = archive, region
        self.graphs: dict[str, RestoredGraph] = graphs
        self.tensors: dict = tensors
        self.slots: dict = slots
        self.timings: dict[str, float] = timings
        self._builders: set[str] = set()  # the rebuild's, filled while a background rebuild builds
        self._background = None  # the prepared rebuild still finishing graphs after load() returned
        self._mapped, self._modules = mapped, modules

    @property
    def digest(self) -> str:
        return self.archive.digest

    @property
    def builder(self) -> str:
        """Which graph builder(s) rebuilt the graphs so far: native, python, native+python or none."""
        return "+".join(sorted(self._builders)) or "none"

    def wait_rebuilt(self) -> None:
        """Wait until every graph is rebuilt and ``timings`` is complete: with ``prepared=``, ``load``
        may return while the background thread still builds some (each replay waits for its own)."""
        if self._background is not None:
            self._background.wait()

    def check(self) -> dict[str, str]:
        """Read every graph back from the driver and compare it with the description the archive
        holds (:func:`foundry_core.graph_compare.compare`): node for node, edge for edge, with parameter
        bytes and memory addresses. Returns ``{graph name: first difference}``, empty when each
        graph is what SAVE saved. Takes about as long as SAVE's walk of the same graphs."""
        self.wait_rebuilt()
        return differences(self.archive, lambda name: self.graphs[name]._take().graph)

    def unload(self) -> None:
        """Destroy the graphs, unload their modules and unmap the memory they owned."""
        self.wait_rebuilt()
        _torch().cuda.synchronize(self.region.device)
        for g in self.graphs.values():
            g._destroy()
        self._modules.unload()
        self.region.unmap(self._mapped)
        self.graphs, self.tensors, self._mapped = {}, {}, []
