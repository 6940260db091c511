"""The engine layer's tensor-parallel collectives (foundry_core.engine.tensor_parallel), on the CPU:
ranks are threads, each with its own "symmetric" buffer, and the one-shot kernel is stood in for by
what it does (an entry barrier, every rank's buffer summed at the same offset, an exit barrier). The
real kernel on a GPU: `foundry tp` (tests/gpu/test_tensor_parallel.py)."""

import threading

import pytest
import torch

from foundry_core.engine import tensor_parallel
from foundry_core.engine.tensor_parallel import SymmetricTP


class _Peers:
    """Every rank's buffer, and the one-shot sum over them."""

    def __init__(self, world_size: int):
        self.buffers: list[torch.Tensor] = [None] * world_size
        self.barrier = threading.Barrier(world_size)

    def one_shot(self, staged: torch.Tensor, group_name: str) -> torch.Tensor:
        rank = next(
            r
            for r, b in enumerate(self.buffers)
            if b.data_ptr() <= staged.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
        )
        offset = (staged.data_ptr() - self.buffers[rank].data_ptr()) // staged.element_size()
        self.barrier.wait()  # every rank has staged its input
        total = torch.zeros(staged.numel(), dtype=torch.float32)
        for b in self.buffers:
            total += b[offset : offset + staged.numel()].float()
        self.barrier.wait()  # no rank writes its buffer again before every rank has read it
        return total.to(staged.dtype)


def _run(world_size, fn):
    results, errors = [None] * world_size, []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


@pytest.fixture
def peers(monkeypatch):
    made = {}

    def make(world_size):
        made["p"] = _Peers(world_size)
        monkeypatch.setattr(tensor_parallel, "one_shot_sum", made["p"].one_shot)
        return made["p"]

    return make


def _rank(peers, rank, world_size, rows, width, dtype=torch.bfloat16):
    tp = SymmetricTP(region=None, rank=rank, world_size=world_size)
    buf = torch.full((rows * width,), 7.0, dtype=dtype)  # symmetric memory is not zeroed by torch
    peers.buffers[rank] = buf
    buf.zero_()  # what allocate_gather does once allocated
    tp._gather["logits"] = (buf, "tp", rows, width)
    return tp


@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_gathered_by_a_sum_of_zero_padded_shards_are_exact(peers, world_size):
    p = peers(world_size)
    rows, shard = 8, 40
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(rows, shard * world_size, generator=gen) * 30).to(torch.bfloat16)
    ranks = [_rank(p, r, world_size, rows, shard * world_size) for r in range(world_size)]

    def gather(rank, n):
        return ranks[rank].gather_last_dim("logits", full[:n, rank * shard : (rank + 1) * shard].contiguous())

    for n in (8, 3, 8, 1):  # fewer rows after more: the rows past n are never read
        for got in _run(world_size, lambda rank, n=n: gather(rank, n)):
            assert torch.equal(got, full[:n]), f"{n} rows"


def test_a_shard_that_does_not_fit_is_left_to_the_engine(peers):
    p = peers(2)
    tp = _rank(p, 0, 2, rows=4, width=16)
    assert tp.gather_last_dim("logits", torch.zeros(5, 8, dtype=torch.bfloat16)) is None  # more rows
    assert tp.gather_last_dim("logits", torch.zeros(4, 6, dtype=torch.bfloat16)) is None  # another width
    assert tp.gather_last_dim("logits", torch.zeros(4, 8, dtype=torch.float32)) is None  # another dtype
    assert tp.gather_last_dim("logits", torch.zeros(8, dtype=torch.bfloat16)) is None  # not 2-D
    assert tp.has_gather("logits") and not tp.has_gather("other")


def test_all_reduce_sums_over_the_ranks_into_out(peers):
    p = peers(2)
    xs = [torch.arange(12, dtype=torch.bfloat16).view(3, 4) * (r + 1) for r in range(2)]
    for r in range(2):
        p.buffers[r] = torch.zeros(64, dtype=torch.bfloat16)
    outs = [torch.empty(3, 4, dtype=torch.bfloat16) for _ in range(2)]
    got = _run(2, lambda r: SymmetricTP.all_reduce(p.buffers[r], xs[r], "tp", out=outs[r]))
    for r in range(2):
        assert got[r] is outs[r] and torch.equal(outs[r], xs[0] + xs[1])
    got = _run(2, lambda r: SymmetricTP.all_reduce(p.buffers[r], xs[r], "tp"))
    assert all(torch.equal(g, xs[0] + xs[1]) and g.shape == (3, 4) for g in got)


def test_a_gather_buffer_must_split_evenly():
    with pytest.raises(ValueError, match="not a multiple of 2 ranks"):
        SymmetricTP(region=None, rank=0, world_size=2).allocate_gather(
            "x", 4, 15, torch.bfloat16, "cpu", "tp"
        )


def test_symmetric_memory_torch_did_not_let_foundry_place_is_refused(monkeypatch):
    """``placed`` yields the mappings it made: none means torch reserved through another path."""
    import contextlib
    import sys
    import types

    from foundry_core.symmetric import SymmetricPlacementError

    @contextlib.contextmanager
    def placed(region):
        yield []

    fake = types.SimpleNamespace(
        empty=lambda n, dtype, device: torch.zeros(n, dtype=dtype), rendezvous=lambda t, g: None
    )
    monkeypatch.setattr(tensor_parallel, "placed", placed)
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", fake, raising=False)
    with pytest.raises(
        SymmetricPlacementError,
        match="torch mapped symmetric memory 'sglang/tp/logits' without Foundry placing it",
    ):
        SymmetricTP(region=None, rank=0, world_size=2).allocate(
            "sglang/tp/logits", 16, torch.bfloat16, "cpu", "tp"
        )
