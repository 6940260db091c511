"""Optional timing of decode-graph replays inside a scheduler process (a diagnostic, off by default).

With ``FOUNDRY_SGLANG_REPLAY_TIMING=N`` the first N replays of the Foundry decode backend are timed:
host time of the replay call and device time between CUDA events recorded around it, per shape.
SAVE times the graphs SGLang captured, LOAD the restored ones, through the same code, so the two
runs' numbers compare the graphs themselves. The summary (medians per shape) goes into the session
report as ``replay_timing``. After N replays the backend's replay is SGLang's own again (the
wrapper is an instance attribute, removed then: backend.install).
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import time
from typing import Any

ENV = "FOUNDRY_SGLANG_REPLAY_TIMING"


def replays_to_time() -> int:
    """N from the environment; 0 (off) when unset or not a positive integer."""
    try:
        return max(0, int(os.environ.get(ENV, "0")))
    except ValueError:
        return 0


class ReplayTimer:
    def __init__(self, limit: int, on_summary: Any) -> None:
        self.limit = limit
        self.started = 0
        self._pending: collections.deque = collections.deque()
        self._host_us: dict[str, list[float]] = collections.defaultdict(list)
        self._device_us: dict[str, list[float]] = collections.defaultdict(list)
        self._on_summary = on_summary  # called with the summary after the last timed replay completes

    @property
    def active(self) -> bool:
        return self.started < self.limit or bool(self._pending)

    @contextlib.contextmanager
    def measure(self, name: str):
        if self.started >= self.limit:
            self._drain(final=True)
            yield
            return
        import torch

        self.started += 1
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        yield
        host_us = (time.perf_counter() - t0) * 1e6
        end.record()
        self._pending.append((name, begin, end, host_us))
        self._drain(final=False)

    def _drain(self, final: bool) -> None:
        """Collect the finished event pairs without waiting; at the end, wait for the rest once."""
        while self._pending:
            name, begin, end, host_us = self._pending[0]
            if final:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self._host_us[name].append(host_us)
            self._device_us[name].append(begin.elapsed_time(end) * 1e3)
        if final and self._on_summary is not None:
            callback, self._on_summary = self._on_summary, None
            callback(self.summary())

    def summary(self) -> dict[str, Any]:
        return {
            name: {
                "replays": len(self._device_us[name]),
                "device_us_median": round(statistics.median(self._device_us[name]), 2),
                "host_us_median": round(statistics.median(self._host_us[name]), 2),
            }
            for name in sorted(self._device_us)
        }
