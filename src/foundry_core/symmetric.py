"""Torch symmetric memory that a tensor-parallel decode graph addresses: recorded at SAVE, checked at LOAD.

A decode graph whose all-reduce runs through ``torch.ops.symm_mem`` holds addresses outside the
Foundry region: the local symmetric buffer (copy nodes into and out of it), the device-side arrays
of every rank's buffer and signal-pad addresses (kernel parameters) and, through those arrays, the
peers' buffers mapped into this process. Torch's symmetric-memory allocator reserves each mapping
with no address hint, so the driver chooses, and a fresh process gets another base (one H200,
2026-12-03: benchmarks/results/tp-h200x1-3fe662f-refused.json).

:func:`placed` makes them repeat: symmetric memory allocated and rendezvoused inside it has its
mappings at fixed addresses, in a window past the region that Foundry reserves at a fixed base
(native/symmetric.c steers torch's own ``cuMemAddressReserve`` entry, which it checks first, to
hand out the window's sub-ranges), and its address arrays allocated in the region. The same setup
in SAVE and LOAD then maps everything where SAVE did.

What is recorded per symmetric buffer: the rank and world size, the buffer and signal-pad sizes,
every rank's buffer and signal-pad address as mapped here, the multicast address (0 without one)
and the two device-side pointer arrays. The pointer audit of a SAVE accepts pointers into exactly
these ranges (:meth:`SymmetricBuffer.ranges`); a pointer anywhere else outside the region is still
refused, and a LOAD whose record differs is refused before any graph is built (fail closed).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterable, Sequence

from . import _native
from .driver import CudaError, call, cu
from .errors import FoundryError

POINTER_BYTES = 8
WINDOW_ALIGN = 1 << 30  # the window starts on a 1 GiB boundary past the region's end ...
WINDOW_GAP = 1 << 30  # ... and one GiB further, so that the two reservations do not adjoin
WINDOW_SIZE = 64 << 30
PLACEMENT_ALIGN = 512 << 20  # per mapping: at least any multicast granularity the driver asks for
#: Where torch's table of driver entry points is (``c10::cuda::DriverAPI::get()``), and how many of
#: its first entries may be searched for ``cuMemAddressReserve`` (torch 2.11 keeps it third).
DRIVER_API_GETTER = "_ZN3c104cuda9DriverAPI3getEv"
DRIVER_API_SEARCH = 16


class SymmetricMismatch(FoundryError, RuntimeError):
    """This process's symmetric memory is not where the archive's graphs expect it."""


class SymmetricPlacementError(FoundryError, RuntimeError):
    """Torch's symmetric memory could not be placed at fixed addresses (the reason in one line)."""


