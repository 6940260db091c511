"""Torch symmetric memory recorded with an archive (symmetric.py): the record, the LOAD check, the
SAVE's pointer audit and the placement (native/symmetric.c on a stand-in table of entry points), on
the CPU. A real rendezvous needs a GPU: tests/gpu/test_symmetric_placement.py and
tests/gpu/test_tensor_parallel.py."""

import contextlib
import ctypes
import struct
import types

import pytest

from foundry_core import _native, graphs, symmetric
from foundry_core.archive import ArchiveError
from foundry_core.driver import CudaError
from foundry_core.symmetric import SymmetricBuffer, SymmetricMismatch

BASE = 0x600000000000
PEER0, PEER1 = 0x7F0000000000, 0x7F0040000000


def _buffer(**changes) -> SymmetricBuffer:
    fields = dict(
        name="tp",
        rank=0,
        world_size=2,
        buffer_size=64 << 20,
        signal_pad_size=9216,
        buffer_ptrs=(PEER0, PEER1),
        signal_pad_ptrs=(PEER0 + (64 << 20), PEER1 + (64 << 20)),
        buffer_ptrs_dev=BASE + 0x1000,
        signal_pad_ptrs_dev=BASE + 0x1200,
    )
    fields.update(changes)
    return SymmetricBuffer(**fields)


def test_the_record_survives_json():
    buf = _buffer(multicast_ptr=0x7E0000000000)
    row = buf.to_json()
    assert row["buffer_ptrs"] == [PEER0, PEER1]
    assert SymmetricBuffer.from_json(row) == buf


def test_a_damaged_record_is_refused():
    row = _buffer().to_json()
    del row["multicast_ptr"]
    with pytest.raises(ValueError, match="expected"):
        SymmetricBuffer.from_json(row)
    with pytest.raises(ValueError, match="one buffer and one signal pad per rank"):
        _buffer(buffer_ptrs=(PEER0,))
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        _buffer(rank=2)


def test_the_same_mapping_passes():
    symmetric.check([_buffer()], [_buffer()])
    symmetric.check([], [])


def test_a_peer_mapped_elsewhere_is_refused_naming_it():
    moved = _buffer(buffer_ptrs=(PEER0, PEER1 + (2 << 20)))
    with pytest.raises(SymmetricMismatch, match=r"buffer_ptrs\[1\] 0x7f0040200000 \(SAVE: 0x7f0040000000\)"):
        symmetric.check([_buffer()], [moved])


def test_another_size_or_layout_is_refused():
    with pytest.raises(SymmetricMismatch, match=r"buffer_size 33554432 \(SAVE: 67108864\)"):
        symmetric.check([_buffer()], [_buffer(buffer_size=32 << 20)])
    with pytest.raises(SymmetricMismatch, match=r"rank 1 \(SAVE: 0\)"):
        symmetric.check([_buffer()], [_buffer(rank=1)])


def test_missing_or_unexpected_buffers_are_refused():
    with pytest.raises(
        SymmetricMismatch, match="address torch symmetric memory 'tp'.*allocate and rendezvous"
    ):
        symmetric.check([_buffer()], [])
    with pytest.raises(SymmetricMismatch, match=r"\['ep'\] was given"):
        symmetric.check([], [_buffer(name="ep")])


def test_ranges_cover_every_rank_and_the_address_arrays():
    ranges = symmetric.ranges([_buffer()])
    whats = [w for _a, _n, w in ranges]
    assert "tp: local buffer" in whats and "tp: peer 1 buffer" in whats and "tp: peer 1 signal pad" in whats
    assert (BASE + 0x1000, 16, "tp: buffer address array") in ranges
    with pytest.raises(ValueError, match="overlap"):
        symmetric.ranges([_buffer(), _buffer(name="again")])


class _Driver:
    """cuPointerGetAttribute as the driver answers it: every word is device memory."""

    CUpointer_attribute = types.SimpleNamespace(CU_POINTER_ATTRIBUTE_MEMORY_TYPE=2)

    def cuPointerGetAttribute(self, attr, value):
        return 0, 2


@pytest.fixture
def auditor(monkeypatch):
    monkeypatch.setattr(graphs, "cu", lambda: _Driver())
    live = [(BASE, 1 << 20)]
    return lambda outside: graphs._Auditor(graphs.Segments(BASE, 1 << 30, live, outside))


