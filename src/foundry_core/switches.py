"""Foundry's ``FOUNDRY_*`` on/off switches (read-ahead, GC freeze, prepare, prewarm, save check,
archive compression): each is on unless its variable is ``0``, surrounding spaces ignored, so that
every switch reads the same way. Imports nothing heavy: ``foundry_core.early`` reads one before
the engine has imported anything. ``engine/readahead.py`` writes the same test out itself: its
helper process loads that file alone, without this package."""

from __future__ import annotations

import os
from collections.abc import Mapping


def switched_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch ``name`` is on in ``environ`` (the process environment with None)."""
    return (os.environ if environ is None else environ).get(name, "1").strip() != "0"
