"""SGLang's scheduler processes started without importing SGLang a second time, where that is safe.

SGLang 0.5.23 sets ``multiprocessing``'s start method to ``spawn`` in ``_set_envs_and_config`` and
starts each scheduler with ``mp.Process`` in ``Engine._launch_scheduler_processes``: each scheduler
is a fresh interpreter that imports torch and SGLang again (24.5 s of a 64 s LOAD on an H200). The
launcher has imported all of it already (``engine.py`` imports ``run_scheduler_process``), so a
forked scheduler starts with it in place. :func:`around_launch_schedulers` (installed for a Foundry
launch once SGLang's engine module is imported, :func:`install`) forks for the one call that starts
the schedulers when :func:`foundry_core.engine.start_method.decide` allows it. Where the launcher
has initialised CUDA (on a GPU host it has: a kernel module SGLang imports asks the GPU at import),
the schedulers fork from the fork server the plugin started at registration
(:mod:`foundry_core.forkserver`, with :data:`PRELOAD` imported ahead) where one runs and its
preload left CUDA alone and kept no setting the launcher changed since, and are spawned as SGLang
does otherwise. The choice and its reason are in every scheduler's start report
(``scheduler_start``). The detokenizer, which SGLang spawns right after the schedulers and which
imports nearly as much, starts by the same rules (:func:`around_launch_detokenizers`).

:data:`PRELOAD`: the third-party modules that make up most of a scheduler's imports, that ask
nothing of the GPU at import, and that read no variable at import that the launcher sets after the
plugin registered (SGLang's ``_set_envs_and_config``: NCCL, ``CUDA_DEVICE_MAX_CONNECTIONS``, CuTe DSL
logging; Foundry's compile-cache folders and settings) but those each scheduler applies again
(``SCHEDULER_RESYNCED``). The server records what its imports read and the launcher checks it before
the schedulers fork (:func:`foundry_core.forkserver.unusable`). Left out: SGLang, sgl_kernel,
FlashInfer, xgrammar, and transformers' modelling modules with compressed-tensors (they ask the GPU
at import, ``torch.cuda.is_available()`` included), CuTe DSL (reads the logging variables SGLang's
launcher sets), and torch's compile stack (keeps the Inductor cache folder from its import and makes
it there, before Foundry's launcher step makes its private one: on the H100 on 2026-12-05 a server
given the planned folder created it world-readable, Foundry's private folder was refused, and every
LOAD compiled its kernels again).

SGLang's own reasons to spawn (:func:`blockers`): Ray placement, the data-parallel controller (a
process that starts the schedulers itself), the memory saver (a library ``LD_PRELOAD``-ed into each
scheduler) and NUMA binding v2 where it applies (each scheduler ``exec``-ed under ``numactl``; with
``SGLANG_NUMA_BIND_V2=0`` SGLang binds inside the scheduler process, which a fork keeps).

A forked scheduler inherits the launcher's loaded plugins, and SGLang loads plugins once per
process: the launcher registered Foundry's hooks before Foundry's worker marker was set, so the
forked child registers and applies the worker hooks itself (:func:`_forked_scheduler`) before
SGLang's scheduler function runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

from foundry_core import forkserver
from foundry_core.engine import start_method
from foundry_sglang_plugin import SCHEDULER_PRELOAD, settings
from foundry_sglang_plugin._view import reader

logger = logging.getLogger("foundry.sglang")

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
TARGET = f"{ENGINE_MODULE}.Engine._launch_scheduler_processes"
DETOKENIZER_TARGET = f"{ENGINE_MODULE}.Engine._launch_detokenizer_subprocesses"
PRELOAD = SCHEDULER_PRELOAD
_installed = False


def install() -> bool:
    """Hook the scheduler and detokenizer launches (in the launcher, once SGLang's engine module is
    imported; idempotent)."""
    global _installed
    if _installed or ENGINE_MODULE not in sys.modules:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, around_launch_schedulers, HookType.AROUND)
    HookRegistry.register(DETOKENIZER_TARGET, around_launch_detokenizers, HookType.AROUND)
    HookRegistry.apply_hooks()  # only targets not patched yet: these two
    _installed = True
    return True


def blockers(server_args: Any, placement_group: Any = None) -> list[str]:
    """SGLang's reasons to start the schedulers with a fresh interpreter."""
    read = reader(server_args)
    out = []
    if placement_group is not None:
        out.append("Ray places the schedulers")
    if int(read("dp_size", 1) or 1) > 1 or read("ep_join_mode", None) == "scale":
        out.append("the data-parallel controller starts the schedulers itself")
    if read("enable_memory_saver", False):
        out.append("the memory saver LD_PRELOADs its library into each scheduler")
    if _numa_exec(server_args, read):
        out.append("NUMA binding v2 starts each scheduler under numactl")
    return out


