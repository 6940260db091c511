"""The engine layer: what both engine plugins do the same way, with no engine knowledge.

Plugins (``foundry_sglang_plugin``, ``foundry_vllm_plugin``) import this package; it imports only
``foundry_core`` (never an engine). :class:`CacheHandover` carries an engine's compile and JIT
caches from its SAVE process to every later LOAD (see :mod:`foundry_core.engine.caches`).
"""

from __future__ import annotations

from .handover import CacheHandover, CacheRefused, redirect_for_launch, undo_launch_redirect

__all__ = ["CacheHandover", "CacheRefused", "redirect_for_launch", "undo_launch_redirect"]
