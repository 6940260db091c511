"""``Region.routing`` nests within a thread: torch refuses to begin allocating to a pool that the
thread already allocates to (``beginAllocateToPool: already recording to mempool_id``, which ended
SGLang's TP=2 SAVE on the H200 when the plugin placed symmetric memory inside the setup it routes).
torch's two context managers are replaced by ones that refuse the same way, so this runs on CPUs;
tests/gpu/test_symmetric_placement.py runs the nested case on a GPU."""

import contextlib
import threading

import pytest
import torch

from foundry_core.region import Region


@pytest.fixture
def region(monkeypatch):
    entered: list[object] = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        if pool in entered:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        entered.append(pool)
        try:
            yield
        finally:
            entered.remove(pool)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    r = object.__new__(Region)
    r.device, r.pool, r._routed = 0, object(), threading.local()
    r.entered = entered
    return r


def test_routing_nests_and_ends_with_the_outer_block(region):
    with region.routing():
        with region.routing(), region.routing():
            assert region.entered == [region.pool]
        assert region.entered == [region.pool], "the inner blocks left the outer one routing"
    assert region.entered == []
    with region.routing():  # a new outer block after the first ended
        assert region.entered == [region.pool]


def test_an_error_inside_a_nested_block_unwinds_both(region):
    with pytest.raises(ValueError), region.routing(), region.routing():
        raise ValueError("inside")
    assert region.entered == [] and region._routed.depth == 0
    with region.routing():
        assert region.entered == [region.pool]


def test_each_thread_routes_on_its_own(region):
    seen = []

    def other():
        try:
            with region.routing():
                seen.append("routed")
        except RuntimeError as e:
            seen.append(str(e))

    with region.routing():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    # torch's pool state is per thread too; the stand-in is shared, so the other thread's own
    # outer block reaches it and is refused: the nesting did not leak across threads
    assert seen == ["beginAllocateToPool: already recording to mempool_id"]