def _numa_exec(server_args: Any, read: Any) -> bool:
    """Whether SGLang would start the first scheduler under ``numactl`` (binding v2, the default,
    on a host with several NUMA nodes and numactl; SGLANG_NUMA_BIND_V2=0 binds in the scheduler
    process instead, which a fork keeps)."""
    try:
        from sglang.srt.environ import envs
        from sglang.srt.utils.numa_utils import get_numa_node_if_available
    except ImportError:
        return False
    try:
        if not envs.SGLANG_NUMA_BIND_V2.get():
            return False
        gpu = int(read("base_gpu_id", 0) or 0)
        return get_numa_node_if_available(server_args, gpu) is not None
    except Exception:  # noqa: BLE001 - cannot tell: assume SGLang binds, and spawn
        return True


def around_launch_schedulers(
    original: Any,
    cls: Any,
    server_args: Any,
    port_args: Any,
    run_scheduler_process_func: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if not settings.worker_enabled():  # Foundry is off for this launch: SGLang's own start
        return original(cls, server_args, port_args, run_scheduler_process_func, *args, **kwargs)
    choice = _choose(blockers(server_args, kwargs.get("placement_group")))
    start_method.export(choice)  # the schedulers' start reports
    logger.info("Foundry: schedulers start by %s (%s)", choice.method, choice.reason)
    if choice.method == "fork":
        target: Any = functools.partial(_forked_scheduler, run_scheduler_process_func)
    elif choice.method == "forkserver":
        # Like a spawned scheduler, it loads SGLang's plugins itself (run_scheduler_process does).
        target = forkserver.WithLaunchState(run_scheduler_process_func)
    else:
        return original(cls, server_args, port_args, run_scheduler_process_func, *args, **kwargs)
    with _start_method(choice.method):
        return original(cls, server_args, port_args, target, *args, **kwargs)


def around_launch_detokenizers(original: Any, cls: Any, *args: Any, **kwargs: Any) -> Any:
    """The detokenizer, started right after the schedulers, imports SGLang as they do (about as
    long as a scheduler's imports) and must answer before the first reply: with the schedulers
    no longer re-importing, a spawned detokenizer would hold the first token back. It starts as
    the schedulers do, by the same rules (it has no reason of its own to spawn). Several
    detokenizer workers come with a router process whose function SGLang names itself: SGLang's
    own start then."""
    names = ("server_args", "port_args", "run_detokenizer_process_func")
    call = {**dict(zip(names, args)), **kwargs}
    if (
        not settings.worker_enabled()
        or len(call) != len(names)
        or int(reader(call["server_args"])("detokenizer_worker_num", 1) or 1) > 1
    ):
        return original(cls, *args, **kwargs)
    choice = _choose([])
    logger.info("Foundry: the detokenizer starts by %s (%s)", choice.method, choice.reason)
    if choice.method == "spawn":
        return original(cls, *args, **kwargs)
    if choice.method == "forkserver":
        call["run_detokenizer_process_func"] = forkserver.WithLaunchState(
            call["run_detokenizer_process_func"]
        )
    with _start_method(choice.method):
        return original(cls, **call)


def _choose(spawn_reasons: list[str]) -> start_method.Choice:
    choice = start_method.decide(blockers=spawn_reasons, forkserver=forkserver.running())
    if choice.method == "forkserver" and (why_not := forkserver.unusable()):
        # E.g. a preloaded module initialised CUDA: a process forked from it could not use it.
        fallback = start_method.decide(blockers=spawn_reasons, forkserver=None)
        choice = start_method.Choice(fallback.method, f"{fallback.reason}; Foundry's fork server: {why_not}")
    return choice


@contextlib.contextmanager
def _start_method(method: str) -> Iterator[None]:
    """``multiprocessing``'s default start method for one launch call, SGLang's (spawn) again after."""
    import multiprocessing as mp

    before = mp.get_start_method(allow_none=True)
    mp.set_start_method(method, force=True)
    try:
        yield
    finally:
        mp.set_start_method(before or "spawn", force=True)


def _forked_scheduler(func: Any, *args: Any, **kwargs: Any) -> Any:
    """In a forked scheduler: Foundry's worker hooks, then SGLang's scheduler function."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import foundry_sglang_plugin

    foundry_sglang_plugin.register()  # the marker is set now: the worker hooks are queued
    HookRegistry.apply_hooks()
    return func(*args, **kwargs)
