"""Read-ahead of what a start reads: recorded at SAVE, read in background threads at LOAD.

A cold LOAD spends most of its time before Foundry's own work: the engine's processes import
thousands of Python modules and map shared libraries of hundreds of MB, then read the weights. Each
read that misses the page cache stalls the importing thread on one small synchronous read. The SAVE
process knows which files that is; a LOAD can read them into the page cache on other threads
(other cores, deep I/O queues) while the engine's single importing thread is still on the first of
them, so that its reads hit memory.

* SAVE, :func:`record`: the files this process imported (the ``.pyc`` the import read, or the
  source, and extension modules), the shared libraries mapped into it (``/proc/self/maps``), the
  rank's graph archive (read and hashed by the LOAD's check), its carried caches and, when the plugin names them, the model's files (weights,
  configuration, tokenizer), each with its size and modification time, in import order, written as
  ``readahead-<role>.json`` beside the archive (:data:`PREFIX`). Each process that records writes
  its own list (SGLang: the launcher and each scheduler; vLLM: the API server and each worker).
* LOAD, :func:`start`: one daemon thread reads every list, drops what may not be read, and has
  :data:`THREADS` threads go through the rest, small files (modules, libraries) in recorded order
  before the model's: ``posix_fadvise(WILLNEED)`` on each (the kernel reads it into the page cache;
  no byte is copied into this process and the GIL is free meanwhile), or, with
  ``FOUNDRY_READAHEAD_MODE=read``, plain reads (for file systems that ignore the hint; they cost
  CPU time the engine's imports compete for: on a 2-core machine they slowed an import down). The first process of a launch that starts it marks the environment
  (:data:`STARTED_ENV`), so the processes it starts (which share the page cache) do not read the
  same files again.

Bad input never fails a start: a list that cannot be parsed is skipped with one log line, an entry
whose file is gone or differs from the SAVE's (size or mtime) is skipped on its own, and an entry
whose real path (symlinks resolved) is outside the trusted roots is refused: the archive directory,
this Python environment (its prefixes and import paths) and the model directory the SAVE recorded,
trusted only when this start names the same model (:func:`model_named`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("foundry.readahead")

#: The list files beside the archive: ``readahead-<role>.json``.
PREFIX = "readahead-"
FORMAT = 1
#: "0": no read-ahead at LOAD and no recording at SAVE.
ENV = "FOUNDRY_READAHEAD"
#: Set by the process that started the read-ahead of a launch; its children skip theirs.
STARTED_ENV = "FOUNDRY_READAHEAD_STARTED"
#: How the files are read ahead: "advise" (default) or "read" (:func:`mode`).
MODE_ENV = "FOUNDRY_READAHEAD_MODE"
#: "0": plan and read ahead on the launcher's own threads, not in a helper process (:mod:`.readahead_proc`).
HELPER_ENV = "FOUNDRY_READAHEAD_HELPER"
THREADS = 8
MAX_ENTRIES = 200_000  # a list longer than this is not a start's reads: skipped as damaged
CHUNK = 1 << 20
# A file swapped for a FIFO or a link after it was planned is not waited on, nor followed.
_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)
#: Model files worth reading ahead (weights, configuration, tokenizer), in the model directory.
MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".model", ".txt", ".tiktoken")
KINDS = ("module", "library", "archive", "caches", "model")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    # foundry_core.switches.switched_on, written out: the helper process loads this file alone
    return (os.environ if environ is None else environ).get(ENV, "1").strip() != "0"


# --- SAVE: what this process read --------------------------------------------------------------


def imported_files(modules: Mapping[str, Any] | None = None) -> list[str]:
    """The files the imports of this process read, in import order (``sys.modules`` keeps it)."""
    import importlib.util

    out: list[str] = []
    for module in list((sys.modules if modules is None else modules).values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path:
            continue
        if path.endswith(".py"):
            try:
                cached = importlib.util.cache_from_source(path)
            except (NotImplementedError, ValueError):
                cached = None
            if cached and os.path.isfile(cached):
                path = cached  # what the import read; the source is only stat-ed
        out.append(path)
    return out


def mapped_libraries(maps: str = "/proc/self/maps") -> list[str]:
    """The shared libraries mapped into this process (first mapping order)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and ".so" in os.path.basename(parts[5]):
            seen.setdefault(parts[5].strip(), None)
    return list(seen)


