"""How Foundry is switched on for one vLLM engine, and how that reaches every process.

The switch is one entry in vLLM's ``additional_config`` (a field of ``VllmConfig`` that vLLM pickles
to the engine-core and worker processes with the rest of the config)::

    additional_config = {"foundry": {"config": "/abs/path/foundry.toml"}}

``--enable-foundry`` / ``--foundry-config PATH`` on the command line are turned into exactly this entry;
from Python, pass it to ``vllm.LLM(..., additional_config=...)``.  The entry holds only the absolute
path of the TOML file, never anything that differs between a SAVE and a LOAD start: vLLM folds
``additional_config`` into ``VllmConfig.compute_hash()``, the key of its torch.compile cache, and a LOAD
start must hit the cache that its SAVE start filled.

This module imports nothing from vLLM or torch, so that it stays cheap in every process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from foundry_core.config import ConfigError, FoundryConfig, load_config

ADDITIONAL_CONFIG_KEY = "foundry"
_ENTRY_KEYS = {"config"}


def foundry_entry(additional_config: Any) -> dict | None:
    """The Foundry entry of a ``VllmConfig``/``EngineArgs`` ``additional_config``, or ``None`` (off)."""
    if not isinstance(additional_config, dict):
        return None
    entry = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ConfigError(
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a table like {{'config': 'foundry.toml'}}"
        )
    extra = sorted(set(entry) - _ENTRY_KEYS)
    if extra:
        raise ConfigError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: unknown key {extra[0]!r}")
    path = entry.get("config")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['config'] must be a TOML file path")
    return entry


def is_enabled(additional_config: Any) -> bool:
    return foundry_entry(additional_config) is not None


def make_entry(config_path: str | os.PathLike) -> dict:
    """The ``additional_config`` entry for a TOML file, validating the file now (one-line ConfigError)."""
    path = Path(os.path.expanduser(str(config_path))).resolve()
    load_config(path)
    return {"config": str(path)}


def entry_from_flags(
    enable: bool, config_path: str | None, environ: dict[str, str] | None = None
) -> dict | None:
    """Translate ``--enable-foundry`` / ``--foundry-config`` into the ``additional_config`` entry.

    With neither flag Foundry stays off and nothing is returned.  ``--enable-foundry`` alone takes
    the file from ``FOUNDRY_CONFIG``; ``--foundry-config`` alone is refused rather than ignored.
    """
    env = os.environ if environ is None else environ
    if not enable:
        if config_path:
            raise ConfigError("--foundry-config was given without --enable-foundry")
        return None
    if not config_path:
        config_path = env.get("FOUNDRY_CONFIG")
        if not config_path:
            raise ConfigError(
                "--enable-foundry needs --foundry-config PATH (or FOUNDRY_CONFIG in the environment)"
            )
    return make_entry(config_path)


def foundry_config(additional_config: Any) -> FoundryConfig | None:
    """The parsed Foundry configuration for an engine, or ``None`` when Foundry is off for it."""
    entry = foundry_entry(additional_config)
    if entry is None:
        return None
    return load_config(entry["config"])


__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ConfigError",
    "entry_from_flags",
    "foundry_config",
    "foundry_entry",
    "is_enabled",
    "make_entry",
]
