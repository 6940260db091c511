"""SAVE's memory profiling (vLLM 0.33) and what LOAD, which skips it, must end with all the same.

vLLM 0.33's V2 runner profiles graph memory with a throwaway capture: it swaps vLLM's global graph
pool for a throwaway one, captures on its own stream (Marlin keys its locks by stream, so the
capture creates persistent workspace resources of its own), and tears its state down. LOAD never
runs it. The tests drive vLLM's own workspace manager and platform class through a runner whose
profiling does what vLLM's does to them.
"""

from __future__ import annotations

import types

import pytest

from foundry_vllm_plugin import workspace
from foundry_vllm_plugin.profiling_state import neutral_profiling, settle_after_profiling

pytestmark = pytest.mark.vllm

REGION_POOL = (0, 77)


class ProfilingRunner:
    """``profile_cudagraph_memory`` as vLLM 0.33's V2 runner runs it, on the parts Foundry sees."""

    def __init__(self, restores_pool=True):
        self.restores_pool = restores_pool

    def profile_cudagraph_memory(self):
        import torch
        from vllm.platforms import current_platform
        from vllm.v1.worker.workspace import current_workspace_manager

        platform_cls = type(current_platform)
        saved = platform_cls._global_graph_pool
        platform_cls._global_graph_pool = (0, 999)  # the throwaway pool
        current_workspace_manager().get_persistent(
            ("marlin_locks", "profiling-capture-stream"), (8,), torch.int32, zero_init=True
        )
        if self.restores_pool:
            platform_cls._global_graph_pool = saved
        return 123


def _session():
    region = types.SimpleNamespace(graph_pool_id=lambda: REGION_POOL)
    return types.SimpleNamespace(region=region, rank=0, report={})


@pytest.fixture
def region_pool():
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    saved = platform_cls.__dict__.get("_global_graph_pool")
    platform_cls._global_graph_pool = REGION_POOL  # as FoundrySession.open() sets it
    yield
    platform_cls._global_graph_pool = saved


def test_save_profiling_leaves_no_workspace_resource_load_never_makes(cpu_workspace_manager, region_pool):
    import torch

    kept = cpu_workspace_manager.get_persistent(("marlin_locks", "default-stream"), (8,), torch.int32)
    runner, session = ProfilingRunner(), _session()
    with neutral_profiling(runner, session):
        assert runner.profile_cudagraph_memory() == 123  # what vLLM's worker calls
    assert "profile_cudagraph_memory" not in vars(runner)  # vLLM's own method again
    assert workspace.resource_keys() == [{(torch.Tensor, ("marlin_locks", "default-stream"))}]
    assert cpu_workspace_manager.get_persistent(("marlin_locks", "default-stream"), (8,), torch.int32) is kept
    assert session.report["profiling_resources_dropped"] == 1
    # LOAD's start (no graph-memory profiling) reaches the setup with the same manager.
    assert workspace.listing() == {
        "slots": [
            {
                "scratch_bytes": 0,
                "persistent": [
                    {
                        "key": "(torch.Tensor,('marlin_locks','default-stream'))",
                        "kind": "Tensor",
                        "fields": {"": [[8], "int32"]},
                    }
                ],
            }
        ]
    }


def test_both_modes_end_profiling_on_the_region_graph_pool(cpu_workspace_manager, region_pool):
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    runner, session = ProfilingRunner(restores_pool=False), _session()
    runner.profile_cudagraph_memory()  # a throwaway pool left behind
    assert platform_cls._global_graph_pool != REGION_POOL
    settle_after_profiling(runner, session)
    assert platform_cls._global_graph_pool == REGION_POOL
    settle_after_profiling(runner, session)  # LOAD, whose pool never moved: unchanged
    assert platform_cls._global_graph_pool == REGION_POOL
