"""A device-memory region at a fixed virtual address, through which PyTorch allocates.

Every buffer a captured graph touches (weights, static inputs and outputs, graph-pool
intermediates, library workspaces) must sit at the same address when the graph is rebuilt in
another process. The region makes that so without replaying warmups: torch's caching allocator
gets its segments from the native allocator (native/region.c), which places them back to back
from a fixed base and never reuses an address. Two processes that allocate the same sequence of
segments therefore see the same addresses, and a LOAD can prove it by comparing segment logs.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import warnings

from . import _native
from .errors import FoundryError

_labels: list[str] = ["unlabelled"]
_label_lock = threading.Lock()
RESTORED_LABEL = "restored"


class RegionError(FoundryError, RuntimeError):
    """The region could not be set up or used; the message says why in one line."""


class PlacementError(RegionError):
    """A LOAD's allocations do not retrace the SAVE's, so recorded addresses cannot be trusted."""


KINDS = ("eager", "graph", "restored")
SNAPSHOT_CHUNK = 64 << 10


@dataclasses.dataclass(frozen=True)
class Segment:
    index: int
    addr: int
    size: int
    live: bool
    label: str
    kind: str = "eager"  # which pool asked for it: eager (routing), graph (capture), restored (LOAD)

    @property
    def end(self) -> int:
        return self.addr + self.size

    def to_json(self) -> list:
        return [self.addr, self.size, int(self.live), self.label, self.kind]

    @classmethod
    def from_json(cls, index: int, row: list) -> Segment:
        addr, size, live, label, kind = row
        return cls(index, int(addr), int(size), bool(live), str(label), str(kind))


def _label_index(name: str) -> int:
    with _label_lock:
        if name not in _labels:
            _labels.append(name)
        return _labels.index(name)


class Region:
    """A fixed-address virtual region on one device, and the torch memory pools drawing from it.

    ``base`` must be free in this process's address space (the default, 0x600000000000, lies far
    above what the CUDA driver hands out by itself); construction fails loudly if the driver does
    not honour it. Only virtual space is reserved: physical memory is mapped per segment.
    """

    def __init__(self, base: int, size: int, device: int = 0):
        import torch

        if not torch.cuda.is_available():
            raise RegionError("no CUDA device is available: a Foundry region needs an NVIDIA GPU")
        self.base = int(base)
        self.size = int(size)
        self.device = int(device)
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # makes the primary context current on this thread
        lib = _native.lib()
        rc = lib.foundry_region_reserve(self.device, self.base, self.size)
        if rc != 0:
            raise RegionError(
                f"cannot reserve the Foundry region at {self.base:#x} (+{self.size} bytes) on "
                f"cuda:{self.device}: {_native.region_error()}"
            )
        path = _native.library_path()
        eager = torch.cuda.memory.CUDAPluggableAllocator(path, "foundry_alloc", "foundry_free")
        graph = torch.cuda.memory.CUDAPluggableAllocator(path, "foundry_alloc_graph", "foundry_free")
        self._allocators = (eager, graph)
        # Two pools: torch refuses to capture into a pool that eager code is allocating from, and
        # keeping graph memory apart means eager frees never hand graph scratch to other tensors.
        self.pool = torch.cuda.MemPool(eager.allocator())
        self.graph_pool = torch.cuda.MemPool(graph.allocator())
        self.setup_segments: int | None = None
        self._before_restore: tuple[int, int] | None = None  # (log length, cursor) before a LOAD mapped
        self._routed = threading.local()  # per thread: how deep inside routing() it is

    def __repr__(self) -> str:
        return f"Region(base={self.base:#x}, size={self.size}, device={self.device})"

    def contains(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.size

    @contextlib.contextmanager
    def routing(self):
        """Allocations made by this thread inside the block come from the region. Blocks nest: an
        inner one inside an outer one of the same thread adds nothing (torch refuses to begin
        allocating to a pool the thread already allocates to; an engine plugin routes its whole
        setup, and placing symmetric memory inside that setup routes again)."""
        import torch

        depth = getattr(self._routed, "depth", 0)
        with contextlib.ExitStack() as stack:
            if not depth:
                stack.enter_context(torch.cuda.device(self.device))
                stack.enter_context(torch.cuda.use_mem_pool(self.pool, self.device))
            self._routed.depth = depth + 1
            try:
                yield self
            finally:
                self._routed.depth = depth

    def graph_pool_id(self) -> tuple[int, int]:
        """Pass as ``pool=`` to ``torch.cuda.graph`` so capture allocations come from the region."""
        return self.graph_pool.id

    @contextlib.contextmanager
    def label(self, name: str):
        """Tag the segments allocated inside the block; LOAD names divergences by these labels."""
        lib = _native.lib()
        new = _label_index(name)
        previous = _current_label[0]
        lib.foundry_region_set_label(new)
        _current_label[0] = new
        try:
            yield
        finally:
            lib.foundry_region_set_label(previous)
            _current_label[0] = previous

    def end_setup(self) -> None:
        """Mark the end of the setup a LOAD repeats (model, caches, static buffers).

        Call it at SAVE right before warmup and capture. A LOAD must then have made exactly as
        many segments when it restores, and the contents of eager segments created after this
        point (state that warmups create lazily, library workspaces) are saved with the archive.
        """
        self.setup_segments = len(self.segments())

    @property
    def cursor(self) -> int:
        """Offset from the base at which the next segment will be placed."""
        return int(_native.lib().foundry_region_cursor(self.device))

    def segments(self) -> list[Segment]:
        lib = _native.lib()
        n = int(lib.foundry_region_log_len(self.device))
        addr = (ctypes.c_uint64 * max(n, 1))()
        size = (ctypes.c_uint64 * max(n, 1))()
        live = (ctypes.c_int32 * max(n, 1))()
        label = (ctypes.c_int32 * max(n, 1))()
        kind = (ctypes.c_int32 * max(n, 1))()
        got = int(lib.foundry_region_log_read(self.device, 0, n, addr, size, live, label, kind))
        with _label_lock:
            names = list(_labels)
        return [
            Segment(
                i,
                int(addr[i]),
                int(size[i]),
                bool(live[i]),
                names[label[i]] if label[i] < len(names) else "?",
                KINDS[kind[i]],
            )
            for i in range(got)
        ]

    def layout(self) -> dict:
        """The placement record an archive keeps."""
        return {
            "base": self.base,
            "size": self.size,
            "device": self.device,
            "cursor": self.cursor,
            "setup_segments": self.setup_segments,
            "segments": [s.to_json() for s in self.segments()],
        }

    def snapshot_candidates(self) -> list[tuple[Segment, list[tuple[int, int]]]]:
        """Eager segments made after setup and still live, with the byte ranges torch has in use.

        Their in-use contents (state created lazily during warmup, library workspaces) travel with
        the archive; blocks the caching allocator merely keeps cached are left out.
        """
        if self.setup_segments is None:
            raise RegionError("call region.end_setup() after building the model and before warmup/capture")
        segs = [s for s in self.segments()[self.setup_segments :] if s.live and s.kind == "eager"]
        if not segs:
            return []
        active = _active_blocks(self.device)
        out = []
        for seg in segs:
            ranges = [
                (a - seg.addr, min(a + n, seg.end) - seg.addr) for a, n in active if seg.addr <= a < seg.end
            ]
            if ranges:
                out.append((seg, ranges))
        return out

    def restore_layout(self, layout: dict) -> list[Segment]:
        """Check that this process's segments retrace the saved ones, then map the rest.

        The segments allocated so far in this process (model weights, KV cache, static buffers,
        built exactly as at SAVE) must be a prefix of the saved log: same addresses, same sizes,
        same labels. Saved segments past that prefix that were live at SAVE (graph pools,
        workspaces) are mapped at their recorded addresses and zero-filled. Returns those.
        """
        if layout["base"] != self.base or layout["size"] != self.size:
            raise PlacementError(
                f"archive was saved with region base {layout['base']:#x} (+{layout['size']} bytes), "
                f"this region is {self.base:#x} (+{self.size} bytes): use the same [region] settings"
            )
        saved = [Segment.from_json(i, row) for i, row in enumerate(layout["segments"])]
        current = self.segments()
        setup = layout.get("setup_segments")
        if setup is not None and len(current) != setup:
            raise PlacementError(
                f"this process made {len(current)} allocations before restoring, the SAVE's setup made {setup}: "
                "build the model, caches and static buffers exactly as at SAVE, and nothing else, before load()"
            )
        for seg in current:
            if seg.index >= len(saved):
                raise PlacementError(
                    f"allocation #{seg.index} ({seg.size} bytes, label {seg.label!r}) has no counterpart at "
                    f"SAVE, which made only {len(saved)}: LOAD allocated more before restoring than SAVE did"
                )
            ref = saved[seg.index]
            if (seg.addr, seg.size, seg.label) != (ref.addr, ref.size, ref.label):
                raise PlacementError(
                    f"allocation #{seg.index} diverged: LOAD placed {seg.size} bytes ({seg.label!r}) at "
                    f"{seg.addr:#x}, SAVE placed {ref.size} bytes ({ref.label!r}) at {ref.addr:#x}"
                )
            if ref.live and not seg.live:
                raise PlacementError(
                    f"allocation #{seg.index} ({ref.label!r}, {ref.size} bytes at {ref.addr:#x}) was live at "
                    f"SAVE but has been freed in this process"
                )
        lib = _native.lib()
        label = _label_index(RESTORED_LABEL)
        mapped = []
        self._before_restore = (len(current), self.cursor)
        try:
            for ref in saved[len(current) :]:
                if not ref.live:
                    continue
                if lib.foundry_region_map(self.device, ref.addr, ref.size, label) != 0:
                    raise RegionError(f"cannot map saved segment #{ref.index}: {_native.region_error()}")
                mapped.append(ref)
            if lib.foundry_region_advance(self.device, int(layout["cursor"])) != 0:
                raise RegionError(f"cannot move the region cursor to the SAVE's end ({layout['cursor']:#x})")
        except BaseException:
            self.unmap(mapped)
            raise
        _zero_fill(mapped)
        return mapped

    def unmap(self, segments: list[Segment]) -> None:
        """Release restored segments and, when nothing else was allocated after them, rewind the
        region to where it stood before :meth:`restore_layout`, so the archive can be loaded again."""
        lib = _native.lib()
        for seg in segments:
            lib.foundry_region_unmap(self.device, seg.addr)
        before, self._before_restore = self._before_restore, None
        if before is not None and lib.foundry_region_rewind(self.device, *before) != 0:
            # Something allocated in the region after the restore and still holds its memory:
            # the region cannot retrace the SAVE again in this process, and a later load() says so.
            warnings.warn(
                f"Foundry region not rewound after unload: {_native.region_error()}",
                RuntimeWarning,
                stacklevel=3,
            )


_current_label = [0]


def _zero_fill(segments: list[Segment]) -> None:
    """Freshly mapped memory has no defined content; make it the same in every process."""
    from .driver import call, cu

    for seg in segments:
        call(cu().cuMemsetD8, seg.addr, 0, seg.size)


def _active_blocks(device: int) -> list[tuple[int, int]]:
    """(address, size) of every block torch's caching allocator has handed out and not taken back."""
    import torch

    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch releases without the keyword
        segments = torch.cuda.memory_snapshot()
    return [
        (int(b["address"]), int(b["size"]))
        for seg in segments
        if seg.get("device", device) == device
        for b in seg["blocks"]
        if b["state"] != "inactive"
    ]


