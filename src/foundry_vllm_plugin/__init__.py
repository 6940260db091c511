"""Foundry plugin for vLLM: persist full decode CUDA graphs once, restore them at every later start.

vLLM runs :func:`register` from its ``vllm.general_plugins`` entry-point group (entry point
``foundry_graphs`` of the ``foundry-graphs-vllm`` distribution, through ``foundry_core.plugin_entry``)
in every process it starts (API server, engine core, workers, its model-inspection helper).
``register`` must therefore be cheap and idempotent: it imports neither torch nor vLLM, and only wraps three ``EngineArgs`` methods,
either at once (when ``vllm.engine.arg_utils`` is already imported, the usual case because vLLM calls
the plugin loader from there) or right after that module is first imported.  With Foundry off those
wrappers call straight through.  All GPU work lives in :mod:`foundry_vllm_plugin.worker`, which vLLM
imports only when Foundry is on for the engine (it becomes the engine's ``worker_cls``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Mapping

from foundry_vllm_plugin.support import FoundryUnsupportedError, check_supported

__all__ = ["FoundryUnsupportedError", "check_supported", "register"]

_ARG_UTILS = "vllm.engine.arg_utils"
_lock = threading.Lock()
_registered = False


def _install(module) -> None:
    from foundry_vllm_plugin import engine_args

    engine_args.install(module)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader and installs the Foundry hooks once the module has run."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _install(module)


class _ArgUtilsFinder(importlib.abc.MetaPathFinder):
    """A one-shot import hook for ``vllm.engine.arg_utils`` (removes itself when it fires)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _ARG_UTILS:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def register() -> None:
    """vLLM general-plugin entry point: cheap, idempotent, safe in every vLLM process. vLLM's plugin
    loader does not catch exceptions, so a failure here is one logged line and vLLM starts without
    Foundry."""
    try:
        _register()
    except Exception as e:
        logging.getLogger("vllm.foundry").error(
            "Foundry: the vLLM plugin was not registered (%s: %s); vLLM starts without Foundry",
            type(e).__name__,
            " ".join(str(e).split()),
        )


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        _read_ahead()
        module = sys.modules.get(_ARG_UTILS)
        if module is not None and hasattr(module, "EngineArgs"):
            _install(module)
        elif not any(isinstance(f, _ArgUtilsFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _ArgUtilsFinder())


def _read_ahead() -> None:
    """A LOAD reads its recorded files ahead from here on, while vLLM imports (never raises)."""
    # Spelled out here, not imported: register() imports nothing outside this package (tested);
    # the same reading as foundry_core.switches.config_path (tested against it).
    if not _config_named(sys.argv, os.environ):
        return  # no Foundry configuration named: nothing imported, as for a start without Foundry
    try:
        from foundry_core.early import start_readahead
    except Exception:  # noqa: BLE001 - register() never raises into the engine's plugin loader
        return
    start_readahead("vllm.foundry")


def is_registered() -> bool:
    return _registered


def _config_named(argv: list[str], environ: Mapping[str, str]) -> bool:
    """``--foundry-config PATH`` / ``--foundry-config=PATH`` on the command line, or a non-empty
    ``FOUNDRY_CONFIG``: where :func:`foundry_core.switches.config_path`, which this must not import,
    finds a path."""
    return any(a == "--foundry-config" or a.startswith("--foundry-config=") for a in argv) or bool(
        environ.get("FOUNDRY_CONFIG")
    )