def test_the_audit_accepts_pointers_into_recorded_symmetric_memory(auditor):
    audit = auditor(symmetric.ranges([_buffer()]))
    block = struct.pack("<4Q", PEER0 + 128, PEER1, BASE + 64, 7)
    audit.check_block(block, lambda off: f"word {off}")
    assert audit.symmetric == {PEER0 + 128, PEER1} and audit.pointers == {BASE + 64}


def test_the_audit_still_refuses_memory_outside_both(auditor):
    audit = auditor(symmetric.ranges([_buffer()]))
    stray = PEER1 + (64 << 20) + 9216  # just past peer 1's signal pad
    with pytest.raises(graphs.GraphError, match=f"{stray:#x} outside the Foundry region"):
        audit.check_block(struct.pack("<2Q", PEER0, stray), lambda off: f"word {off}")
    with pytest.raises(graphs.GraphError, match="outside the Foundry region"):
        auditor([]).check_word(PEER0, lambda: "word")


def test_load_refuses_an_archive_whose_record_is_damaged():
    from foundry_core.api import _check_symmetric

    archive = types.SimpleNamespace(meta={"symmetric": [{"name": "tp"}]})
    with pytest.raises(ArchiveError, match="damaged symmetric-memory record"):
        _check_symmetric(archive, "a/rank0", [])
    with pytest.raises(SymmetricMismatch, match="allocate and rendezvous"):
        _check_symmetric(types.SimpleNamespace(meta={"symmetric": [_buffer().to_json()]}), "a/rank0", [])


def _copy_driver(src: int, dst: int):
    """A driver whose graph holds one device-to-device copy from ``src`` to ``dst``."""
    ty = types.SimpleNamespace(
        CU_GRAPH_NODE_TYPE_KERNEL=0,
        CU_GRAPH_NODE_TYPE_MEMCPY=1,
        CU_GRAPH_NODE_TYPE_MEMSET=2,
        CU_GRAPH_NODE_TYPE_HOST=3,
        CU_GRAPH_NODE_TYPE_GRAPH=4,
        CU_GRAPH_NODE_TYPE_EMPTY=5,
        CU_GRAPH_NODE_TYPE_WAIT_EVENT=6,
        CU_GRAPH_NODE_TYPE_EVENT_RECORD=7,
        CU_GRAPH_NODE_TYPE_MEM_ALLOC=10,
        CU_GRAPH_NODE_TYPE_MEM_FREE=11,
        CU_GRAPH_NODE_TYPE_CONDITIONAL=13,
    )
    copy = types.SimpleNamespace(
        srcMemoryType=2, dstMemoryType=2, srcDevice=src, dstDevice=dst, srcXInBytes=0, srcY=0, srcZ=0,
        dstXInBytes=0, dstY=0, dstZ=0, srcPitch=0, srcHeight=0, dstPitch=0, dstHeight=0,
        WidthInBytes=4096, Height=1, Depth=1,
    )  # fmt: skip
    d = types.SimpleNamespace(CUgraphNodeType=ty)
    d.cuGraphGetNodes = lambda g, n: (0, [1] if n else None, 1)
    d.cuGraphNodeGetType = lambda node: (0, ty.CU_GRAPH_NODE_TYPE_MEMCPY)
    d.cuGraphGetEdges = lambda g, n: (0, None, None, None, 0)
    d.cuGraphMemcpyNodeGetParams = lambda node: (0, copy)
    return d


def test_a_copy_into_recorded_symmetric_memory_is_saved(monkeypatch):
    """The copy a symmetric-memory all-reduce stages its input with (found on the H200: the first
    SAVE of foundry tp was refused at this node before copies consulted the record)."""
    from foundry_core import driver

    fake = _copy_driver(BASE + 0x100, PEER0)
    monkeypatch.setattr(driver, "cu", lambda: fake)
    monkeypatch.setattr(graphs, "cu", lambda: fake)
    segs = graphs.Segments(BASE, 1 << 30, [(BASE, 1 << 20)], symmetric.ranges([_buffer()]))
    desc, pointers = graphs.serialize(object(), recorded=None, segments=segs, kernels={})
    assert desc["nodes"][0]["dst"] == PEER0 and desc["symmetric_pointers"] == 1 and pointers == {BASE + 0x100}
    segs = graphs.Segments(BASE, 1 << 30, [(BASE, 1 << 20)])
    with pytest.raises(graphs.GraphError, match="memcpy destination 0x7f0000000000 is not in a live Foundry"):
        graphs.serialize(object(), recorded=None, segments=segs, kernels={})


# ---- placement: native/symmetric.c steering a table entry, on a stand-in table ----

