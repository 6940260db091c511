"""SAVE and LOAD must allocate alike in a scheduler's start on SGLang 0.5.23, and each scheduler must
know its own rank. Checked against SGLang's own code: its memory profiling
(``KVCacheConfigurator._profile_available_bytes``) run on the CPU with the device calls recorded, and
its runtime context (``publish`` with ``SpawnRanks``), which is where 0.5.23 keeps placement."""

from __future__ import annotations

import gc
import inspect
from types import SimpleNamespace

import pytest


@pytest.fixture
def published(parse):
    """``publish(server_args, role="scheduler", ranks=...)`` as ``run_scheduler_process`` does; the
    process's context is reset afterwards."""
    from sglang.srt import runtime_context as rc

    def _publish(server_args, ranks=None):
        return rc.publish(server_args, role="scheduler", ranks=ranks)

    try:
        yield _publish
    finally:
        rc.reset_context()


def _record_device_effects(monkeypatch, events: list[str]) -> None:
    """Make torch.cuda answer as one idle GPU and record what changes the allocator's state."""
    import torch

    monkeypatch.setattr(gc, "collect", lambda *a, **k: events.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(is_integrated=False))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (100 << 30, 141 << 30))


def test_load_mirrors_every_allocator_effect_of_sglangs_memory_profiling(parse, published, monkeypatch):
    """LOAD skips the profiling; what it repeats instead must be exactly the profiling's effects on
    torch's allocator, in order (0.5.23 collects garbage before emptying the cache; the old mirror
    only emptied it)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import get_parallel

    from foundry_sglang_plugin import session

    published(parse())
    # One rank: no process group is built on the CPU; SGLang reads the WORLD group's handle anyway.
    monkeypatch.setattr(get_parallel(), "_overrides", {"world_group": SimpleNamespace(cpu_group=None)})
    sglang_events: list[str] = []
    _record_device_effects(monkeypatch, sglang_events)
    profiler = SimpleNamespace(
        device="cuda",
        gpu_id=0,
        mambaish_config=None,
        post_capture_kv_active=False,
        model_config=SimpleNamespace(is_multimodal=False),
    )
    budget = KVCacheConfigurator._profile_available_bytes(profiler, pre_model_load_memory=140.0)
    assert budget > 0  # SGLang's own profiling ran to its end
    assert "empty_cache" in sglang_events and "gc.collect" in sglang_events

    mirrored: list[str] = []
    _record_device_effects(monkeypatch, mirrored)
    session._mirror_profiling_side_effects()
    assert mirrored == sglang_events


def test_scheduler_takes_no_placement_arguments_on_this_release():
    """Why the runtime context is read: 0.5.23's ``Scheduler(server_args, port_args)``."""
    from sglang.srt.managers.scheduler import Scheduler

    from foundry_sglang_plugin.hooks import _bound

    params = set(inspect.signature(Scheduler.__init__).parameters)
    assert not params & {"tp_rank", "gpu_id", "dp_rank"}
    hint = {n: _bound(Scheduler.__init__, object(), "args", "ports").get(n) for n in ("tp_rank", "gpu_id")}
    assert hint == {"tp_rank": None, "gpu_id": None}


def test_placement_comes_from_sglangs_runtime_context(parse, published):
    from sglang.srt.runtime_context import SpawnRanks, spawn_world_rank

    from foundry_sglang_plugin.placement import placement

    server_args = parse("--tp-size", "2", "--dp-size", "2")
    ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=1, pp_rank=0), dp_rank=1, gpu_id=3)
    published(server_args, ranks)
    assert placement({"tp_rank": None, "dp_rank": None, "gpu_id": None}) == (1, 1, 3)


def test_unpublished_placement_is_refused_not_taken_as_rank_0(parse, published):
    """A scheduler whose process published no ranks must not take rank 0's archive (the old
    handling swallowed SGLang's error and answered rank 0)."""
    from foundry_sglang_plugin.session import FoundrySessionError, Session

    server_args = parse("--tp-size", "2")
    published(server_args)  # configuration only, as a process that is no scheduler publishes it
    with pytest.raises(FoundrySessionError, match="placement is not in SGLang's runtime context") as e:
        Session.begin(server_args, {"tp_rank": None, "dp_rank": None, "gpu_id": None})
    assert "\n" not in str(e.value)


def test_placement_passed_as_scheduler_arguments_is_taken_as_given():
    """SGLang 0.5.17's ``Scheduler(..., gpu_id, tp_rank, ..., dp_rank)``: nothing else is read."""
    from foundry_sglang_plugin.placement import placement

    assert placement({"tp_rank": 1, "dp_rank": None, "gpu_id": 2}) == (1, None, 2)
