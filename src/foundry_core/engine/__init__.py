"""The engine layer: what both engine plugins do the same way, with no engine knowledge.

Plugins (``foundry_sglang_plugin``, ``foundry_vllm_plugin``) import this package; it imports only
``foundry_core`` (never an engine):

* :class:`CacheHandover` carries an engine's compile and JIT caches from its SAVE process to every
  later LOAD (:mod:`foundry_core.engine.caches`);
* :func:`write_json_atomic` writes the records beside an archive (atomic, fsynced);
* :class:`FoundryUnsupportedError` is the one refusal both plugins raise at startup;
* :func:`inductor.pin` gives torch.compile the settings under which a LOAD's compiled code
  computes what the SAVE's did;
* :func:`profiling.profiled` profiles a startup phase on the host when ``FOUNDRY_PROFILE_DIR`` is set.
"""

from __future__ import annotations

from .handover import CacheHandover, CacheRefused, redirect_for_launch, undo_launch_redirect
from .records import read_json, write_json_atomic
from .refusal import FoundryUnsupportedError, exiting

__all__ = [
    "CacheHandover",
    "CacheRefused",
    "FoundryUnsupportedError",
    "exiting",
    "read_json",
    "redirect_for_launch",
    "undo_launch_redirect",
    "write_json_atomic",
]
