"""A LOAD's modules and graphs rebuilt ahead of the graph phase, while the engine sets itself up.

Both plugins call :func:`start` once the rank's archive is accepted and its region reserved, before
the engine loads weights and allocates its KV cache; they hand the result to ``foundry_core.load``
(``prepared=``) at the graph phase, which then only maps the memory, restores its contents and
waits for what the thread has not finished (``foundry_core.restore``). ``FOUNDRY_PREPARE=0`` turns
this off (everything is rebuilt at the graph phase, as without it): a switch for diagnosis.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..switches import switched_on
from .decide import one_line

#: "0" rebuilds at the graph phase instead of ahead of it.
ENV = "FOUNDRY_PREPARE"


def start(path: Any, *, cfg: Any, rank: int, device: int, archive: Any, log: logging.Logger) -> Any:
    """Start rebuilding rank ``rank``'s archive at ``path`` on a background thread; the
    ``foundry_core.Prepared`` for ``load``, or None (switched off, or it could not start: ``load``
    then rebuilds as usual). ``archive``: what verifying it returned, when the plugin has it."""
    if not switched_on(ENV):
        return None
    import foundry_core as fc

    try:
        return fc.prepare(
            path,
            device=device,
            archive=archive if isinstance(archive, fc.Archive) else None,
            expected_digest=cfg.digest_for_rank(rank),
            trusted_root=cfg.archive_dir,
        )
    except Exception as e:  # an optimisation only: load() rebuilds, and checks the archive itself
        log.warning("Foundry rank %d: graphs are rebuilt at the graph phase (%s)", rank, one_line(e))
        return None


def load(
    path: Any,
    *,
    cfg: Any,
    rank: int,
    world_size: int,
    region: Any,
    fingerprint: dict,
    archive: Any,
    prepared: Any,
    symmetric: Any = (),
):
    """The rank's LOAD at the graph phase: ``foundry_core.load`` with the rank's digest pin, the
    configured archive directory as the trusted root (the archive must resolve inside it), what
    verifying it returned (``archive``; None: it is read and checked here) and what :func:`start`
    began (``prepared``; None: the graphs are rebuilt here). With ``[load] check_structure``, every
    graph is then read back from the driver and compared with the archive (waiting for the ones still
    being built): one that differs fails the start, naming the graph and its first difference.
    ``symmetric``: the rank's torch symmetric memory (tensor parallelism), checked against SAVE's."""
    import foundry_core as fc

    restored = fc.load(
        path,
        region=region,
        fingerprint_model=fingerprint,
        rank=rank,
        world_size=world_size,
        expected_digest=cfg.digest_for_rank(rank),
        trusted_root=cfg.archive_dir,
        archive=archive,
        prepared=prepared,
        symmetric=symmetric,
    )
    if getattr(cfg, "check_structure", False):
        t0 = time.perf_counter()
        differences = restored.check()
        restored.timings["structure_check_s"] = time.perf_counter() - t0
        restored.timings["structure_differences"] = float(len(differences))
        if differences:
            name, why = next(iter(differences.items()))
            restored.unload()
            raise fc.GraphError(
                f"{len(differences)} of {len(restored.archive.meta['graphs'])} restored graphs differ "
                f"from archive {path}; {name}: {why}"
            )
    return restored


def report(timings: dict[str, Any]) -> dict[str, Any]:
    """What a start report says about the rebuild ahead: whether it succeeded (if not, everything
    was rebuilt at the graph phase, with a warning), whether it was ready when the graph phase came,
    how long that phase waited for it, how long it ran in the background, how many graphs had their
    memory nodes re-pointed after the mapping and how many were built only then, and how many it was
    still building when the graph phase ended (each waited for at its first replay); and how long
    ``[load] check_structure`` took, when it was on."""
    checked = (
        {"structure_check_s": round(float(timings["structure_check_s"]), 4)}
        if "structure_check_s" in timings
        else {}
    )
    if "prepared_s" not in timings and "tail_graphs" not in timings:
        return {"prepared": False, **checked}
    running = timings.get("prepared_s") is None  # still finishing graphs when this is reported
    return {
        "prepared": True,
        "prepared_ok": bool(timings.get("prepared_ok")),
        "prepared_ready": bool(timings.get("prepared_ready")),
        "prepare_wait_s": round(float(timings.get("prepare_wait_s", 0.0)), 4),
        "prepared_s": None if running else round(float(timings["prepared_s"]), 4),
        "graphs_retargeted": int(timings.get("retargeted_graphs", 0)),
        "graphs_deferred": int(timings.get("deferred_graphs", 0)),
        "graphs_after_return": int(timings.get("tail_graphs", 0)),
        **checked,
    }
