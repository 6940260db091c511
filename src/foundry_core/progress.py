"""A one-line progress bar on stderr for long SAVE/LOAD steps (silent when stderr is not a terminal)."""

from __future__ import annotations

import os
import sys
import time


class Progress:
    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, max(int(total), 1), 0
        if enabled is None:
            enabled = sys.stderr.isatty() and not os.environ.get("FOUNDRY_NO_PROGRESS")
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.05 and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r{self.label:<24} [{bar}] {self.done}/{self.total} {now - self._t0:6.2f}s")
        sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
