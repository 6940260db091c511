"""This process's age, for start reports and log lines (``foundry_core.early``'s marks, the
read-ahead's plan): a module of its own, importing nothing of Foundry's, so that both can use it."""

from __future__ import annotations

import os


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
