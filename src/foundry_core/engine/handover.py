"""One engine process's carried caches, from before its first compile to the end of its startup.

Order, the same for every engine (the plugin calls each step from its engine's hooks):

0. :func:`redirect_for_launch` in the launching process, before the engine starts its worker
   processes: they inherit the private directories through the environment, and so have them in
   place before they import anything that reads a cache variable once (FlashInfer, Inductor).
1. :meth:`CacheHandover.begin` in the worker, before it initialises CUDA or compiles anything:
   adopt the launcher's directories, or make them when the worker was started some other way.
2. LOAD, :meth:`CacheHandover.restore` (CUDA usable): verify the rank's caches archive and fill
   the directories. Missing: a log line, the engine builds as usual. Damaged, foreign or unpinned
   while the graphs are pinned: in ``auto`` mode a warning and the engine builds as usual; in
   ``load`` mode a one-line error.
3. SAVE, :meth:`CacheHandover.save` (after the engine's startup compiles, before the record that
   marks the SAVE finished): store the directories as the rank's caches archive. Engines go on
   building kernels at their first requests (SGLang's server warmup runs the first prefill), so
   :meth:`CacheHandover.served`, called after each served batch, saves again on a background
   thread when the directories gained files (checked after batches 1, 2, 4, ... 1024).
4. Either mode, :meth:`CacheHandover.finish`: count the files this process added to the
   directories or rewrote (its compilations) for the start report.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..archive import ArchiveError, ArchiveNotFound
from . import caches, launch_env
from .decide import one_line

logger = logging.getLogger("foundry.caches")


# The variables redirect_for_launch changed in this process, with their earlier values (None:
# unset), so that a later launch in the same process starts from the user's environment.
_launch_env: dict[str, str | None] = {}
_launch_dirs: list[caches.CacheDirs] = []  # the folders the last launch holds (their lock)


def redirect_for_launch(
    cfg: Any,
    kinds: Iterable[str],
    *,
    engine: dict | None = None,
    launcher_records: dict[str, tuple[str, ...]] | None = None,
    settings: Mapping[str, tuple[str, str]] | None = None,
    log: logging.Logger | None = None,
) -> caches.CacheDirs | None:
    """In the launching process: make the private directories and export them (and
    :data:`caches.DIR_ENV`) for the engine processes it starts. None when caches are not carried.
    Files are handed over later, by each worker's :meth:`CacheHandover.restore`, except the
    ``launcher_records``: records the launching process itself reads before it starts the workers
    (vLLM's model-inspection records, whose absence costs a subprocess that imports the engine),
    handed over here when a LOAD may follow (:func:`caches.unpack_engine_records`). ``settings``
    are the engine's environment settings for a shorter start (:func:`launch_env.apply`)."""
    undo_launch_redirect()
    if settings:
        launch_env.apply(settings, log)
    if not getattr(cfg, "carry_caches", True):
        return None
    dirs = caches.CacheDirs.create(kinds, label=_label(cfg))
    before = {name: os.environ.get(name) for name in dirs.environment()}
    _launch_env.update(before)
    dirs.redirect()
    _launch_dirs.append(dirs)
    seed_triton_helpers(dirs, before.get("TRITON_CACHE_DIR"), log or logger)
    if launcher_records and engine is not None and cfg.mode != "save":
        _launcher_records(cfg, dirs, engine, launcher_records, log or logger)
    return dirs


#: Triton's host-side helper modules, built with the system C compiler when Triton's CUDA driver is
#: first created in a process and found by content key in its cache folder after that.
TRITON_HELPERS = ("cuda_utils",)


def seed_triton_helpers(dirs: caches.CacheDirs, user_dir: str | None, log: logging.Logger) -> int:
    """Copy the Triton helper modules this launching process's own Triton folder holds into the
    workers' private Triton folder, under the same content keys. An engine whose workers import
    Triton's CUDA driver before their carried caches are handed over (SGLang's schedulers do, at
    import) would otherwise build them again with the C compiler at every start, where stock
    workers find the launcher's copy in the shared folder: these are the files stock loads. Their
    folder: ``user_dir`` (the user's TRITON_CACHE_DIR), else TRITON_HOME's or HOME's ``.triton/cache``.
    Returns the number of files copied; nothing is read from the archive here."""
    import shutil
    import sysconfig

    if "triton" not in dirs.kinds:
        return 0
    source = Path(user_dir or os.path.join(os.environ.get("TRITON_HOME") or Path.home(), ".triton", "cache"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    copied = 0
    for name in TRITON_HELPERS:
        for found in sorted(source.glob(f"*/{name}{suffix}")):
            target = dirs.path("triton") / found.parent.name / found.name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(found, target)
            except OSError as e:  # the worker builds it then, as it would without this
                log.debug("Foundry: %s not copied into the private Triton folder (%s)", found, e)
                continue
            copied += 1
    if copied:
        log.info(
            "Foundry: %d Triton helper module(s) of this machine put in the private Triton folder", copied
        )
    return copied


def _launcher_records(
    cfg: Any, dirs: caches.CacheDirs, engine: dict, wanted: dict[str, tuple[str, ...]], log: logging.Logger
) -> None:
    # Rank 0's caches: the launcher is one process per node, and these records depend on the engine's
    # source, not on the rank. Whatever goes wrong here is the worker's to judge (its restore applies
    # the refusal policy); the launcher then inspects the model as it would without Foundry.
    if _pin_problem(cfg, 0) is not None:
        return  # unpinned caches are not used at all; the worker's restore says why
    try:
        n = caches.unpack_engine_records(
            cfg.rank_caches_dir(0),
            dirs,
            wanted,
            engine=engine,
            expected_digest=cfg.caches_digest_for_rank(0),
            trusted_root=cfg.archive_dir,
        )
    except (ArchiveError, OSError) as e:
        log.debug("Foundry: no launcher records from the carried caches (%s)", one_line(e, 300))
        return
    if n:
        log.info("Foundry: %d launcher records handed to the engine from the carried caches", n)


def _pin_problem(cfg: Any, rank: int) -> str | None:
    """Why rank's carried caches may not be used under the configuration's pins, or None."""
    if getattr(cfg, "archive_digests", ()) and cfg.caches_digest_for_rank(rank) is None:
        return "trust.archive_digest pins the graphs but trust.caches_digest does not pin these caches"
    return None


def undo_launch_redirect() -> None:
    """Put back the cache variables and settings an earlier :func:`redirect_for_launch` in this
    process changed (an engine launched after it, with Foundry off, compiles where it would have
    without Foundry)."""
    launch_env.undo()
    launch_env.restore(_launch_env)
    caches.sync_pgo_job_id()
    while _launch_dirs:  # that launch is over: a later one may use the same folder again
        _launch_dirs.pop().close()


def _label(cfg: Any) -> str:
    """The private folder's name: the same for every start that uses this archive directory."""
    return "archive-" + hashlib.sha256(str(cfg.archive_dir).encode()).hexdigest()[:16]


class CacheRefused(ArchiveError):
    """``mode = "load"`` and the carried caches cannot be used; one line."""


class CacheHandover:
    """Carried caches of one rank. ``kinds`` names the caches the engine uses (:data:`caches.KINDS`);
    ``engine`` holds the engine facts the caches are valid for (name and version)."""

    def __init__(
        self,
        cfg: Any,
        rank: int,
        kinds: Iterable[str],
        engine: dict,
        world_size: int = 1,
        log: logging.Logger | None = None,
    ):
        self.log = log or logger  # the engine's logger: its handlers show these lines
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.kinds = tuple(kinds)
        self.engine = dict(engine)
        self.path = cfg.rank_caches_dir(rank)
        self.dirs: caches.CacheDirs | None = None
        self.report: dict[str, Any] = {"archive": str(self.path), "carried": False}
        self._saved: dict[str, dict[str, int]] | None = None  # what the last save() stored
        self._batches = 0
        self._saving = threading.Lock()
        self._restored = False  # LOAD handed carried caches over
        self._warned_rebuilt = False

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.cfg, "carry_caches", True))

    def begin(self) -> None:
        """Step 1: private directories, the engine's variables pointed at them (idempotent)."""
        if not self.enabled:
            self.report["carried"] = None
            return
        if self.dirs is None:
            self.dirs = caches.CacheDirs.inherited(self.kinds) or caches.CacheDirs.create(
                self.kinds, label=f"{_label(self.cfg)}-rank{self.rank}"
            )
        self.dirs.redirect()
        self.report["dir"] = str(self.dirs.root)

    def restore(self, device: int) -> bool:
        """Step 2 (LOAD): fill the directories from the verified caches archive; whether it did.
        Its time, whatever the outcome, is the report's ``restore_s`` (a step of the start's
        critical path, :mod:`foundry_core.engine.startsteps`)."""
        if self.dirs is None:
            return False
        t0 = time.perf_counter()
        try:
            return self._restore(device)
        finally:
            self.report["restore_s"] = round(time.perf_counter() - t0, 4)

    def _restore(self, device: int) -> bool:
        reason = _pin_problem(self.cfg, self.rank)
        if reason is None:
            t0 = time.perf_counter()
            try:
                summary = caches.unpack(
                    self.path,
                    self.dirs,
                    device=device,
                    engine=self.engine,
                    rank=self.rank,
                    world_size=self.world_size,
                    expected_digest=self.cfg.caches_digest_for_rank(self.rank),
                    trusted_root=self.cfg.archive_dir,
                )
            except ArchiveNotFound:
                self.log.info(
                    "Foundry rank %d: the archive carries no compile caches (%s); the engine builds them",
                    self.rank,
                    self.path,
                )
                self.report["missing"] = True
                return False
            except ArchiveError as e:
                reason = one_line(e, 300)
            else:
                self.report.update(
                    carried=True,
                    digest=summary["digest"],
                    kinds=summary["kinds"],
                    unpack_s=round(time.perf_counter() - t0, 3),
                )
                self._restored = True
                files = sum(k.get("files", 0) for k in summary["kinds"].values())
                self.log.info(
                    "Foundry rank %d: %d carried cache files handed to the engine (%s) in %.2f s",
                    self.rank,
                    files,
                    ", ".join(sorted(summary["kinds"])),
                    self.report["unpack_s"],
                )
                return True
        self.report["refused"] = reason
        if self.cfg.mode == "load":
            raise CacheRefused(
                f"Foundry: carried caches {self.path} refused ({reason}); mode=load cannot go on"
            )
        self.log.warning(
            "Foundry rank %d: carried caches %s refused (%s); the engine compiles as usual",
            self.rank,
            self.path,
            reason,
        )
        return False

    def save(self, device: int) -> dict[str, Any] | None:
        """Step 3 (SAVE): store the directories as this rank's caches archive."""
        if self.dirs is None:
            return None
        t0 = time.perf_counter()
        listing = self.dirs.files()
        try:
            summary = caches.pack(
                self.path,
                self.dirs,
                listing=listing,
                device=device,
                engine=self.engine,
                rank=self.rank,
                world_size=self.world_size,
            )
        except (ArchiveError, OSError) as e:  # the graphs are saved; a LOAD then compiles as usual
            self.report["error"] = one_line(e, 300)
            self.log.warning(
                "Foundry rank %d: compile caches not saved (%s)", self.rank, self.report["error"]
            )
            return None
        self._saved = listing
        self.report.update(
            carried=True,
            digest=summary["digest"],
            kinds=summary["kinds"],
            pack_s=round(time.perf_counter() - t0, 3),
        )
        self.log.info(
            "Foundry rank %d: compile caches saved to %s (%s) in %.2f s",
            self.rank,
            self.path,
            ", ".join(f"{k} {v['files']} files" for k, v in sorted(summary["kinds"].items())),
            self.report["pack_s"],
        )
        return summary

    def served(self, device: int) -> threading.Thread | None:
        """After each batch the engine served. SAVE: at batches 1, 2, 4, ... 1024, save the caches
        again (on a thread, so serving goes on) if the engine built anything since the last save.
        LOAD: after the first batch (the server's warmup, which SAVE's carried caches cover), say once
        what it built (:meth:`finish`), which the report at the end of the start cannot see yet.
        Returns the thread when one was started."""
        if self._saved is None and not self._restored:
            return None
        self._batches += 1
        n = self._batches
        if self._saved is None:
            if n != 1:
                return None
            target: Any = self.finish
        else:
            if n > 1024 or n & (n - 1):
                return None
            target = functools.partial(self._save_again, device)
        thread = threading.Thread(target=target, name="foundry-caches", daemon=True)
        thread.start()
        return thread

    def _save_again(self, device: int) -> None:
        if not self._saving.acquire(blocking=False):
            return  # the previous save is still writing; a later checkpoint looks again
        try:
            if self.dirs is None or self.dirs.files() == self._saved:
                return
            before = sum(len(v) for v in self._saved.values())
            if self.save(device) is not None:
                self.report["late_saves"] = self.report.get("late_saves", 0) + 1
                after = sum(len(v) for v in self._saved.values())
                self.log.info(
                    "Foundry rank %d: %d cache files built while serving were added to %s",
                    self.rank,
                    after - before,
                    self.path,
                )
        except Exception as e:  # never take serving down
            self.log.warning("Foundry rank %d: compile caches not saved again (%s)", self.rank, e)
        finally:
            self._saving.release()

    def finish(self) -> dict[str, Any]:
        """Step 4: the files this process added to the directories, per kind (its compilations).
        A LOAD that compiled although the caches were handed over says so once, with a warning: the
        engine's cache keys changed since the SAVE, and the start paid for it."""
        if self.dirs is not None:
            self.report["new_files"] = new = self.dirs.new_files()
            if self._restored and new["total"] and not self._warned_rebuilt:
                self._warned_rebuilt = True
                built = ", ".join(
                    f"{k} {n}" for k, n in sorted(new.items()) if n and k not in ("total", "rewritten")
                )
                self.log.warning(
                    "Foundry rank %d: the engine built %d cache files although the carried caches were "
                    "handed over (%s): a setting or environment variable it hashes into its cache keys "
                    "differs from the SAVE's (with vLLM 0.26: HOME); docs/cold-start.md",
                    self.rank,
                    new["total"],
                    built,
                )
        return self.report