@dataclasses.dataclass(frozen=True)
class SymmetricBuffer:
    """One rendezvoused symmetric-memory buffer, as this rank maps it."""

    name: str
    rank: int
    world_size: int
    buffer_size: int
    signal_pad_size: int
    buffer_ptrs: tuple[int, ...]
    signal_pad_ptrs: tuple[int, ...]
    buffer_ptrs_dev: int
    signal_pad_ptrs_dev: int
    multicast_ptr: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"symmetric buffer {self.name!r}: rank {self.rank} outside world size {self.world_size}"
            )
        if len(self.buffer_ptrs) != self.world_size or len(self.signal_pad_ptrs) != self.world_size:
            raise ValueError(
                f"symmetric buffer {self.name!r}: one buffer and one signal pad per rank expected"
            )

    @classmethod
    def of(cls, handle, name: str) -> SymmetricBuffer:
        """The record of ``handle``, a ``torch.distributed._symmetric_memory.rendezvous`` result."""
        return cls(
            name=name,
            rank=int(handle.rank),
            world_size=int(handle.world_size),
            buffer_size=int(handle.buffer_size),
            signal_pad_size=int(handle.signal_pad_size),
            buffer_ptrs=tuple(int(p) for p in handle.buffer_ptrs),
            signal_pad_ptrs=tuple(int(p) for p in handle.signal_pad_ptrs),
            buffer_ptrs_dev=int(handle.buffer_ptrs_dev),
            signal_pad_ptrs_dev=int(handle.signal_pad_ptrs_dev),
            multicast_ptr=int(handle.multicast_ptr or 0),
        )

    def ranges(self) -> list[tuple[int, int, str]]:
        """(start, size, what) of every range a graph may address through this buffer."""
        out = []
        for r in range(self.world_size):
            who = "local" if r == self.rank else f"peer {r}"
            out.append((self.buffer_ptrs[r], self.buffer_size, f"{self.name}: {who} buffer"))
            out.append((self.signal_pad_ptrs[r], self.signal_pad_size, f"{self.name}: {who} signal pad"))
        if self.multicast_ptr:
            out.append((self.multicast_ptr, self.buffer_size, f"{self.name}: multicast"))
        table = POINTER_BYTES * self.world_size
        out.append((self.buffer_ptrs_dev, table, f"{self.name}: buffer address array"))
        out.append((self.signal_pad_ptrs_dev, table, f"{self.name}: signal-pad address array"))
        return out

    def to_json(self) -> dict:
        return {
            f.name: list(getattr(self, f.name)) if f.name.endswith("_ptrs") else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_json(cls, row: dict) -> SymmetricBuffer:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(row) != names:
            raise ValueError(f"symmetric buffer record has fields {sorted(row)}, expected {sorted(names)}")
        return cls(**{k: tuple(int(p) for p in v) if k.endswith("_ptrs") else v for k, v in row.items()})


def differences(saved: SymmetricBuffer, here: SymmetricBuffer) -> list[str]:
    """What differs between SAVE's record of a buffer and this process's, as short phrases."""
    out = []
    for f in dataclasses.fields(SymmetricBuffer):
        a, b = getattr(saved, f.name), getattr(here, f.name)
        if a == b:
            continue
        if f.name.endswith("_ptrs"):
            rank = next(r for r, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else None
            if rank is not None:
                out.append(f"{f.name}[{rank}] {b[rank]:#x} (SAVE: {a[rank]:#x})")
                continue
        shown = (f"{b:#x}", f"{a:#x}") if f.name.endswith(("_dev", "_ptr")) else (repr(b), repr(a))
        out.append(f"{f.name} {shown[0]} (SAVE: {shown[1]})")
    return out


def check(saved: Sequence[SymmetricBuffer], here: Sequence[SymmetricBuffer]) -> None:
    """Raises :class:`SymmetricMismatch` unless ``here`` maps every buffer SAVE recorded, by name,
    exactly as SAVE did."""
    got = {b.name: b for b in here}
    for rec in saved:
        cur = got.pop(rec.name, None)
        if cur is None:
            raise SymmetricMismatch(
                f"the archive's graphs address torch symmetric memory {rec.name!r} "
                f"({rec.buffer_size} bytes, rank {rec.rank} of {rec.world_size}); allocate and rendezvous it "
                "as at SAVE before loading"
            )
        diff = differences(rec, cur)
        if diff:
            raise SymmetricMismatch(
                f"torch symmetric memory {rec.name!r} is not where the archive's graphs expect it: "
                f"{'; '.join(diff[:3])}; SAVE again on this setup"
            )
    if got:
        raise SymmetricMismatch(
            f"symmetric memory {sorted(got)} was given, but the archive's graphs address none of that name"
        )


def ranges(buffers: Iterable[SymmetricBuffer]) -> list[tuple[int, int, str]]:
    """Every range of ``buffers``, sorted by address; overlapping ranges are refused (ValueError):
    a record that overlaps itself or another is not a mapping torch made."""
    out = sorted(r for b in buffers for r in b.ranges())
    for (a, n, what), (b, _m, other) in zip(out, out[1:]):
        if b < a + n:
            raise ValueError(f"symmetric memory ranges overlap: {what} and {other}")
    return out


def require_idle(buffers: Iterable[SymmetricBuffer]) -> None:
    """Raises :class:`SymmetricMismatch` unless every local signal pad reads all zero. Torch's
    symmetric-memory kernels leave a pad at zero once no collective is in flight and spin without a
    timeout on a slot they expect to change: a graph replayed over a pad that is not clear would hang
    its rank or its peer instead of failing. Read with a device-to-host copy (no kernel)."""
    for b in buffers:
        pad = (ctypes.c_ubyte * b.signal_pad_size)()
        call(cu().cuMemcpyDtoH, ctypes.addressof(pad), b.signal_pad_ptrs[b.rank], b.signal_pad_size)
        if any(pad):
            raise SymmetricMismatch(
                f"torch symmetric memory {b.name!r}: rank {b.rank}'s signal pad is not clear (a collective "
                "is in flight); load before the first collective, or after every rank has finished it"
            )


def window(region) -> tuple[int, int]:
    """(base, size) of the window the symmetric memory of ``region``'s device is placed in."""
    base = -(-(region.base + region.size) // WINDOW_ALIGN) * WINDOW_ALIGN + WINDOW_GAP
    return base, WINDOW_SIZE


#: device -> (base, size) of the window this process reserved there (once; it is never freed, as
#: torch never frees the mappings placed in it).
_reserved_windows: dict[int, tuple[int, int]] = {}


def _driver_reserve(size: int, base: int) -> int:
    # Alignment 0 (the driver's own), as in the probe where the driver honoured the address.
    return int(call(cu().cuMemAddressReserve, size, 0, base, 0))


def _driver_free(addr: int, size: int) -> None:
    call(cu().cuMemAddressFree, addr, size)


def reserve_window(device: int, base: int, size: int) -> None:
    """Reserve ``device``'s window at exactly ``base`` (a no-op when this process did already).

    The window is reserved whole because the driver does not honour an address hint for torch's
    own small reservations: on one H200 (2026-12-03) 8 MiB requests got a driver-chosen address at
    every hint tried, near the region or far from it, while a 1 GiB one got its hint."""
    if device in _reserved_windows:
        if _reserved_windows[device] != (base, size):
            had = _reserved_windows[device]
            raise SymmetricPlacementError(
                f"device {device} already has a symmetric-memory window at {had[0]:#x} (+{had[1]} bytes)"
            )
        return
    try:
        got = _driver_reserve(size, base)
    except CudaError as e:
        raise SymmetricPlacementError(
            f"cannot reserve the symmetric-memory window at {base:#x}: {e}"
        ) from None
    if got != base:
        _driver_free(got, size)
        raise SymmetricPlacementError(
            f"the driver placed the symmetric-memory window at {got:#x} instead of {base:#x} "
            "(address range in use?)"
        )
    _reserved_windows[device] = (base, size)


def find_reserve_slot(table: int, entry_points: Iterable[int], search: int = DRIVER_API_SEARCH) -> int:
    """The address of the one entry among the first ``search`` pointers at ``table`` that holds one of
    ``entry_points`` (the driver's ``cuMemAddressReserve``); raises :class:`SymmetricPlacementError`
    when there is none or more than one: an unknown table layout is not written to."""
    wanted = {int(p) for p in entry_points if p}
    hits = [
        table + i * POINTER_BYTES
        for i in range(search)
        if (ctypes.c_void_p.from_address(table + i * POINTER_BYTES).value or 0) in wanted
    ]
    if len(hits) != 1:
        raise SymmetricPlacementError(
            f"torch's driver entry-point table has {len(hits)} cuMemAddressReserve entries among its first "
            f"{search} (expected one): unrecognised torch layout, symmetric memory cannot be placed"
        )
    return hits[0]


def _reserve_entry_points() -> list[int]:
    """Every address the driver may hand out for ``cuMemAddressReserve``: its exported symbol and what
    ``cuGetProcAddress`` gives (which torch's table is filled from)."""
    found = [ctypes.cast(ctypes.CDLL("libcuda.so.1").cuMemAddressReserve, ctypes.c_void_p).value or 0]
    for version in (12000, 13000):  # torch asks for 12000; a driver older than 13 refuses 13000
        result = cu().cuGetProcAddress(b"cuMemAddressReserve", version, 0)  # (err, pfn[, status])
        if int(result[0]) == 0:
            found.append(int(result[1]))
    return found


def driver_table_getter():
    """torch's ``c10::cuda::DriverAPI::get`` (ctypes, returning the table's address); raises
    :class:`SymmetricPlacementError` where this torch has no such export (a CPU build, a rename)."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so")
    try:  # the copy torch loaded (RTLD_NOLOAD): a second copy would have a table of its own
        getter = getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), DRIVER_API_GETTER)
    except (OSError, AttributeError) as e:
        raise SymmetricPlacementError(
            f"cannot find torch's driver entry-point table ({DRIVER_API_GETTER} in {path}): {e}"
        ) from None
    getter.restype = ctypes.c_void_p
    return getter


def _torch_reserve_slot() -> int:
    return find_reserve_slot(int(driver_table_getter()()), _reserve_entry_points())


@contextlib.contextmanager
def placed(region):
    """Torch symmetric memory that this thread allocates and rendezvouses inside the block is mapped
    at fixed addresses: every mapping torch reserves (local buffer, each peer's, multicast) at the
    next aligned address of a window past ``region`` (reserved here once per device), and the
    device-side address arrays in the region (the block routes through it). Two processes that do
    the same inside it get the same addresses. Raises :class:`SymmetricPlacementError` when torch's
    table is not recognised, when the window cannot be reserved at its base, or when a mapping did
    not fit in it (torch still got one elsewhere: do not save then).

    Yields a list that holds, once the block is over, the (address, size) of every mapping placed
    in it: empty after an allocation means torch reserved it some other way (check it)."""
    lib = _native.lib()
    base, size = window(region)
    reserve_window(region.device, base, size)
    if lib.foundry_symm_window(region.device, base, size, PLACEMENT_ALIGN) != 0:
        raise SymmetricPlacementError(_error())
    if lib.foundry_symm_hook_install(_torch_reserve_slot()) != 0:
        raise SymmetricPlacementError(_error())
    before = len(placements(region.device))
    mapped: list[tuple[int, int]] = []
    lib.foundry_symm_arm(region.device)
    try:
        with region.routing():
            yield mapped
    finally:
        lib.foundry_symm_arm(-1)
        removed = lib.foundry_symm_hook_remove() == 0
        mapped.extend(placements(region.device)[before:])
    if not removed:
        raise SymmetricPlacementError(_error())
    if lib.foundry_symm_misplaced(region.device):
        raise SymmetricPlacementError(_error())


def placements(device: int) -> list[tuple[int, int]]:
    """(address, size) of every mapping :func:`placed` put in ``device``'s window, in order."""
    lib = _native.lib()
    n = 256
    addr, size = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
    got = int(lib.foundry_symm_placed(device, n, addr, size))
    return [(int(addr[i]), int(size[i])) for i in range(got)]


def _error() -> str:
    return (_native.lib().foundry_symm_error() or b"").decode(errors="replace")
