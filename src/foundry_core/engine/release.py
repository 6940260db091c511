"""Which engine releases Foundry is tested with, and what a start on any other release does.

Foundry hooks engine internals that change between releases, so each plugin declares one tested
range (:data:`TESTED`). The plugin packages declare the same range as their engine dependency
(``packages/<engine>/pyproject.toml``), so pip refuses an engine outside it; :func:`gate` checks it
again at every Foundry start, before any GPU work, because an engine upgraded after Foundry (or
installed with ``--no-deps``) is not caught by pip.

A release outside the range is refused in one line naming the range. ``allow_untested_release =
true`` in the Foundry configuration lets a user go on at their own risk: one warning says so, and
every LOAD is then structure-checked (``[load] check_structure``: each restored graph is read back
from the driver and compared with the archive before the engine serves), since a changed engine may
build graphs that no longer match what was saved.

This module imports no engine and no torch: the plugins call it in every process they start.
"""

from __future__ import annotations

import dataclasses
import logging
from importlib import metadata
from typing import Any

from ..config import ConfigError

#: engine distribution -> the PEP 440 range of its releases Foundry is tested with.
TESTED = {"sglang": ">=0.5.23,<0.5.24", "vllm": ">=0.33.0,<0.34"}


class UntestedReleaseError(ConfigError):
    """The installed engine release lies outside the tested range; the message is one line."""


def installed_version(engine: str) -> str | None:
    """The engine's installed release, as its distribution metadata says; None when not installed."""
    try:
        return metadata.version(engine)
    except metadata.PackageNotFoundError:
        return None


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec``; a string that is no PEP 440 version never does.
    Pre-releases count as what they are (``0.34.0rc1`` is not ``<0.34``; ``0.33.1.dev3`` is in
    ``>=0.33.0,<0.34``), as pip judges an installed engine against the plugin's dependency."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(spec).contains(parsed, prereleases=True)


def gate(engine: str, cfg: Any, log: logging.Logger | None = None, version: str | None = None) -> Any:
    """The configuration a Foundry start on ``engine`` goes on with, or :class:`UntestedReleaseError`.

    ``version``: the release to judge (default: the installed one). In the tested range ``cfg`` is
    returned unchanged. Outside it the start is refused, unless ``cfg.allow_untested_release``: then
    ``log`` gets one warning and the returned configuration has ``check_structure`` on, so that
    every LOAD of this start is structure-checked."""
    spec = TESTED[engine]
    found = installed_version(engine) if version is None else version
    if found is not None and in_range(found, spec):
        return cfg
    shown = found if found is not None else "(not installed)"
    if not getattr(cfg, "allow_untested_release", False):
        raise UntestedReleaseError(
            f"Foundry is tested with {engine} {spec} but this is {engine} {shown}: install a release in "
            "that range (pip install foundry-graphs-" + engine + ") or set allow_untested_release = true "
            "in the Foundry config to try it at your own risk"
        )
    if log is not None:
        log.warning(
            "Foundry: %s %s is outside the tested range %s; going on at your own risk "
            "(allow_untested_release = true), every LOAD is structure-checked",
            engine,
            shown,
            spec,
        )
    if getattr(cfg, "check_structure", True):
        return cfg
    return dataclasses.replace(cfg, check_structure=True)