RESERVE = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_uint64,
    ctypes.c_ulonglong,
)
WINDOW = 0x620000000000
ALIGN = 512 << 20


class _StandInReserve:
    """A stand-in cuMemAddressReserve: records each request and honours its hint (without one it
    answers as a driver placing where it chooses would)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (size, hint)
        self.fn = RESERVE(self._reserve)
        self.addr = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _reserve(self, ptr, size, alignment, hint, flags):
        self.calls.append((size, hint))
        ptr[0] = hint or 0x7F1234000000
        return 0


@pytest.fixture
def table():
    """A table of entry points with the stand-in third, as torch 2.11 keeps cuMemAddressReserve."""
    lib = _native.lib()
    driver = _StandInReserve()
    entries = (ctypes.c_void_p * 8)(0x1111, 0x2222, driver.addr, 0x4444, 0, 0, 0, 0)
    yield lib, driver, entries
    lib.foundry_symm_arm(-1)
    lib.foundry_symm_hook_remove()


def _reserve_through(entries, size, hint=0) -> int:
    got = ctypes.c_uint64(0)
    assert RESERVE(entries[2])(ctypes.byref(got), size, 0, hint, 0) == 0
    return got.value


def test_the_reserve_entry_is_found_only_where_it_is_unique():
    entries = (ctypes.c_void_p * 4)(0x1111, 0x2222, 0x3333, 0x4444)
    base = ctypes.addressof(entries)
    assert symmetric.find_reserve_slot(base, [0x3333], search=4) == base + 16
    with pytest.raises(symmetric.SymmetricPlacementError, match="0 cuMemAddressReserve entries"):
        symmetric.find_reserve_slot(base, [0x9999], search=4)
    entries[3] = 0x3333
    with pytest.raises(symmetric.SymmetricPlacementError, match="2 cuMemAddressReserve entries"):
        symmetric.find_reserve_slot(base, [0x3333], search=4)


def test_armed_requests_are_placed_in_the_window_in_order(table):
    lib, driver, entries = table
    device = 60
    assert lib.foundry_symm_window(device, WINDOW, 64 << 30, ALIGN) == 0
    slot = symmetric.find_reserve_slot(ctypes.addressof(entries), [driver.addr], search=8)
    assert lib.foundry_symm_hook_install(slot) == 0
    assert entries[2] != driver.addr  # torch's calls now reach the placing entry
    assert _reserve_through(entries, 3 << 20) == 0x7F1234000000  # not armed: the driver chooses
    lib.foundry_symm_arm(device)
    first = _reserve_through(entries, 66 << 20)
    second = _reserve_through(entries, 2 << 20)
    assert _reserve_through(entries, 2 << 20, hint=0x7E0000000000) == 0x7E0000000000  # a caller's hint stands
    lib.foundry_symm_arm(-1)
    assert (first, second) == (WINDOW, WINDOW + ALIGN)
    # Placed requests are sub-ranges of the window Python reserved: the driver is not asked.
    assert driver.calls == [(3 << 20, 0), (2 << 20, 0x7E0000000000)]
    assert symmetric.placements(device) == [(WINDOW, 66 << 20), (WINDOW + ALIGN, 2 << 20)]
    assert not lib.foundry_symm_misplaced(device)
    assert lib.foundry_symm_hook_remove() == 0
    assert entries[2] == driver.addr  # the original entry is back


def test_a_full_window_marks_the_window_misplaced(table):
    lib, driver, entries = table
    assert lib.foundry_symm_window(61, WINDOW, 1 << 30, ALIGN) == 0
    assert lib.foundry_symm_window(61, WINDOW + ALIGN, 1 << 30, ALIGN) != 0  # one window per device
    assert "already has a symmetric-memory window" in symmetric._error()
    assert (
        lib.foundry_symm_hook_install(symmetric.find_reserve_slot(ctypes.addressof(entries), [driver.addr]))
        == 0
    )
    lib.foundry_symm_arm(61)
    _reserve_through(entries, ALIGN)
    _reserve_through(entries, ALIGN)
    assert not lib.foundry_symm_misplaced(61)
    assert _reserve_through(entries, 2 << 20) == 0x7F1234000000  # no room left: placed by the driver
    assert lib.foundry_symm_misplaced(61)
    assert "window on device 61 is full" in symmetric._error()


def test_the_hook_is_not_put_back_over_someone_elses(table):
    lib, driver, entries = table
    slot = symmetric.find_reserve_slot(ctypes.addressof(entries), [driver.addr])
    assert lib.foundry_symm_hook_install(slot) == 0
    assert lib.foundry_symm_hook_install(slot) == 0  # again over the same entry: a no-op
    assert lib.foundry_symm_hook_install(slot + 8) != 0
    theirs = entries[2]
    entries[2] = 0x5555
    assert lib.foundry_symm_hook_remove() != 0
    assert "replaced by another hook" in symmetric._error()
    entries[2] = theirs
    assert lib.foundry_symm_hook_remove() == 0


class _Region:
    def __init__(self, device):
        self.base, self.size, self.device, self.routed = 0x600000000000, (100 << 30) + (1 << 20), device, 0

    @contextlib.contextmanager
    def routing(self):
        self.routed += 1
        yield self


class _StandInWindows:
    """The driver calls that reserve and free a window, on this CPU: honoured unless ``elsewhere``."""

    def __init__(self, monkeypatch):
        self.reserved, self.freed, self.elsewhere = [], [], None
        monkeypatch.setattr(symmetric, "_reserved_windows", {})
        monkeypatch.setattr(symmetric, "_driver_reserve", self.reserve)
        monkeypatch.setattr(symmetric, "_driver_free", lambda addr, size: self.freed.append((addr, size)))

    def reserve(self, size, base):
        self.reserved.append((base, size))
        return self.elsewhere or base


def test_placed_arms_around_its_block_and_refuses_a_misplacement(table, monkeypatch):
    lib, driver, entries = table
    slot = symmetric.find_reserve_slot(ctypes.addressof(entries), [driver.addr])
    monkeypatch.setattr(symmetric, "_torch_reserve_slot", lambda: slot)
    windows = _StandInWindows(monkeypatch)
    region = _Region(device=63)
    base, size = symmetric.window(region)
    assert base == 0x601980000000  # one GiB past the first 1 GiB boundary past the region's end
    with symmetric.placed(region) as mapped:
        assert _reserve_through(entries, 2 << 20) == base
    assert mapped == [(base, 2 << 20)]  # what this block placed, told when it is over
    assert windows.reserved == [(base, size)]  # the whole window, at its base
    assert region.routed == 1 and entries[2] == driver.addr
    assert _reserve_through(entries, 2 << 20) == 0x7F1234000000  # disarmed outside
    with symmetric.placed(region) as mapped:  # again: the same window, reserved once, its cursor kept
        assert _reserve_through(entries, 2 << 20) == base + symmetric.PLACEMENT_ALIGN
    assert len(windows.reserved) == 1 and mapped == [(base + symmetric.PLACEMENT_ALIGN, 2 << 20)]
    with pytest.raises(symmetric.SymmetricPlacementError, match="already has a symmetric-memory window"):
        symmetric.reserve_window(63, base + (1 << 30), size)


def test_a_window_the_driver_puts_elsewhere_is_freed_and_refused(table, monkeypatch):
    lib, driver, entries = table
    monkeypatch.setattr(
        symmetric,
        "_torch_reserve_slot",
        lambda: symmetric.find_reserve_slot(ctypes.addressof(entries), [driver.addr]),
    )
    windows = _StandInWindows(monkeypatch)
    windows.elsewhere = 0x7F0000000000
    region = _Region(device=59)
    with pytest.raises(symmetric.SymmetricPlacementError, match="window at 0x7f0000000000 instead of"):
        with symmetric.placed(region):
            pytest.fail("the block must not run")
    assert windows.freed == [(0x7F0000000000, symmetric.WINDOW_SIZE)]
    assert entries[2] == driver.addr  # nothing was hooked
    assert 59 not in symmetric._reserved_windows

    def out_of_memory(size, base):
        raise CudaError("cuMemAddressReserve", 2)

    monkeypatch.setattr(symmetric, "_driver_reserve", out_of_memory)
    with pytest.raises(symmetric.SymmetricPlacementError, match="cannot reserve the symmetric-memory window"):
        symmetric.reserve_window(59, 0x7F0000000000, symmetric.WINDOW_SIZE)


def test_a_cuda_build_of_torch_exports_its_driver_table():
    """The export placed() starts from, checked without calling it (that needs a driver): a CUDA
    build of torch must still have it, a CPU build says plainly that it has none."""
    import os

    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so")
    if not os.path.exists(lib):
        with pytest.raises(symmetric.SymmetricPlacementError, match="cannot find torch's driver entry-point"):
            symmetric.driver_table_getter()
        return
    assert symmetric.driver_table_getter() is not None
