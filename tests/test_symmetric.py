"""Torch symmetric memory recorded with an archive (symmetric.py): the record, the LOAD check and the
SAVE's pointer audit, on the CPU. A real rendezvous needs GPUs: tests/test_gpu_tp.py."""

import struct
import types

import pytest

from foundry_core import graphs, symmetric
from foundry_core.archive import ArchiveError
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
