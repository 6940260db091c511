"""Progress bars for the long SAVE/LOAD steps: tqdm's (both engines already bring it), on stderr,
shown only where stderr is a terminal and ``FOUNDRY_NO_PROGRESS`` is not set."""

from __future__ import annotations

import os
import sys


class _NoBar:
    """What a disabled bar is: tqdm is not even imported then (tens of ms where nothing imported it
    before, e.g. a LOAD of ``foundry demo``; engine servers log to files and never show a bar)."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress_bar(label: str, total: int, enabled: bool | None = None):
    """A ``tqdm`` bar over ``total`` steps (use as a context manager; ``update()`` per step).
    ``enabled=None``: on where stderr is a terminal (server logs get no carriage-return lines)."""
    if enabled is None:
        enabled = sys.stderr.isatty() and not os.environ.get("FOUNDRY_NO_PROGRESS")
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=max(int(total), 1), desc=label, file=sys.stderr, mininterval=0.05)