def snapshot(seg: Segment, ranges: list[tuple[int, int]]) -> tuple[list[int], bytes]:
    """The non-zero 64 KiB chunks of a segment that overlap ``ranges`` (offsets into it).

    Returns (chunk indices, their bytes concatenated).
    """
    import torch

    from .driver import call, cu

    host = torch.empty(seg.size, dtype=torch.uint8).pin_memory()
    call(cu().cuMemcpyDtoH, host.data_ptr(), seg.addr, seg.size)
    wanted = torch.zeros(seg.size // SNAPSHOT_CHUNK, dtype=torch.bool)
    for start, end in ranges:
        wanted[start // SNAPSHOT_CHUNK : (end + SNAPSHOT_CHUNK - 1) // SNAPSHOT_CHUNK] = True
    chunks = host.view(torch.int64).view(-1, SNAPSHOT_CHUNK // 8)
    keep = (chunks.ne(0).any(dim=1) & wanted).nonzero().flatten().tolist()
    data = host.view(-1, SNAPSHOT_CHUNK)[keep].numpy().tobytes() if keep else b""
    return keep, data


def restore_snapshot(seg: Segment, chunks: list[int], data: bytes) -> None:
    """Write back what :func:`snapshot` kept (after the segment was mapped and zero-filled)."""
    from .driver import call, cu

    if len(data) != len(chunks) * SNAPSHOT_CHUNK or any(
        not 0 <= c < seg.size // SNAPSHOT_CHUNK for c in chunks
    ):
        raise RegionError(f"memory snapshot of segment #{seg.index} does not fit it")
    buf = ctypes.create_string_buffer(data, len(data)) if data else None
    base = ctypes.addressof(buf) if buf is not None else 0
    i = 0
    while i < len(chunks):  # one copy per run of consecutive chunks
        j = i
        while j + 1 < len(chunks) and chunks[j + 1] == chunks[j] + 1:
            j += 1
        n = (j - i + 1) * SNAPSHOT_CHUNK
        call(cu().cuMemcpyHtoD, seg.addr + chunks[i] * SNAPSHOT_CHUNK, base + i * SNAPSHOT_CHUNK, n)
        i = j + 1