def model_files(model_dir: str | os.PathLike | None) -> list[str]:
    """The model's files worth reading ahead (top level of its directory; weights last)."""
    if model_dir is None or not os.path.isdir(model_dir):
        return []
    names = sorted(p for p in os.listdir(model_dir) if p.endswith(MODEL_SUFFIXES))
    names.sort(key=lambda n: n.endswith((".safetensors", ".bin", ".pt")))
    return [os.path.join(model_dir, n) for n in names]


def tree_files(root: str | os.PathLike) -> list[str]:
    out: list[str] = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in sorted(files))
    return out


def _entry(path: str, kind: str) -> dict[str, Any] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path) or st.st_size == 0:
        return None
    return {"path": os.path.realpath(path), "kind": kind, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def collect(
    *,
    caches_dir: str | os.PathLike | None = None,
    rank_dir: str | os.PathLike | None = None,
    model_dir: str | os.PathLike | None = None,
    modules: Mapping[str, Any] | None = None,
    maps: str = "/proc/self/maps",
) -> list[dict[str, Any]]:
    """This process's reads as list entries (each file once, first kind wins)."""
    groups: list[tuple[str, Iterable[str]]] = [
        ("module", imported_files(modules)),
        ("library", mapped_libraries(maps)),
        ("archive", tree_files(rank_dir) if rank_dir and os.path.isdir(rank_dir) else ()),
        ("caches", tree_files(caches_dir) if caches_dir and os.path.isdir(caches_dir) else ()),
        ("model", model_files(model_dir)),
    ]
    seen: set[str] = set()
    entries: list[dict[str, Any]] = []
    for kind, paths in groups:
        for path in paths:
            e = _entry(path, kind)
            if e is not None and e["path"] not in seen:
                seen.add(e["path"])
                entries.append(e)
    return entries


def record(
    archive_dir: str | os.PathLike,
    role: str,
    *,
    caches_dir: str | os.PathLike | None = None,
    rank_dir: str | os.PathLike | None = None,
    model: str | None = None,
    model_dir: str | os.PathLike | None = None,
    log: logging.Logger | None = None,
) -> Path | None:
    """SAVE: write this process's reads beside the archive as ``readahead-<role>.json``. ``model``
    is the model as the user named it (path or hub id), ``model_dir`` where its files are. Never
    raises: a list not written only costs a later LOAD its read-ahead."""
    log = log or logger
    if not enabled():
        return None
    from .records import write_json_atomic

    path = Path(archive_dir) / f"{PREFIX}{_safe(role)}.json"
    try:
        entries = collect(caches_dir=caches_dir, rank_dir=rank_dir, model_dir=model_dir)
        data = {
            "format": FORMAT,
            "model": {"name": model, "dir": os.path.realpath(model_dir) if model_dir else None},
            "prefix": os.path.realpath(sys.prefix),
            "files": entries,
        }
        write_json_atomic(path, data)
    except Exception as e:  # noqa: BLE001 - the SAVE itself succeeded; only the read-ahead is lost
        log.warning("Foundry: read-ahead list %s not written (%s)", path, e)
        return None
    log.info(
        "Foundry: read-ahead list %s: %d files, %.0f MB",
        path,
        len(entries),
        sum(e["size"] for e in entries) / 1e6,
    )
    return path


def record_later(
    archive_dir: str | os.PathLike,
    role: str,
    *,
    caches_dir: str | os.PathLike | None = None,
    rank_dir: str | os.PathLike | None = None,
    model: str | None = None,
    log: logging.Logger | None = None,
) -> threading.Thread | None:
    """:func:`record` on a daemon thread (a SAVE's serving goes on); the model's directory is
    looked up there too (:func:`local_model_dir`)."""
    if not enabled():
        return None

    def run() -> None:
        record(
            archive_dir,
            role,
            caches_dir=caches_dir,
            rank_dir=rank_dir,
            model=model,
            model_dir=local_model_dir(model),
            log=log,
        )

    thread = threading.Thread(target=run, name=f"foundry-readahead-record-{_safe(role)}", daemon=True)
    thread.start()
    return thread


def local_model_dir(model: str | None) -> str | None:
    """Where a model named as the user named it (a directory, or a hub id already downloaded) has
    its files on this machine; None where it cannot be told without downloading."""
    if not model:
        return None
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - no hub client, not downloaded, not a hub id: no weights listed
        return None


def _safe(role: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in role)[:64] or "process"


# --- LOAD: what may be read, and reading it ----------------------------------------------------


#: The system's library folders: the shared libraries the engine maps (libc, the CUDA driver).
SYSTEM_LIBRARY_ROOTS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/cuda")


def environment_roots() -> list[Path]:
    """This Python environment: its prefixes, its install paths and its import path (the engine's
    modules and libraries are read from there at every start anyway), and the system's library
    folders."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *SYSTEM_LIBRARY_ROOTS}
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        value = sysconfig.get_paths().get(name)
        if value:
            found.add(value)
    found.update(p for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p))
    return sorted({Path(os.path.realpath(p)) for p in found})


def model_named(recorded: Mapping[str, Any] | None, names: Iterable[str]) -> Path | None:
    """The SAVE's model directory, trusted when this start names the same model (as the user
    wrote it, or its directory), else None."""
    if not recorded or not recorded.get("dir"):
        return None
    wanted = {str(recorded.get("name") or ""), str(recorded["dir"])}
    for name in names:
        if name in wanted or (os.path.isabs(name) and os.path.realpath(name) == recorded["dir"]):
            return Path(recorded["dir"])
    return None


def _under(real: str, prefixes: Sequence[str]) -> bool:
    # Roots as "root/" strings: pathlib's ``parents`` took half of a 9,400-file plan's time.
    return any(real.startswith(p) or real == p[:-1] for p in prefixes)


def _real(path: str, folders: dict[str, str]) -> str:
    """``os.path.realpath(path)``, each folder's real path worked out once: a plan's thousands of
    entries share a few hundred folders, and realpath walks every component of every path (then
    most of a plan's time). The entry itself may be a link: one ``lstat`` tells."""
    head, tail = os.path.split(path)
    if not os.path.isabs(path) or tail in ("", ".", ".."):
        return os.path.realpath(path)
    if head not in folders:
        folders[head] = os.path.realpath(head)
    joined = os.path.join(folders[head], tail)
    return os.path.realpath(joined) if os.path.islink(joined) else joined


@dataclass
class Plan:
    """What one LOAD reads ahead, and what it left out and why."""

    files: list[tuple[str, int, int]] = field(default_factory=list)  # (path, size, mtime_ns)
    skipped: dict[str, int] = field(default_factory=lambda: {"missing": 0, "changed": 0, "untrusted": 0})
    lists: int = 0
    bad_lists: list[str] = field(default_factory=list)

    def info(self, plan_s: float) -> dict[str, Any]:
        """What the plan holds, as the start report and the helper process's first line say it."""
        return {
            "lists": self.lists,
            "skipped": dict(self.skipped),
            "bad_lists": list(self.bad_lists),
            "files": len(self.files),
            "mb": round(sum(f[1] for f in self.files) / 1e6, 1),
            "plan_s": round(plan_s, 3),
        }


def plan(
    archive_dir: str | os.PathLike,
    *,
    model_names: Iterable[str] = (),
    extra_roots: Iterable[str | os.PathLike] = (),
    log: logging.Logger | None = None,
    environment: Sequence[str | os.PathLike] | None = None,
) -> Plan:
    """Read every list beside the archive and keep the entries that may and should be read: the
    file's real path is under a trusted root and its size and mtime are the recorded ones. Small
    files first, in recorded order (the imports' order), the model's files last. ``environment``:
    the engine's environment roots, where this process is not the engine's (:func:`child_main`)."""
    log = log or logger
    archive = Path(os.path.realpath(archive_dir))
    out = Plan()
    env_roots = environment_roots() if environment is None else [Path(r) for r in environment]
    base_roots = [archive, *env_roots, *(Path(os.path.realpath(r)) for r in extra_roots)]
    names = list(model_names)
    seen: set[str] = set()
    folders: dict[str, str] = {}
    ordered: list[tuple[int, str, int, int]] = []
    for list_path in sorted(archive.glob(f"{PREFIX}*.json")):
        try:
            data = json.loads(list_path.read_text())
            files = data["files"]
            if data.get("format") != FORMAT or not isinstance(files, list) or len(files) > MAX_ENTRIES:
                raise ValueError("not a read-ahead list of this format")
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.bad_lists.append(list_path.name)
            log.info("Foundry: read-ahead list %s skipped (%s)", list_path, str(e).splitlines()[0][:200])
            continue
        out.lists += 1
        model_dir = model_named(data.get("model"), names)
        roots = [str(r).rstrip(os.sep) + os.sep for r in [*base_roots, *([model_dir] if model_dir else [])]]
        for e in files:
            try:
                path, size, mtime = str(e["path"]), int(e["size"]), int(e["mtime_ns"])
                kind = str(e.get("kind", "module"))
            except (KeyError, TypeError, ValueError):
                out.skipped["changed"] += 1
                continue
            real = _real(path, folders)
            if real in seen:
                continue
            seen.add(real)
            if not os.path.isabs(path) or not _under(real, roots):
                out.skipped["untrusted"] += 1
                continue
            try:
                st = os.stat(real)
            except OSError:
                out.skipped["missing"] += 1
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_mtime_ns != mtime:
                out.skipped["changed"] += 1
                continue
            ordered.append((1 if kind == "model" else 0, real, size, mtime))
    ordered.sort(key=lambda t: t[0])  # stable: recorded order within each group
    out.files = [(p, s, m) for _, p, s, m in ordered]
    return out


def _read_one(path: str, size: int, mtime: int, buf: bytearray) -> int:
    """Read one file into the page cache; bytes read (0 if it changed since it was planned)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_mtime_ns != mtime:
            return 0
        done = 0
        view = memoryview(buf)
        while True:
            n = os.readv(fd, [view])
            if n <= 0:
                return done
            done += n
    except OSError:
        return 0
    finally:
        os.close(fd)


def _advise_one(path: str, size: int, mtime: int, buf: bytearray | None = None) -> int:
    """Ask the kernel to read one file into the page cache (it does so without this process copying
    a byte, and without the GIL); the bytes asked for (0 if it changed since it was planned)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return _read_one(path, size, mtime, buf or bytearray(CHUNK))
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_mtime_ns != mtime:
            return 0
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return size
    except OSError:
        return 0
    finally:
        os.close(fd)


def mode(environ: Mapping[str, str] | None = None) -> str:
    """``advise`` (the kernel reads; the default) or ``read`` (reader threads copy every byte: for
    file systems that ignore the hint, at the cost of CPU time the engine's imports compete for)."""
    value = (os.environ if environ is None else environ).get(MODE_ENV, "advise").strip().lower()
    return value if value in ("advise", "read") else "advise"


class Replay:
    """A LOAD's read-ahead, running on daemon threads; :meth:`summary` for the start report."""

    def __init__(self, files: Sequence[tuple[str, int, int]], threads: int = THREADS, how: str | None = None):
        self.files = list(files)
        self.threads = max(1, threads)
        self.how = how or mode()
        self.read_bytes = 0
        self.read_files = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self._lock = threading.Lock()
        self._next = 0
        self._running = 0
        self._workers: list[threading.Thread] = []

    def stop(self) -> None:
        """Read nothing more (the files being read are finished)."""
        with self._lock:
            self._next = len(self.files)

    def start(self) -> Replay:
        self._running = self.threads
        for i in range(self.threads):
            t = threading.Thread(target=self._work, name=f"foundry-readahead-reader-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _work(self) -> None:
        buf = bytearray(CHUNK)
        while True:
            with self._lock:
                if self._next >= len(self.files):
                    break
                path, size, mtime = self.files[self._next]
                self._next += 1
            n = (_read_one if self.how == "read" else _advise_one)(path, size, mtime, buf)
            with self._lock:
                self.read_bytes += n
                self.read_files += 1 if n else 0
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self.finished = time.monotonic()

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._workers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._workers)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "files": len(self.files),
                "read_files": self.read_files,
                "read_mb": round(self.read_bytes / 1e6, 1),
                "how": self.how,
                "done_s": None if self.finished is None else round(self.finished - self.started, 3),
            }


