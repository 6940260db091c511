"""SAVE or LOAD for one rank: verify the archive before any memory exists, and what a refusal means.

The plugins decide ``auto`` from their own records (an archive saved for exactly this
configuration). When the answer is LOAD, :func:`verify_archive` checks the rank's graph archive the
way ``foundry_core.load`` will (files, checksums, location, pinned digest, machine and engine
fingerprint), reading GPU properties only. :func:`after_refusal` then applies the one policy both
engines follow: in ``auto`` mode a single-rank engine falls back to a fresh SAVE with a warning;
with several ranks (which must size their memory pools alike) or in ``load`` mode the start stops
with one line. :func:`after_load_failure` is the same policy for a restore that fails later, at the
graph phase: there an ``auto`` start captures and serves without saving.

Every such fallback goes through :func:`fall_back`: exactly one WARNING line with the reason, which
the plugin records in its start report (``fallback``). With ``strict = true`` in the configuration,
``auto`` refuses instead of falling back: the same line, raised as a one-line error.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import ConfigError

logger = logging.getLogger("foundry.engine")


class ArchiveRefused(ConfigError):
    """A start that cannot go on because its archive was refused; the message is one line."""


def one_line(error: BaseException, limit: int = 500) -> str:
    """The error on one line; a long one keeps its start and its end (where the reason usually is)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    head = limit * 2 // 5
    return f"{text[:head]} ... {text[-(limit - head - 5) :]}"


def save_error(error: BaseException) -> str:
    """A failed SAVE's reason on one line; an error Foundry did not foresee (neither Foundry's own nor
    the operating system's) keeps its type name, which is then most of what it says."""
    from ..errors import FoundryError

    text = one_line(error)
    return text if isinstance(error, (FoundryError, OSError)) else f"{type(error).__name__}: {text}"


def verify_archive(
    cfg: Any, rank: int, *, device: int, fingerprint: dict, world_size: int
) -> tuple[Any, str | None]:
    """``(verified archive, None)`` when rank's archive would load here, ``(None, reason)`` when it
    is refused. A bad pin table in the configuration raises (it is not the archive's fault)."""
    import foundry_core as fc

    expected_digest = cfg.digest_for_rank(rank)
    try:
        verified = fc.verify(
            cfg.rank_archive_dir(rank),
            device=device,
            fingerprint_model=fingerprint,
            rank=rank,
            world_size=world_size,
            expected_digest=expected_digest,
            trusted_root=cfg.archive_dir,  # checked first, as fc.load does
            # Inflating (most of the check's time) is left to a thread started after Foundry's
            # steps (prewarm.start), and runs on while the engine loads its weights.
            inflate=False,
        )
    except fc.ArchiveError as e:
        return None, one_line(e)
    return verified, None


def after_refusal(
    cfg: Any,
    rank: int,
    world_size: int,
    reason: str,
    error: type = ArchiveRefused,
    log: logging.Logger | None = None,
) -> str:
    """Apply the refusal policy; returns the warning line (logged on ``log``, the engine's logger)
    when the start goes on as a SAVE. Call it outside any ``except`` block, so that the one line is
    not chained to a traceback."""
    head = f"Foundry rank {rank}: archive {cfg.rank_archive_dir(rank)} refused ({reason})"
    return _auto_single_rank_goes_on(
        cfg,
        world_size,
        head,
        stopped="mode = load cannot go on: SAVE again (mode = save or auto)",
        several=f"auto mode saves again only on a single-rank engine, this one has {world_size} ranks "
        "(they must size their memory pools alike): start once with mode = save",
        going_on="capturing and saving a fresh one",
        error=error,
        log=log,
    )


def after_load_failure(
    cfg: Any,
    rank: int,
    world_size: int,
    error: BaseException,
    fail: type = ArchiveRefused,
    log: logging.Logger | None = None,
) -> str:
    """A LOAD whose archive was accepted but whose restore failed at the graph phase
    (``foundry_core.load`` raised: placement, a graph the driver would not build, ...; it leaves the
    region as it found it). In ``auto`` mode a single-rank engine captures its graphs as stock would
    and serves, with a warning; nothing is saved by that start (a LOAD keeps no code images) and the
    archive is left as it is (another replica may load it; the next start tries it again). With
    several ranks (the others restore theirs) or in ``load`` mode the start stops with one line.
    Returns the warning line; call it outside any ``except`` block, as :func:`after_refusal`."""
    head = f"Foundry rank {rank}: LOAD of {cfg.rank_archive_dir(rank)} failed at the graph phase ({save_error(error)})"
    return _auto_single_rank_goes_on(
        cfg,
        world_size,
        head,
        stopped="mode = load cannot go on",
        several=f"auto mode captures instead only on a single-rank engine, this one has {world_size} ranks",
        going_on="capturing the graphs as stock would and serving (nothing saved by this start)",
        error=fail,
        log=log,
    )


def _auto_single_rank_goes_on(
    cfg: Any,
    world_size: int,
    head: str,
    *,
    stopped: str,
    several: str,
    going_on: str,
    error: type,
    log: logging.Logger | None,
) -> str:
    """The one policy of both: ``auto`` on a single rank goes on (``going_on``), with a warning, and
    returns that line; ``load`` mode (``stopped``) or several ranks (``several``) raise ``error``."""
    if cfg.mode != "auto":
        raise error(f"{head}; {stopped}")
    if world_size > 1:
        raise error(f"{head}; {several}")
    return fall_back(cfg, head, going_on, error, log)


