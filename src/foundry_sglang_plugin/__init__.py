"""Foundry for SGLang: persist decode CUDA graphs once, restore them at every later start.

SGLang loads this package through the ``sglang.srt.plugins`` entry point ``foundry_graphs`` of the
``foundry-graphs-sglang`` distribution (``foundry_core.plugin_entry.sglang``) and calls :func:`register`
in every process that loads plugins (launcher, scheduler, detokenizer, DP controller). ``register``
only queues hooks in SGLang's ``HookRegistry``; SGLang applies them right after. It imports nothing
beyond the registry module SGLang has already imported, and is a no-op on repeated calls.

Public API: :func:`register`, :func:`enable` (attach the settings to a ``ServerArgs`` built in
Python), :func:`check_supported` and :class:`FoundryUnsupportedError`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["FoundryUnsupportedError", "check_supported", "enable", "register"]

_registered: set[tuple[str, str]] = set()  # (target, hook kind) queued so far
#: What the launcher's fork server imports for the schedulers (sched_start says why these): kept
#: here so that register() starts it without importing more of Foundry.
SCHEDULER_PRELOAD = (
    *("torch", "transformers", "numpy", "sympy", "PIL", "ml_dtypes", "openai", "scipy", "triton"),
    *("triton_kernels", "gguf", "aiohttp", "fastapi", "uvicorn", "requests", "zmq", "msgspec", "psutil"),
    *("IPython.display", "transformers.modeling_gguf_pytorch_utils"),
)
#: Variables the preload reads (torch keeps ``torch.compiler.config.job_id`` from its import) that
#: the launcher sets for Foundry afterwards, and that each scheduler applies again to the modules
#: that kept them (``foundry_core.engine.caches.sync_pgo_job_id``, ``inductor.pin_process``).
SCHEDULER_RESYNCED = ("TORCH_COMPILE_JOB_ID", "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK")


def register() -> None:
    """Queue Foundry's hooks with SGLang's HookRegistry (idempotent, cheap). Never raises into
    SGLang's plugin loader: a failure is one logged line, and SGLang starts without Foundry."""
    try:
        _queue_hooks()
    except Exception as e:
        logging.getLogger("foundry.sglang").error(
            "Foundry: the SGLang plugin was not registered (%s: %s); SGLang starts without Foundry",
            type(e).__name__,
            " ".join(str(e).split()),
        )


def load() -> None:
    """The name upstream Foundry's ``foundry`` entry point calls in a module of this name: with
    both installed, say so in one line instead of failing in SGLang's loader."""
    from foundry_core.plugin_entry import report_clash

    report_clash("sglang")


def _queue_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from foundry_sglang_plugin import hooks, settings

    _early_start()
    wanted = list(hooks.LAUNCHER_HOOKS)
    # Engine(..., enable_foundry=...) needs the Engine hook; only where SGLang has imported the
    # Engine already (it has whenever an Engine is being built), so other processes import nothing.
    if "sglang.srt.entrypoints.engine" in sys.modules:
        wanted.append(hooks.ENGINE_HOOK)
    if settings.worker_enabled():
        wanted.extend(hooks.WORKER_HOOKS)
    for target, fn, kind in wanted:
        if (target, kind) in _registered:
            continue
        HookRegistry.register(target, fn, HookType[kind])
        _registered.add((target, kind))


def _early_start() -> None:
    """From here on, while SGLang imports: a LOAD reads its recorded files ahead, and, in the
    launcher, a fork server imports what the schedulers need (sched_start). Never raises."""
    # Spelled out here, not imported: register() imports nothing outside this package (tested);
    # the same reading as foundry_core.switches.config_path (tested against it).
    if not _config_named(sys.argv, os.environ):
        return  # no Foundry configuration named: nothing imported, as for a start without Foundry
    try:
        from foundry_core.early import mark, start_readahead

        mark("plugin_registered")
        start_readahead("foundry.sglang")
        _start_forkserver()
    except Exception:  # noqa: BLE001 - register() never raises into the engine's plugin loader
        return


def _start_forkserver() -> None:
    import multiprocessing

    if multiprocessing.parent_process() is not None:  # a scheduler or the detokenizer: not a launcher
        return
    if "--enable-foundry" not in sys.argv:  # a configuration named, but Foundry off: SGLang's start
        return
    if os.environ.get("FOUNDRY_WORKER_START", "").strip().lower() == "spawn":
        return
    # The resource limits SGLang's launcher sets before it starts the schedulers (set_ulimit, in
    # _set_envs_and_config), set now so that the server starts under them: a worker takes the
    # launcher's limits at start, but glibc sizes a process's thread stacks at exec.
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and hasattr(common, "set_ulimit"):
        # Quietly: where the hard limit is lower, SGLang's own call says so in its log once.
        sglang_log = logging.getLogger(common.__name__)
        level = sglang_log.level
        sglang_log.setLevel(logging.ERROR)
        try:
            common.set_ulimit()
        finally:
            sglang_log.setLevel(level)
    from foundry_core import forkserver

    forkserver.start(SCHEDULER_PRELOAD, logging.getLogger("foundry.sglang"), resynced=SCHEDULER_RESYNCED)


def enable(server_args: Any, config_path: str | os.PathLike) -> Any:
    """Turn Foundry on for a ``ServerArgs`` built in Python, e.g. for ``sglang.Engine(server_args=...)``."""
    from foundry_sglang_plugin import settings

    settings.attach(server_args, True, config_path)
    return server_args


def __getattr__(name: str) -> Any:
    if name in ("check_supported", "FoundryUnsupportedError"):
        from foundry_sglang_plugin import support

        return getattr(support, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _config_named(argv: list[str], environ: Mapping[str, str]) -> bool:
    """``--foundry-config PATH`` / ``--foundry-config=PATH`` on the command line, or a non-empty
    ``FOUNDRY_CONFIG``: where :func:`foundry_core.switches.config_path`, which this must not import,
    finds a path."""
    return any(a == "--foundry-config" or a.startswith("--foundry-config=") for a in argv) or bool(
        environ.get("FOUNDRY_CONFIG")
    )
