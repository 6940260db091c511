"""Foundry's own steps on a start's critical path, each timed, in the start report.

Everything a LOAD adds before the engine can go on (settling the mode in the launcher, the
session's set-up, the archive check, the carried-cache hand-over, the decision itself) is time the
same start without Foundry would not spend. :class:`StartSteps` times each such step into the rank's
start report under ``foundry_steps_s`` and sums them in ``foundry_critical_s``, against a budget of
:data:`BUDGET_S` per rank; a start over budget names its slowest steps in ``foundry_over_budget``
and says so in one log line. Work Foundry overlaps with the engine (read-ahead, the Triton key, the
archive's preparation) and the graph restore (which replaces a capture) are not on this clock.

The launching process's share (SGLang's launcher settles the mode before it starts the
schedulers) travels to the ranks in :data:`LAUNCH_ENV` (:func:`export_launch`), so that each
rank's report holds its whole critical path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

#: Foundry's critical-path time per rank a LOAD may spend (seconds).
BUDGET_S = 0.3
STEPS_KEY = "foundry_steps_s"
TOTAL_KEY = "foundry_critical_s"
OVER_KEY = "foundry_over_budget"
#: The launching process's steps, as JSON ``{"launcher.<step>": seconds}``.
LAUNCH_ENV = "FOUNDRY_LAUNCH_STEPS_S"

logger = logging.getLogger("foundry.engine")


class StartSteps:
    """Timings of one rank's Foundry steps, kept in ``report`` as they are taken."""

    def __init__(self, report: dict[str, Any], *, launch: bool = True):
        self.report = report
        self.steps: dict[str, float] = report.setdefault(STEPS_KEY, {})
        if launch:
            for name, seconds in launch_steps().items():
                self.steps.setdefault(name, seconds)

    def add(self, name: str, seconds: float) -> None:
        self.steps[name] = round(self.steps.get(name, 0.0) + max(0.0, seconds), 4)

    def add_all(self, steps: Mapping[str, float], prefix: str = "") -> None:
        for name, seconds in steps.items():
            self.add(prefix + name, seconds)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def close(self, rank: int | None = None, log: logging.Logger | None = None) -> float:
        """Sum the steps into the report; over budget, name the slowest steps (one log line)."""
        total = round(sum(self.steps.values()), 4)
        self.report[TOTAL_KEY] = total
        self.report["foundry_budget_s"] = BUDGET_S
        if total > BUDGET_S:
            slowest = sorted(self.steps.items(), key=lambda kv: -kv[1])[:3]
            self.report[OVER_KEY] = [name for name, _ in slowest]
            (log or logger).info(
                "Foundry rank %s: %.2f s on the start's critical path, over the %.2f s budget (%s)",
                "?" if rank is None else rank,
                total,
                BUDGET_S,
                ", ".join(f"{n} {s:.2f} s" for n, s in slowest),
            )
        else:
            self.report.pop(OVER_KEY, None)
        return total


def export_launch(steps: Mapping[str, float], environ: dict[str, str] | None = None) -> None:
    """In the launching process, before it starts the engine's processes: its steps for their reports."""
    value = json.dumps({f"launcher.{k}": round(float(v), 4) for k, v in steps.items()})
    if environ is not None:
        environ[LAUNCH_ENV] = value
        return
    from .launch_env import set_for_launch

    set_for_launch(LAUNCH_ENV, value)  # gone again at the next launch in this process


def launch_steps(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The launching process's steps (empty where none were exported or they cannot be read)."""
    raw = (os.environ if environ is None else environ).get(LAUNCH_ENV)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        return {str(k): float(v) for k, v in data.items() if str(k).startswith("launcher.")}
    except (ValueError, TypeError, AttributeError):
        return {}
