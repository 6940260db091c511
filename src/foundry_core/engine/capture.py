"""Around an engine's capture: graphs that keep their topology, and CUDA module recording.

Both engines build their graphs with a plain ``torch.cuda.CUDAGraph()`` looked up on ``torch.cuda``
at call time (SGLang's decode backend, vLLM's V1 wrapper and V2 manager), so replacing that
attribute for the duration of the capture is how SAVE gets graphs it can read; captures run on one
thread of the engine process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("foundry.engine")


def kept_graph_class(base: type) -> type:
    """A subclass of ``base`` (``torch.cuda.CUDAGraph``) whose instances keep their topology.

    ``foundry_core.save`` reads each graph through ``raw_cuda_graph()``, which torch allows only for a
    graph constructed with ``keep_graph=True``. The flag is a constructor argument of ``__new__``,
    but the C++ object is built by pybind's ``__init__(self, keep_graph=False)``, which Python calls
    with the caller's (empty) arguments: both are overridden, or the flag is silently lost (seen on
    torch 2.11). With it, torch instantiates the executable at the first ``replay()``.
    """

    class _KeptCUDAGraph(base):
        def __new__(cls, *args: Any, **kwargs: Any):  # any keep_graph the engine passes is overridden
            return super().__new__(cls, keep_graph=True)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(keep_graph=True)

    _KeptCUDAGraph.__name__ = _KeptCUDAGraph.__qualname__ = "KeptCUDAGraph"
    return _KeptCUDAGraph


@contextlib.contextmanager
def keep_captured_graphs() -> Iterator[None]:
    """While active, every ``torch.cuda.CUDAGraph()`` is created with ``keep_graph=True``."""
    import torch

    base = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = kept_graph_class(base)
    try:
        yield
    finally:
        torch.cuda.CUDAGraph = base


def start_recording(keep_images: bool = True) -> None:
    """Start (or switch) the core's CUDA module recorder; LOAD only counts stream captures."""
    import foundry_core as fc

    fc.start_recording(keep_images=keep_images)


def stop_recording(log: logging.Logger | None = None) -> None:
    """Detach CUPTI once the graphs are saved or restored, so the serving loop runs with no profiler
    interface attached. A failure is logged (on ``log``, the engine's logger), never raised: the
    graphs are fine."""
    try:
        import foundry_core as fc

        fc.stop_recording()
    except Exception as e:
        (log or logger).warning("Foundry: cannot stop CUDA module recording: %s", e)


def stream_captures() -> dict[str, int] | None:
    """CUDA stream captures (runtime and driver API) counted since recording started, or None when
    nothing is recording (no native library, CPU tests): unknown, not zero."""
    try:
        import foundry_core as fc

        return fc.stream_captures() if fc.modules.recording() else None
    except Exception:
        return None
