"""The import heap set aside from Python's garbage collector in an engine worker, before its start.

An engine worker has imported torch, the engine and their dependencies before it does anything (on
vLLM 0.33.0 about 860,000 objects the collector tracks), and its start then runs several full
``gc.collect()`` passes, each of which walks all of them again: vLLM's device set-up before its
memory snapshot, the memory profiler on each side of the model load and the model loader twice
around its weight post-processing. On one H100 (2026-12-06, af2db3a) the last three of those fell
in the 1.6 s between vLLM's last weight shard and its "Model loading took" line, in Foundry's LOADs
and in stock's starts alike; on this CPU machine one such pass takes 1.1-1.2 s.

:func:`freeze_import_heap` moves everything tracked so far into the collector's permanent
generation (``gc.freeze()``), which later passes skip, so that each of them walks only what was made
after it. Called where the worker has not initialised CUDA yet, so no object it sets aside holds
device memory: every tensor, graph and allocation of the start is made afterwards and is collected
exactly as before, at SAVE and at LOAD alike, which keeps the order of device allocations the same.
What it sets aside that is already garbage (cycles left by imports) stays until the engine undoes
the freeze: vLLM freezes its whole heap itself once its start is done (``freeze_gc_heap``), and
unfreezes it at shutdown. ``FOUNDRY_GC_FREEZE=0`` leaves the collector alone (a switch to measure
either way).
"""

from __future__ import annotations

import gc

from ..switches import switched_on

ENV = "FOUNDRY_GC_FREEZE"


def freeze_import_heap() -> bool | None:
    """Set aside every object the collector tracks now; True once done, None where the switch is
    off (or the freeze failed). Never raises. It does not count them: ``gc.get_freeze_count()``
    walks the whole set aside, 44 ms for vLLM's heap on this CPU machine, on the start's critical
    path (997,672 objects in vLLM 0.33.0's worker on one H100, 3842b70)."""
    if not switched_on(ENV):
        return None
    try:
        gc.freeze()
        return True
    except Exception:  # noqa: BLE001 - an optimisation: the start goes on as the engine's own
        return None
