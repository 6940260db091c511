"""Foundry's ``FOUNDRY_*`` on/off switches (read-ahead, GC freeze, prepare, prewarm, save check,
archive compression): each is on unless its variable is ``0``, surrounding spaces ignored, so that
every switch reads the same way; and whether a launch names a Foundry configuration at all. Imports
nothing heavy: ``foundry_core.early`` asks before the engine has imported anything. Two copies are
written out, each tested to read alike: the switch test in ``engine/readahead.py`` (its helper
process loads that file alone, without this package) and the configuration test in both plugins
(their ``register()`` imports nothing of the core)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

CONFIG_FLAG = "--foundry-config"


def switched_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch ``name`` is on in ``environ`` (the process environment with None)."""
    return (os.environ if environ is None else environ).get(name, "1").strip() != "0"


def config_path(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The configuration a launch names: ``--foundry-config PATH`` or ``--foundry-config=PATH`` in
    ``argv``, else a non-empty ``FOUNDRY_CONFIG``; None where it names none (the early start and
    the read-ahead then do nothing: a start without Foundry stays as it was)."""
    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(CONFIG_FLAG + "="):
            return arg.split("=", 1)[1]
    return (os.environ if environ is None else environ).get("FOUNDRY_CONFIG") or None
