"""Opt-in host profile of one startup phase, for finding what a LOAD still spends its time on.

With ``FOUNDRY_PROFILE_DIR`` set, :func:`profiled` runs the phase under :mod:`cProfile` and writes
``<phase>-rank<r>.prof`` (for ``pstats`` / snakeviz) and ``<phase>-rank<r>.txt`` (the functions with
the most cumulative and own time) into that folder. Unset, it costs one environment lookup. The
profiler slows Python down several times over: a profiled start's timings are not its real ones.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

ENV = "FOUNDRY_PROFILE_DIR"
TOP = 60  # functions listed per ordering in the text summary

logger = logging.getLogger("foundry.profiling")


@contextlib.contextmanager
def profiled(phase: str, rank: int = 0, log: logging.Logger | None = None) -> Iterator[None]:
    folder = os.environ.get(ENV)
    if not folder:
        yield
        return
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        try:
            out = Path(folder)
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"{phase}-rank{rank}"
            profile.dump_stats(str(stem.with_suffix(".prof")))
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            for order in ("cumulative", "tottime"):
                stats.sort_stats(order).print_stats(TOP)
            stem.with_suffix(".txt").write_text(text.getvalue())
            (log or logger).info("Foundry: host profile of %s written to %s.txt", phase, stem)
        except OSError as e:  # a profile is never worth failing a start
            (log or logger).warning("Foundry: host profile of %s not written (%s)", phase, e)
