"""What an engine plugin's ``register()`` may call at once: nothing heavy is imported here.

:func:`start_readahead` looks at the command line and the environment only; when they name a
Foundry configuration, one daemon thread imports the engine layer and starts the archive's
read-ahead (:mod:`foundry_core.engine.readahead`), so that ``register()`` itself pays a thread
start and the engine's imports run on while the files they need are read. Never raises.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .switches import switched_on

_started = False
#: Seconds from this process's start to each named point of Foundry's (:func:`mark`): where a
#: worker's start went before and after Foundry's own steps, in its start report.
MARKS: dict[str, float] = {}
_marks_pid = os.getpid()  # a forked child starts its own marks: its age counts from its own start


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc``, 10 ms steps), or None elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # The command name (field 2) may hold spaces: count the fields after its ")".
            started = int(f.read().rsplit(b")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", "rb") as f:
            return round(float(f.read().split()[0]) - started, 3)
    except (OSError, ValueError, IndexError):
        return None


def mark(name: str) -> None:
    """Note the process's age now under ``name`` (the first time in this process). Never raises."""
    global _marks_pid
    if _marks_pid != os.getpid():
        MARKS.clear()
        _marks_pid = os.getpid()
    if name not in MARKS:
        age = process_age()
        if age is not None:
            MARKS[name] = age


def start_readahead(log_name: str = "foundry") -> threading.Thread | None:
    global _started
    if _started or not switched_on("FOUNDRY_READAHEAD"):
        return None
    if os.environ.get("FOUNDRY_READAHEAD_STARTED"):  # the process that started this one reads ahead
        return None
    if not any(a == "--foundry-config" or a.startswith("--foundry-config=") for a in sys.argv) and not (
        os.environ.get("FOUNDRY_CONFIG")
    ):
        return None
    _started = True
    argv = list(sys.argv)

    def run() -> None:
        try:
            from foundry_core.engine import readahead

            readahead.run_for_launch(argv, log=logging.getLogger(log_name))
        except Exception as e:  # noqa: BLE001 - read-ahead is an optimisation; the start goes on
            logging.getLogger(log_name).debug("Foundry: read-ahead not started (%s)", e)

    try:
        thread = threading.Thread(target=run, name="foundry-readahead-config", daemon=True)
        thread.start()
    except Exception:  # noqa: BLE001 - register() never raises into the engine's plugin loader
        return None
    return thread