_state: dict[str, Any] = {}  # this process's read-ahead: {"plan": Plan, "replay": Replay}
_state_lock = threading.Lock()


def start(
    archive_dir: str | os.PathLike,
    *,
    model_names: Iterable[str] = (),
    extra_roots: Iterable[str | os.PathLike] = (),
    threads: int = THREADS,
    log: logging.Logger | None = None,
) -> threading.Thread | None:
    """LOAD: plan and read ahead on a daemon thread (the caller pays one thread start). Once per
    process, and not in a process whose parent started it for the same launch. Returns the planning
    thread, or None where nothing was started."""
    if not _claim(archive_dir):
        return None
    args = (archive_dir, list(model_names), list(extra_roots), threads, log or logger)
    thread = threading.Thread(target=_plan_and_read, args=args, name="foundry-readahead-plan", daemon=True)
    thread.start()
    return thread


def _claim(archive_dir: str | os.PathLike) -> bool:
    """Whether this process is the one to read ahead for this launch (and mark it so)."""
    if not enabled():
        return False
    with _state_lock:
        if "archive" in _state or os.environ.get(STARTED_ENV):
            return False
        _state["archive"] = str(archive_dir)
        os.environ[STARTED_ENV] = str(os.getpid())  # inherited by the engine's processes
    return True


