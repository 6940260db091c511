"""What vLLM's SAVE-only memory profiling leaves behind, and what LOAD does in its place.

A SAVE start profiles memory: ``Worker.determine_available_memory`` runs ``profile_run`` and then
``profile_cudagraph_memory``, which in vLLM 0.33's V2 runner captures throwaway FULL graphs against a
minimal KV cache, with vLLM's global graph pool swapped for a throwaway one, and tears the profiling
state down again (``cudagraph_manager = None``; in 0.26 the call was a no-op). A LOAD start takes the
KV-cache size from its archive, so vLLM runs ``profile_run`` alone. Both starts must nevertheless
reach the setup (the KV cache, ``initialize_from_config``) with the same state:

* the persistent workspace resources that the throwaway capture created (keyed by its capture stream)
  are dropped at SAVE: LOAD never creates them (:func:`neutral_profiling`);
* vLLM's global graph pool is the Foundry region's again, and the caching allocator has released its
  free blocks, as the profiling leaves it, in both modes (:func:`settle_after_profiling`).

:func:`after_restore` does, at LOAD, what the end of vLLM's ``capture_model`` does besides capturing.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any

from foundry_vllm_plugin import workspace

logger = logging.getLogger("vllm.foundry")  # under vLLM's logger: same handlers and level


@contextlib.contextmanager
def neutral_profiling(runner: Any, session: Any):
    """SAVE: while vLLM profiles memory, its graph-memory profiling leaves no persistent workspace
    resource behind (the runner's ``profile_cudagraph_memory`` is wrapped on the instance)."""
    original = getattr(runner, "profile_cudagraph_memory", None)
    if original is None:  # a runner without graph-memory profiling
        yield
        return

    def profile_cudagraph_memory(*args: Any, **kwargs: Any):
        before = workspace.resource_keys()
        try:
            return original(*args, **kwargs)
        finally:
            dropped = workspace.drop_added(before)
            session.report["profiling_resources_dropped"] = dropped

    runner.profile_cudagraph_memory = profile_cudagraph_memory
    try:
        yield
    finally:
        vars(runner).pop("profile_cudagraph_memory", None)


def settle_after_profiling(runner: Any, session: Any) -> None:
    """Both modes, when ``determine_available_memory`` returns: vLLM's global graph pool is the
    region's (the throwaway pool vLLM swapped in must not outlive the profiling), and the caching
    allocator's free blocks are released, as the end of SAVE's profiling leaves them."""
    import torch
    from vllm.platforms import current_platform

    pool = session.region.graph_pool_id() if session.region is not None else None
    platform_cls = type(current_platform)
    if pool is not None and getattr(platform_cls, "_global_graph_pool", None) != pool:
        logger.info("Foundry rank %d: vLLM's global graph pool set back to the region's", session.rank)
        platform_cls._global_graph_pool = pool
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def after_restore(runner: Any) -> None:
    """LOAD, in place of vLLM's capture: what its ``capture_model`` does after capturing, except the
    workspace lock (the session mirrors the SAVE's): the KV connector forgets its capture state."""
    connector = getattr(runner, "kv_connector", None)
    reset = getattr(connector, "reset_capture_state", None)
    if callable(reset):
        reset()
