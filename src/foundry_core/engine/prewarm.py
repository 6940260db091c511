"""Per-process work that a restored start cannot skip, begun on daemon threads once Foundry's own
start steps are done.

Not before them: the steps (archive check, caches hand-over) make hundreds of short system calls,
and a thread that hands the GIL back for each one waits for a free core every time it takes it
again. On a 16-core H100 host (2026-12-05, 068d9cc) the caches hand-over took 0.60 s while the
graph archive inflated on every core beside it, against 0.09 s with the inflate done first; on
2 cores, 67 ms alone, 137-159 ms beside an inflate on both cores, 82-96 ms with one core left free
(benchmarks/caches_unpack.py). So the plugins call :func:`start` after their steps, and the
background inflate leaves half the cores to the engine's own setup.

Triton keys every kernel it loads from its cache with ``triton_key()``: a SHA-256 over its compiler
sources and its ``libtriton`` shared library (hundreds of MB), computed once per process, at the
first Triton launch. In an SGLang LOAD that first launch is an attention-metadata kernel in the
decode-graph phase, which then waits for the hash (0.6 s of a 2.2 s phase in the profile of
2026-12-01, docs/performance.md). The key depends on nothing the engine sets up, so the engine
worker starts computing it right after Foundry's steps, and the hash overlaps the engine's own setup
(weights, KV cache, torch.compile). ``triton_key`` is ``functools.lru_cache``-d: the engine's first
launch finds the value, or, if it comes before the thread is done, computes the same value itself.

The hash reads all of ``libtriton`` from disk; in an emptied container that read competes with the
engine's own imports. ``FOUNDRY_PREWARM=0`` leaves the key to the engine's first launch (a switch to
measure either way: the 995630c cold runs showed SGLang's scheduler start 2-4 s longer with Foundry,
cause not yet isolated; docs/cold-start.md).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..switches import switched_on

#: "0": no prewarming; the engine's first Triton launch computes the key, as without Foundry.
ENV = "FOUNDRY_PREWARM"

_thread: threading.Thread | None = None


def start(log: logging.Logger | None = None, archive: Any = None) -> threading.Thread | None:
    """Start computing Triton's per-process cache key on a daemon thread (once per process), and
    inflating ``archive`` on another: a verified archive whose compressed members are still pending
    (``foundry_core.verify(..., inflate=False)``), which a LOAD maps later (inflated whatever
    :data:`ENV` says: the LOAD needs it). Call it after Foundry's start steps (above).

    Returns the key's thread, or None where there is nothing to warm (no Triton, another Triton
    layout) or it was started before. Failures stay on the threads: the engine computes the key as
    usual, and a member that does not inflate is refused where the LOAD reads it.
    """
    global _thread
    if archive is not None:
        try:
            archive.inflate_ahead()
        except Exception as e:  # noqa: BLE001 - the LOAD inflates what is still pending itself
            (log or logging.getLogger("foundry")).debug("Foundry: no inflating ahead (%s)", e)
    if _thread is not None or not switched_on(ENV):
        return None
    try:
        # Imported on the calling thread (the engine has imported Triton already), so that the
        # thread itself does little more than read and hash files.
        from triton.runtime.cache import triton_key
    except Exception:  # no Triton (CPU-only installs) or a release without it: nothing to warm
        return None
    log = log or logging.getLogger("foundry")

    def run() -> None:
        try:
            triton_key()
        except Exception as e:  # the engine's first launch computes it and reports any error itself
            log.debug("Foundry: warming Triton's cache key failed (%s); the engine computes it", e)

    _thread = threading.Thread(target=run, name="foundry-triton-key", daemon=True)
    _thread.start()
    return _thread