def _plan_and_read(
    archive_dir: str | os.PathLike,
    names: list[str],
    roots: list[str | os.PathLike],
    threads: int,
    log: logging.Logger,
) -> None:
    """In a helper process (:mod:`.readahead_proc`), or on this process's threads where none starts."""
    from . import readahead_proc

    args = {
        "archive_dir": str(archive_dir),
        "names": names,
        "roots": [str(r) for r in roots],
        "environment": [str(r) for r in environment_roots()],
        "threads": threads,
        "how": mode(),
    }

    def planned(info: dict[str, Any], helper: bool = True) -> None:
        with _state_lock:
            _state["plan_info"] = info
        for name in info["bad_lists"] if helper else ():  # plan() logs them where it runs here
            log.info("Foundry: read-ahead list %s skipped (not a read-ahead list of this format)", name)
        if info.get("lists"):
            from ..process import process_age  # this runs in the launcher (the helper only plans)

            log.info(
                "Foundry: reading ahead %d files (%.0f MB) from %d list(s), planned in %.2f s by %s, "
                "%s s into this process; skipped %s",
                info["files"],
                info["mb"],
                info["lists"],
                info["plan_s"],
                "a helper process" if helper else "this process",
                process_age(),
                ", ".join(f"{k} {v}" for k, v in info["skipped"].items() if v) or "none",
            )

    def done(result: dict[str, Any]) -> None:
        if result.get("files"):
            log.info(
                "Foundry: read ahead %d of %d files (%.0f MB) in %.1f s",
                result.get("read_files", 0),
                result["files"],
                result.get("read_mb", 0.0),
                result.get("done_s") or 0.0,
            )

    def failed(error: str) -> None:
        log.info("Foundry: read-ahead not started (%s)", error)

    helper = None
    if os.environ.get(HELPER_ENV, "1").strip() != "0":
        helper = readahead_proc.start(__file__, args, planned, done, failed)
    if helper is not None:
        with _state_lock:
            _state["replay"] = helper
        return
    t0 = time.monotonic()
    try:
        p = plan(archive_dir, model_names=names, extra_roots=roots, log=log)
        replay = Replay(p.files, threads).start()
    except Exception as e:  # noqa: BLE001 - read-ahead is an optimisation; the start goes on
        failed(str(e))
        return
    with _state_lock:
        _state["replay"] = replay
    planned(p.info(time.monotonic() - t0), helper=False)


