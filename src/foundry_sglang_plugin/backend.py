"""The Foundry decode-graph backend: SGLang's full-graph backend with SAVE and LOAD added.

SGLang (0.5.14+) builds its decode graphs through a pluggable backend chosen by
``resolve_decode_backend``: the runner owns the capture loop and all per-shape host-side preparation
(static buffers, attention metadata, two-batch-overlap plans) and calls
``backend.capture_one(shape_key, forward_fn, ...)`` once per shape inside ``capture_session``. The
Foundry backend keeps that loop untouched and changes only what ``capture_one`` does:

* SAVE: SGLang's own ``capture_one`` (warmups, capture into the graph pool) runs as usual, with two
  differences: the pool is the Foundry region's graph pool, and the graph is created with
  ``keep_graph=True`` so its topology can be persisted. The graph and its output are handed to the
  session, which persists them when graph initialization ends.
* LOAD: no warmup forward and no capture: the restored graph and its rebuilt output are installed
  under the same shape key, after the runner has done the shape's host-side preparation.

The instance SGLang built is re-classed to a subclass of its own class, so every other behaviour
(replay, ``can_run``, replay scopes) is SGLang's; ``replay`` is wrapped, on the instance, only to
time the first replays when :mod:`.replay_timing` is switched on, and unwrapped after them.

Written against SGLang 0.5.23's FullCudaGraphBackend; run on an H200 with SGLang 0.5.17 (docs/sglang.md).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from foundry_core.engine.capture import keep_captured_graphs
from foundry_sglang_plugin import replay_timing


@functools.cache
def foundry_backend_class(base: type) -> type:
    """The Foundry subclass of SGLang's full decode backend class ``base``."""

    class FoundryDecodeBackend(base):
        _foundry_session: Any = None
        _foundry_timer: Any = None  # replay_timing.ReplayTimer when FOUNDRY_SGLANG_REPLAY_TIMING is set

        @contextlib.contextmanager
        def capture_session(self, stream):
            session = self._foundry_session
            if getattr(self, "_pool", None) is None:
                self._pool = session.graph_pool()
            if session.mode == "load":
                session.restore()  # normally done already at the start of the runner's capture()
            with super().capture_session(stream):
                yield

        def capture_one(self, shape_key, forward_fn, *args, **kwargs):
            # *args/**kwargs: ``dummies`` before 0.5.17, ``capture_inputs`` and ``post_warmup_hook`` after.
            session = self._foundry_session
            if session.mode == "load":
                graph, output = session.restored_graph(shape_key)
                self._graphs[shape_key] = graph
                self._outputs[shape_key] = output
                return
            if session.mode == "capture":  # a LOAD that failed over to capturing: SGLang's own way
                return super().capture_one(shape_key, forward_fn, *args, **kwargs)
            with keep_captured_graphs():
                super().capture_one(shape_key, forward_fn, *args, **kwargs)
            session.record(shape_key, self._graphs[shape_key], self._outputs[shape_key])

        def cleanup(self):
            if self._foundry_session is not None and self._foundry_session.mode == "load":
                # Restored graphs belong to the archive's loader; drop references only.
                self._graphs.clear()
                self._outputs.clear()
                self._pool = None
                return
            super().cleanup()

    FoundryDecodeBackend.__qualname__ = f"Foundry{base.__name__}"
    return FoundryDecodeBackend


def install(backend: Any, session: Any) -> Any:
    """Turn the backend SGLang resolved into the Foundry backend, or refuse."""
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    if not isinstance(backend, FullCudaGraphBackend):
        raise RuntimeError(f"Foundry needs SGLang's full decode-graph backend, got {type(backend).__name__}")
    backend.__class__ = foundry_backend_class(type(backend))
    backend._foundry_session = session
    limit = replay_timing.replays_to_time()
    if limit:
        backend._foundry_timer = timer = replay_timing.ReplayTimer(limit, session.replay_timing_done)
        sglang_replay = backend.replay

        def timed_replay(shape_key, *args, **kwargs):
            with timer.measure(str(shape_key)):
                out = sglang_replay(shape_key, *args, **kwargs)
            if not timer.active:  # done: SGLang's own replay again, nothing of the timer left on the path
                del backend.replay
                backend._foundry_timer = None
            return out

        # An instance attribute, so that untimed servers (the default) replay through SGLang's
        # method with no Foundry frame on the serving loop's host path.
        backend.replay = timed_replay
    return backend