def fall_back(
    cfg: Any, head: str, going_on: str, error: type = ArchiveRefused, log: logging.Logger | None = None
) -> str:
    """``auto`` mode going on without what Foundry would have done (``head``: what happened;
    ``going_on``: what the start does instead). Logs exactly one WARNING line and returns it, for
    the start report; with ``strict = true`` raises ``error`` with that line instead."""
    if getattr(cfg, "strict", False):
        raise error(f"{head}; strict = true: auto mode stops instead of {going_on}")
    line = f"{head}; {going_on}"
    (log or logger).warning("%s", line)
    return line


def archive_dir_problem(cfg: Any) -> str | None:
    """Why a SAVE could not write under ``cfg.archive_dir`` (missing and not creatable, read-only,
    not a directory), or None. Checked at startup, before the engine does any work."""
    import os
    import tempfile

    path = cfg.archive_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".foundry-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"archive_dir {path} is not writable ({e.strerror or e})"
    return None


def save_blocked(cfg: Any, rank: int, log: logging.Logger | None = None) -> str | None:
    """A rank that resolved ``auto`` to SAVE, at its decision: why its SAVE cannot be written
    (:func:`archive_dir_problem`), said now in a warning instead of after the capture, or None. The
    engine then captures and serves as it would alone and skips the SAVE's work (with ``strict =
    true``: :class:`ArchiveRefused` instead); ``save`` mode refused such a directory at startup
    already."""
    if getattr(cfg, "mode", None) != "auto":
        return None
    problem = archive_dir_problem(cfg)
    if problem is not None:
        fall_back(
            cfg,
            f"Foundry rank {rank}: {problem}",
            "auto mode serves with the graphs it captures and saves nothing this time",
            log=log,
        )
    return problem


def save_failed(cfg: Any, rank: int, error: BaseException, log: logging.Logger | None = None) -> None:
    """A SAVE that could not be written (disk full, read-only, ...): in ``auto`` mode the engine
    goes on serving with the graphs it captured, with a warning, and the next start captures
    again; in ``save`` mode the error stands. Nothing partial is left either way (the archive
    writer publishes atomically). With ``strict = true`` the error stands in ``auto`` mode too."""
    if cfg.mode != "auto" or getattr(cfg, "strict", False):
        raise error
    fall_back(
        cfg,
        f"Foundry rank {rank}: SAVE failed ({save_error(error)})",
        "serving with the graphs just captured, nothing saved",
        log=log,
    )


def record_stamp(path: Any) -> tuple[int, int, int] | None:
    """Which file the record at ``path`` is (inode, modification time, size), or None when absent:
    taken when a rank decides SAVE, compared by :func:`published_meanwhile` before it publishes."""
    import os

    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def published_meanwhile(cfg: Any, path: Any, stamp_at_decision: Any, finished_here: bool) -> bool:
    """``auto`` mode, just before a SAVE publishes: whether another process (a second replica an
    autoscaler started at the same moment) finished a SAVE of this exact configuration since this
    rank decided to SAVE. ``finished_here``: the record now at ``path`` marks a finished SAVE with
    this configuration's fingerprint. Then this rank keeps that archive instead of replacing it, so
    exactly one SAVE publishes. A record that was already there when the rank decided (one whose
    archive was refused) does not count; ``mode = save`` always publishes."""
    if getattr(cfg, "mode", None) != "auto" or not finished_here:
        return False
    return record_stamp(path) not in (None, stamp_at_decision)


def archive_stamp(path: Any) -> tuple[int, int, int] | None:
    """Which published version the graph archive at ``path`` is (the identity of the manifest a
    publication puts in place), or None when there is none. A rank that decides SAVE in ``auto``
    mode takes it then and hands it to ``fc.save`` (:func:`save_guard`), and a SAVE takes it
    again right after its own publication and compares it before writing the engine record that
    marks the SAVE finished: a record is only ever written beside the archive it describes, never
    beside another replica's."""
    from foundry_core.archive import published_version

    return published_version(path)


#: How long an ``auto`` rank's SAVE waits for another process's SAVE of the same archive, which
#: holds the archive's lock only while it writes (about a second for the engines' archives on the
#: H200), before giving up with a warning and serving on.
AUTO_SAVE_LOCK_WAIT_S = 60.0


def save_guard(cfg: Any, stamp_at_decision: Any) -> dict[str, Any]:
    """The ``foundry_core.save`` arguments that make a rank's SAVE safe beside other replicas'.

    ``auto``: publish only over the graph archive that was there when the rank decided to SAVE
    (``expected_version``, :func:`archive_stamp` then), and wait for a SAVE that is writing it now
    (``lock_timeout``): of two replicas that decided at the same moment, the second finds the
    first's archive under the lock and keeps it (``ArchiveSuperseded``, nothing written), or
    publishes if the first failed. ``save`` mode replaces whatever is there, and is refused at once
    while another SAVE writes."""
    from foundry_core.archive import ANY_VERSION

    if getattr(cfg, "mode", None) == "auto":
        return {"expected_version": stamp_at_decision, "lock_timeout": AUTO_SAVE_LOCK_WAIT_S}
    return {"expected_version": ANY_VERSION, "lock_timeout": 0.0}
