"""Engine settings that shorten a start, set for Foundry's starts where the user chose nothing.

A plugin names environment variables its engine reads at start-up whose defaults cost a cold start
time, each with the value Foundry wants and the reason (vLLM:
``foundry_vllm_plugin.session.launch_settings``).
:func:`apply` runs in the launching process, before the engine starts its worker processes (which
inherit the environment): a variable the user set is left as it is; the others are set, recorded
for :func:`undo` (a later engine launched from the same Python process with Foundry off starts as
it would have), and named in one log line.

"Set by the user" means present in the process's environment when it started. An engine's command
line may assign its own default into ``os.environ`` before it loads plugins (vLLM's CLI does, for
its process start method), so the current environment cannot tell the two apart; Linux keeps the
environment a process started with in ``/proc/self/environ``. Where that cannot be read, a variable
present now counts as the user's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger("foundry.engine")

#: The variables :func:`apply` changed in this process, with their earlier values (None: unset).
_changed: dict[str, str | None] = {}


def initial_environment() -> dict[str, str] | None:
    """The environment this process started with, or None where the platform does not keep it."""
    try:
        raw = open("/proc/self/environ", "rb").read()  # noqa: SIM115 - one read of a proc file
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            out[os.fsdecode(name)] = os.fsdecode(value)
    return out


def apply(settings: Mapping[str, tuple[str, str]], log: logging.Logger | None = None) -> dict[str, str]:
    """Set each ``name -> (value, reason)`` the user did not set at start; return what was set."""
    log = log or logger
    initial = initial_environment()
    chosen = set(os.environ) if initial is None else set(initial)
    done: dict[str, str] = {}
    for name, (value, reason) in settings.items():
        if name in chosen:
            if os.environ.get(name) != value:
                log.info(
                    "Foundry: %s=%s kept as set (Foundry would set %s: %s)",
                    name,
                    os.environ.get(name),
                    value,
                    reason,
                )
            continue
        if os.environ.get(name) == value:
            continue
        _changed.setdefault(name, os.environ.get(name))
        os.environ[name] = value
        done[name] = value
    if done:
        log.info(
            "Foundry: engine settings for a shorter start: %s (each kept where set by the user; docs/cold-start.md)",
            ", ".join(f"{n}={v} ({settings[n][1]})" for n, v in done.items()),
        )
    return done


def set_for_launch(name: str, value: str) -> None:
    """Set a variable of Foundry's own for the engine's processes of this launch; :func:`undo` (at
    the next launch in this process) removes it again."""
    _changed.setdefault(name, os.environ.get(name))
    os.environ[name] = value


def undo() -> None:
    """Put back the variables :func:`apply` changed in this process."""
    restore(_changed)


def restore(saved: dict[str, str | None]) -> None:
    """Put each saved variable back (None: unset it) and empty ``saved``."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    saved.clear()
