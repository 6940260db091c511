"""``--enable-foundry`` / ``--foundry-config``: from SGLang's parser to every scheduler process.

The two flags are not ``ServerArgs`` fields (the record's field set is fixed when SGLang builds it),
so they travel as attributes in the record's instance dictionary. SGLang keeps that dictionary when
it pickles the record into its scheduler subprocesses (``ServerArgs.__reduce__`` in 0.5.20+, plain
instance pickling before), so the settings reach the schedulers with the record itself. With the flag
off nothing is attached: the record is exactly what SGLang alone would have built.

As a second channel, the launching process exports ``FoundryConfig.to_env()`` plus
:data:`ENV_MARKER` before SGLang spawns its subprocesses: the marker is what makes a subprocess
install the worker hooks at plugin-load time (before ``ServerArgs`` reaches it), and the variables
are the fallback when a record arrives without the attributes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ENABLE_ATTR = "enable_foundry"
CONFIG_ATTR = "foundry_config"
MODE_ATTR = (
    "foundry_mode"  # the concrete mode the launcher decided for "auto" (save|load, or one per DP replica)
)
ENV_MARKER = "FOUNDRY_SGLANG"
#: The launcher's modes of the data-parallel replicas where they differ (``load,save``:
#: archive.decide_mode); FOUNDRY_MODE, read by foundry_core's config, keeps the configured mode then.
REPLICA_MODES_ENV = "FOUNDRY_SGLANG_REPLICA_MODES"
#: Test aid, not for serving: "1" puts every scheduler of a Foundry launch (tensor- and
#: data-parallel ranks) on the first GPU (SGLang has no option for it), so that the whole TP and DP
#: path but NVLink runs on a one-GPU machine. The ranks time-slice the GPU: timings mean nothing.
SHARE_GPU_ENV = "FOUNDRY_SGLANG_SHARE_GPU"
ENV_KEYS = (
    "FOUNDRY_MODE",
    "FOUNDRY_ARCHIVE_DIR",
    "FOUNDRY_REGION_BASE",
    "FOUNDRY_REGION_SIZE",
    "FOUNDRY_ARCHIVE_DIGEST",
    "FOUNDRY_CONFIG",
    REPLICA_MODES_ENV,
)


def add_cli_args(parser: Any) -> None:
    """Add the two flags to an SGLang argument parser (idempotent per parser)."""
    known = {a for action in parser._actions for a in action.option_strings}
    if "--enable-foundry" in known:
        return
    parser.add_argument(
        "--enable-foundry",
        action="store_true",
        default=False,
        help="Persist decode CUDA graphs with Foundry: SAVE once, LOAD at later starts (needs --foundry-config).",
    )
    parser.add_argument(
        "--foundry-config",
        type=str,
        default=None,
        metavar="PATH",
        help="Foundry TOML file: mode (save|load|auto), archive_dir, [region] base/size.",
    )


def attach(server_args: Any, enable: bool, config_path: str | os.PathLike | None) -> None:
    """Record the flags on a ``ServerArgs`` instance; does nothing when both are unset."""
    if not enable and config_path is None:
        return
    _set(server_args, ENABLE_ATTR, bool(enable))
    _set(server_args, CONFIG_ATTR, None if config_path is None else os.fspath(config_path))


def _set(server_args: Any, name: str, value: Any) -> None:
    try:
        import msgspec
    except ImportError:  # dataclass releases
        object.__setattr__(server_args, name, value)
        return
    if isinstance(server_args, msgspec.Struct):
        # ServerArgs.__setattr__ seals the record once resolution starts; these attributes are not
        # configuration fields, so they are written straight into the instance dictionary.
        msgspec.Struct.__setattr__(server_args, name, value)
    else:
        object.__setattr__(server_args, name, value)


@dataclass(frozen=True)
class Requested:
    """What the operator asked for on one ``ServerArgs`` record."""

    enabled: bool
    config_path: str | None
    mode: str | None  # concrete mode decided by the launcher, None before that


def requested(server_args: Any) -> Requested:
    d = getattr(server_args, "__dict__", {})
    return Requested(
        enabled=bool(d.get(ENABLE_ATTR, False)),
        config_path=d.get(CONFIG_ATTR),
        mode=d.get(MODE_ATTR),
    )


def load(server_args: Any):
    """The validated :class:`FoundryConfig` for a record with Foundry enabled.

    Raises ``ConfigError`` (one line) for a missing/invalid file or ``--foundry-config`` without
    ``--enable-foundry``. Falls back to the environment when the record carries no settings.
    """
    from foundry_core.config import ConfigError, config_from_env, load_config

    req = requested(server_args)
    if req.config_path is not None and not req.enabled:
        raise ConfigError("--foundry-config is set but --enable-foundry is not; add --enable-foundry")
    if req.enabled:
        if req.config_path is None:
            raise ConfigError("--enable-foundry needs --foundry-config PATH (a Foundry TOML file)")
        return load_config(req.config_path)
    return config_from_env() if os.environ.get(ENV_MARKER) == "1" else None


def set_mode(server_args: Any, mode: str) -> None:
    _set(server_args, MODE_ATTR, mode)


def export_env(cfg: Any, mode: str) -> dict[str, str]:
    """Put the settings in this process's environment for the subprocesses SGLang spawns next
    (after :func:`clear_env`, so no key of an earlier launch survives)."""
    env = cfg.to_env()
    if "," in mode:  # one mode per data-parallel replica
        env[REPLICA_MODES_ENV] = mode
    else:
        env["FOUNDRY_MODE"] = mode
    env[ENV_MARKER] = "1"
    os.environ.update(env)
    return env


def clear_env() -> None:
    """Drop settings a previous Foundry-enabled launch in this process exported (its compile-cache
    folders included)."""
    from foundry_core.engine import undo_launch_redirect

    undo_launch_redirect()
    if os.environ.get(ENV_MARKER) != "1":
        return
    for key in (ENV_MARKER, *ENV_KEYS):
        os.environ.pop(key, None)


def worker_enabled() -> bool:
    """Whether this process was spawned by a Foundry-enabled launch (read at plugin-load time)."""
    return os.environ.get(ENV_MARKER) == "1"


def share_gpu() -> bool:
    return os.environ.get(SHARE_GPU_ENV, "").strip() == "1"