def summary() -> dict[str, Any] | None:
    """This process's read-ahead for the start report (None where it started none)."""
    with _state_lock:
        info, replay = _state.get("plan_info"), _state.get("replay")
        if info is not None:
            out = {k: info[k] for k in ("lists", "skipped", "bad_lists", "plan_s")}
        elif replay is not None:  # the helper has not planned yet
            out = {"lists": None}
        else:
            return {"started_by": os.environ.get(STARTED_ENV)} if os.environ.get(STARTED_ENV) else None
    out.update(replay.summary())
    return out


def child_main(args: dict[str, Any]) -> None:
    """The helper process of :mod:`.readahead_proc` (this file loaded on its own there): plan, say
    so on stdout, read ahead, report; it stops reading once the launcher that started it is gone."""
    t0 = time.monotonic()
    launcher = os.getppid()
    try:
        p = plan(
            args["archive_dir"],
            model_names=args["names"],
            extra_roots=args["roots"],
            environment=args["environment"],
        )
    except Exception as e:  # noqa: BLE001 - said to the launcher, which logs it; the start goes on
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"plan": p.info(time.monotonic() - t0)}), flush=True)
    replay = Replay(p.files, args["threads"], args["how"]).start()
    while not replay.join(timeout=0.5):
        if os.getppid() != launcher:
            replay.stop()
    print(json.dumps({"replay": replay.summary()}), flush=True)


