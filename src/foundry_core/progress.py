"""Progress bars for the long SAVE/LOAD steps: tqdm's (both engines already bring it), on stderr,
shown only where stderr is a terminal and ``FOUNDRY_NO_PROGRESS`` is not set."""

from __future__ import annotations

import os
import sys


def progress_bar(label: str, total: int, enabled: bool | None = None):
    """A ``tqdm`` bar over ``total`` steps (use as a context manager; ``update()`` per step).
    ``enabled=None``: on where stderr is a terminal (server logs get no carriage-return lines)."""
    from tqdm import tqdm  # imported here: `import foundry_core` stays cheap for the plugins' register()

    if enabled is None:
        enabled = sys.stderr.isatty() and not os.environ.get("FOUNDRY_NO_PROGRESS")
    return tqdm(total=max(int(total), 1), desc=label, disable=not enabled, file=sys.stderr, mininterval=0.05)