def reset() -> None:
    """Forget this process's read-ahead (tests; a later launch in the same process)."""
    with _state_lock:
        _state.clear()
        os.environ.pop(STARTED_ENV, None)


# --- where a plugin finds the archive before it has parsed anything ---------------------------


def wanted_for_launch(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The Foundry configuration this launch names, when it should read ahead (cheap: no I/O)."""
    from ..switches import config_path  # in the package only: the helper never launches

    if not enabled(environ) or environ.get(STARTED_ENV):
        return None
    return config_path(argv, environ)


def run_for_launch(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    log: logging.Logger | None = None,
) -> bool:
    """When this command line (or ``FOUNDRY_CONFIG``) names a Foundry configuration that may
    LOAD, read its archive's lists ahead (on this thread: the plan; on daemon threads: the reads).
    A configuration that cannot be read is left to the plugin, which reports it as it always does.
    Returns whether a read-ahead was started."""
    argv = list(sys.argv if argv is None else argv)
    config = wanted_for_launch(argv, os.environ if environ is None else environ)
    if not config:
        return False
    log = log or logger
    try:
        from ..config import load_config

        cfg = load_config(config)
    except Exception as e:  # noqa: BLE001 - the plugin reports a bad configuration itself
        log.debug("Foundry: no read-ahead (configuration %s: %s)", config, e)
        return False
    if cfg.mode == "save" or not _claim(cfg.archive_dir):
        return False
    _plan_and_read(cfg.archive_dir, [a for a in argv if not a.startswith("-")], [], THREADS, log)
    return True
