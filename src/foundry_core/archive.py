"""The Foundry archive: one versioned, verified, crash-safe on-disk format (see docs/archive-format.md).

An archive is a directory holding arbitrary files chosen by the caller (module images, serialized
graphs, layout tables...) plus ``manifest.json``, written last, which lists every other file with its
size and sha256 and carries the fingerprint of the setup it was saved for and a caller-supplied
``meta`` object. The archive's digest is the sha256 of the manifest bytes.

Writing::

    with ArchiveWriter(path) as w:
        if not w.has(f"modules/{sha}.cubin"):
            w.add_bytes(f"modules/{sha}.cubin", image)
        w.add_json("layout.json", layout)
        digest = w.commit(fingerprint=current_fingerprint(), meta={...})

Reading::

    ar = open_archive(path, expected_fingerprint=current_fingerprint(), expected_digest=pinned)
    blob = ar.read_bytes("graphs/0003.bin")

On disk, ``path`` is a symlink to a sibling ``.<name>.<digest16>`` directory; a SAVE builds a new
sibling and swaps the symlink atomically, so ``path`` is always either absent, the complete old
archive or the complete new one. Every failure raises :class:`ArchiveError` with a one-line message.

This module does not import torch or the CUDA bindings.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime as _dt
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from foundry_core import __version__, _native
from foundry_core.fingerprint import FINGERPRINT_FIELDS, canonical_json_value

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MIN_FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MISSING",
    "Archive",
    "ArchiveError",
    "ArchiveNotFound",
    "ArchiveWriter",
    "COMPRESS_CHUNK",
    "ENCODING_KIND",
    "FingerprintMismatch",
    "compare_fingerprint",
    "open_archive",
    "remove_archive",
]

FORMAT = "foundry-archive"
#: The format this Foundry writes and the newest it reads. 2: a member may be stored compressed
#: (its manifest entry then has an ``encoding``); version-1 archives have no compressed members.
FORMAT_VERSION = 2
#: The oldest format this Foundry still reads.
MIN_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_MANIFEST_KEYS = (
    "created_utc",
    "files",
    "fingerprint",
    "format",
    "format_version",
    "foundry_version",
    "manifest_sha256",
    "meta",
)
_ENTRY_KEYS = ("sha256", "size")
_ENCODED_ENTRY_KEYS = ("encoding", "sha256", "size")
# Threads that hash archive files at open; sha256 runs at ~1-2 GB/s per core.
_READ_THREADS = max(1, min(8, os.cpu_count() or 1))
# Compressed members: zlib streams over independent fixed-size chunks of the content, so that
# SAVE compresses and LOAD inflates them on many threads at once (zlib releases the GIL; inflate
# runs at ~200-400 MB/s per core). Code images, the bulk of an archive, shrank 8.9x in the bench.
ENCODING_KIND = "zlib-chunks"
COMPRESS_CHUNK = 1 << 20
COMPRESS_LEVEL = 6
_COMPRESS_MIN = 4096  # smaller members are stored as they are
_MIN_CHUNK, _MAX_CHUNK = 1 << 12, 1 << 26
_MAX_RAW_SIZE = 1 << 40
_ZLIB_THREADS = max(1, min(16, os.cpu_count() or 1))
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_RELPATH_BYTES = 1024
_MAX_COMPONENT_BYTES = 255
_READ_CHUNK = 1 << 30
_OPEN_ATTEMPTS = 3


class ArchiveError(Exception):
    """An archive that cannot be written or used; the message is one line a user can act on."""


class ArchiveNotFound(ArchiveError):
    """``open_archive`` found nothing at the path (a first start in ``auto`` mode SAVEs instead)."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Stands for the absent side in :class:`FingerprintMismatch` when a key exists on one side only.
MISSING: Any = _Missing()


class FingerprintMismatch(ArchiveError):
    """The archive was saved for a different setup. ``field`` is e.g. ``"gpu_name"`` or ``"model.dtype"``;
    ``saved``/``current`` are the two values (:data:`MISSING` for an absent key)."""

    def __init__(self, message: str, field: str, saved: Any, current: Any):
        super().__init__(message)
        self.field = field
        self.saved = saved
        self.current = current


# --------------------------------------------------------------------------------------------------
# shared helpers


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _oserr(e: OSError) -> str:
    return e.strerror or type(e).__name__


def check_relpath(relpath: Any) -> str:
    """Validate an archive member name; return it unchanged or raise :class:`ArchiveError`.

    A member name is a relative POSIX path in normal form: components separated by single ``/``,
    none empty, ``.`` or ``..``, no backslash, NUL or control character, valid UTF-8, at most
    1024 bytes (255 per component), and not ``manifest.json`` itself.
    """
    if not isinstance(relpath, str):
        raise ArchiveError(f"archive member name must be a string, got {type(relpath).__name__}")
    shown = _one_line(repr(relpath), 120)
    try:
        encoded = relpath.encode("utf-8")
    except UnicodeEncodeError:
        raise ArchiveError(f"archive member name {shown} is not valid UTF-8") from None
    if not relpath:
        raise ArchiveError("archive member name is empty")
    if len(encoded) > _MAX_RELPATH_BYTES:
        raise ArchiveError(f"archive member name {shown} is longer than {_MAX_RELPATH_BYTES} bytes")
    if relpath.startswith("/"):
        raise ArchiveError(f"archive member name {shown} is absolute; only relative paths are allowed")
    if any(ord(c) < 0x20 or c in "\x7f\\" for c in relpath):
        raise ArchiveError(f"archive member name {shown} contains a backslash or control character")
    for part in relpath.split("/"):
        if part in ("", ".", ".."):
            raise ArchiveError(
                f"archive member name {shown} is not a normalized relative path (no '', '.', '..')"
            )
        if len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES:
            raise ArchiveError(
                f"archive member name {shown} has a component longer than {_MAX_COMPONENT_BYTES} bytes"
            )
    if relpath == MANIFEST_NAME:
        raise ArchiveError(f"archive member name {MANIFEST_NAME!r} is reserved for the manifest")
    return relpath


def _json_data(value: Any, where: str) -> Any:
    try:
        return canonical_json_value(value, where)
    except ValueError as e:
        raise ArchiveError(_one_line(str(e))) from None
    except RecursionError:
        raise ArchiveError(f"{where}: nested too deeply to store") from None


def _dumps(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(data: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; ValueError/RecursionError on failure."""
    return json.loads(
        data.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
    )


def _fsync_path(path: str | os.PathLike, directory: bool = True) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: str) -> None:
    """Remove a directory tree, a file or a symlink (never following it); missing is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


class _Names:
    """The sibling names that belong to the archive at ``path`` (all inside its parent directory)."""

    def __init__(self, path: str | os.PathLike):
        abspath = os.path.abspath(os.fspath(path))
        self.parent, self.name = os.path.split(abspath)
        if not self.name or self.name in (".", ".."):
            raise ArchiveError(f"archive path {os.fspath(path)!r} must name a directory entry")
        self.path = abspath
        self.lock = os.path.join(self.parent, f".{self.name}.lock")
        esc = re.escape(self.name)
        self.version_re = re.compile(rf"\.{esc}\.[0-9a-f]{{16}}")
        self.leftover_re = re.compile(rf"\.{esc}\.(tmp|link|old)-[0-9]+-[0-9a-f]{{8}}")

    def version(self, digest: str) -> str:
        return f".{self.name}.{digest[:16]}"

    def scratch(self, kind: str) -> str:
        return os.path.join(self.parent, f".{self.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _looks_like_archive(directory: str) -> bool:
    """A cheap check that ``directory`` holds a Foundry manifest (not full verification)."""
    try:
        fd = os.open(os.path.join(directory, MANIFEST_NAME), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return False
        head = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    return b'"format"' in head and FORMAT.encode() in head


def _classify(names: _Names) -> str:
    """What currently sits at the archive path: absent | ours | link | plain | empty.

    ``ours``: symlink to one of our versioned siblings; ``link``: another symlink (dangling, or to a
    Foundry archive); ``plain``: a real directory holding a Foundry archive; ``empty``: an empty
    directory. Anything else (user data, a file) is refused.
    """
    p = names.path
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return "absent"
    except OSError as e:
        raise ArchiveError(f"cannot inspect {p}: {_oserr(e)}") from None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(p)
        if "/" not in target and names.version_re.fullmatch(target):
            return "ours"
        if not os.path.exists(p) or _looks_like_archive(p):
            return "link"
        raise ArchiveError(
            f"refusing to replace {p}: it is a symlink to {target!r}, which is not a Foundry archive; move it away"
        )
    if stat.S_ISDIR(st.st_mode):
        if _looks_like_archive(p):
            return "plain"
        try:
            empty = not os.listdir(p)
        except OSError as e:
            raise ArchiveError(f"cannot inspect {p}: {_oserr(e)}") from None
        if empty:
            return "empty"
        raise ArchiveError(
            f"refusing to replace {p}: it is a non-empty directory that is not a Foundry archive; "
            "choose another archive_dir or move it away"
        )
    raise ArchiveError(
        f"refusing to replace {p}: it is a file, not a Foundry archive directory; move it away"
    )


class _Lock:
    """An exclusive fcntl.flock on the sibling ``.<name>.lock`` file, holding the owner's pid."""

    def __init__(self, names: _Names, timeout: float, purpose: str):
        self.names = names
        self.timeout = timeout
        self.purpose = purpose
        self.fd: int | None = None

    def _holder(self) -> str:
        try:
            with open(self.names.lock, "rb") as f:
                pid = f.read(32).decode("ascii", "replace").strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "an unknown process"

    def acquire(self) -> None:
        try:
            os.makedirs(self.names.parent, exist_ok=True)
            fd = os.open(self.names.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise ArchiveError(f"cannot create lock file {self.names.lock}: {_oserr(e)}") from None
        deadline = time.monotonic() + max(0.0, self.timeout)
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise ArchiveError(f"cannot lock {self.names.lock}: {_oserr(e)}") from None
            if time.monotonic() >= deadline:
                holder = self._holder()
                os.close(fd)
                if self.timeout <= 0:
                    raise ArchiveError(
                        f"cannot {self.purpose} {self.names.path}: another SAVE ({holder}) holds "
                        f"{self.names.lock}; wait for it to finish or pass lock_timeout"
                    )
                raise ArchiveError(
                    f"cannot {self.purpose} {self.names.path}: timed out after {self.timeout:g}s waiting for "
                    f"another SAVE ({holder}) holding {self.names.lock}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for messages
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the last descriptor drops the flock


def _clean_siblings(names: _Names, keep: str | None, versions: bool) -> None:
    """Remove leftovers of killed SAVEs (and, with ``versions``, superseded versions); lock must be held."""
    try:
        entries = os.listdir(names.parent)
    except OSError:
        return
    for entry in entries:
        if entry == keep:
            continue
        if names.leftover_re.fullmatch(entry) or (versions and names.version_re.fullmatch(entry)):
            _rmtree(os.path.join(names.parent, entry))


# --------------------------------------------------------------------------------------------------
# writing


class ArchiveWriter:
    """Builds an archive in a temporary sibling directory and publishes it atomically on :meth:`commit`.

    Use as a context manager: ``__enter__`` takes the lock (``lock_timeout`` seconds of waiting; 0
    refuses at once when another SAVE holds it) and creates the temporary directory; leaving the block
    without a commit (an exception, KeyboardInterrupt) removes the temporary directory and leaves any
    existing archive untouched.
    """

    def __init__(self, path: str | os.PathLike, *, lock_timeout: float = 0.0):
        self._names = _Names(path)
        self.path = Path(self._names.path)
        self._lock = _Lock(self._names, float(lock_timeout), "SAVE into")
        self._tmp: str | None = None
        # relpath -> (stored size, sha256 of the stored bytes, encoding or None); None while a
        # compressed member is still being compressed (see _pending).
        self._files: dict[str, tuple[int, str, dict | None] | None] = {}
        self._dirs: set[str] = set()
        # Compressed members: their content and the per-chunk compression jobs; written at commit.
        self._pending: dict[str, tuple[memoryview, list[concurrent.futures.Future]]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._state = "new"  # new -> open -> committed | closed
        self.digest: str | None = None

    # context manager ---------------------------------------------------------------------------
    def __enter__(self) -> ArchiveWriter:
        if self._state != "new":
            raise ArchiveError(f"ArchiveWriter for {self.path} cannot be entered twice")
        self._lock.acquire()
        try:
            _classify(self._names)  # refuse early, before writing gigabytes, if the path holds user data
            _clean_siblings(self._names, keep=None, versions=False)
            tmp = self._names.scratch("tmp")
            os.mkdir(tmp, 0o777)
            self._tmp = tmp
        except BaseException as e:
            self._lock.release()
            if isinstance(e, OSError):
                raise ArchiveError(
                    f"cannot create a temporary directory next to {self.path}: {_oserr(e)}"
                ) from None
            raise
        self._state = "open"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._stop_pool()
            if self._tmp is not None and self._state != "committed":
                _rmtree(self._tmp)
            self._tmp = None
        finally:
            if self._state == "open":
                self._state = "closed"
            self._lock.release()

    # members -------------------------------------------------------------------------------------
    def _require_open(self) -> str:
        if self._state == "new":
            raise ArchiveError("use ArchiveWriter as a context manager ('with ArchiveWriter(path) as w:')")
        if self._state != "open" or self._tmp is None:
            raise ArchiveError(f"ArchiveWriter for {self.path} is already {self._state}; start a new one")
        return self._tmp

    def has(self, relpath: str) -> bool:
        """Whether ``relpath`` was already added (for content-addressed dedup of module images)."""
        return relpath in self._files

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()

    def add_bytes(
        self, relpath: str, data: bytes | bytearray | memoryview, *, compress: bool = False
    ) -> None:
        """Write one member; refuses a name that was already added (check :meth:`has` first).

        ``compress=True``: store it zlib-compressed in independent chunks when that saves at least
        an eighth (the reader inflates it transparently). Compression runs on threads while the
        caller goes on; the member is written at :meth:`commit`, so ``data`` must not change until
        then.
        """
        tmp = self._require_open()
        check_relpath(relpath)
        if relpath in self._files:
            raise ArchiveError(f"archive member {relpath!r} was already added; check has() before adding")
        try:
            view = memoryview(data)
        except TypeError:
            raise ArchiveError(f"{relpath}: expected bytes, got {type(data).__name__}") from None
        if not view.c_contiguous:
            raise ArchiveError(f"{relpath}: data must be a contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        parts = relpath.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in self._files:
                raise ArchiveError(f"archive member {relpath!r} needs {d!r} as a directory, but it is a file")
        if relpath in self._dirs:
            raise ArchiveError(f"archive member {relpath!r} is already used as a directory")
        try:
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in self._dirs:
                    try:
                        os.mkdir(os.path.join(tmp, d), 0o777)
                    except FileExistsError:
                        pass
                    self._dirs.add(d)
        except OSError as e:
            raise ArchiveError(f"cannot write {relpath} into {tmp}: {_oserr(e)}") from None
        if compress and len(view) >= _COMPRESS_MIN:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _ZLIB_THREADS, thread_name_prefix="foundry-zlib"
                )
            jobs = [
                self._pool.submit(zlib.compress, view[i : i + COMPRESS_CHUNK], COMPRESS_LEVEL)
                for i in range(0, len(view), COMPRESS_CHUNK)
            ]
            self._pending[relpath] = (view, jobs)
            self._files[relpath] = None
            return
        self._files[relpath] = (*self._write_file(tmp, relpath, [view]), None)

    def _write_file(self, tmp: str, relpath: str, parts: list) -> tuple[int, str]:
        """Write ``parts`` one after the other as member ``relpath``; its size and sha256."""
        sha, size = hashlib.sha256(), 0
        try:
            fd = os.open(
                os.path.join(tmp, relpath), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666
            )
            try:
                for part in parts:
                    _write_all(fd, memoryview(part))
                    sha.update(part)
                    size += len(part)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise ArchiveError(f"cannot write {relpath} into {tmp}: {_oserr(e)}") from None
        return size, sha.hexdigest()

    def _write_pending(self, tmp: str) -> None:
        """Write the compressed members, each as chunks or, where compression saves too little, raw."""
        for relpath in sorted(self._pending):
            view, jobs = self._pending[relpath]
            chunks = [job.result() for job in jobs]
            stored = sum(len(c) for c in chunks)
            if stored > len(view) - len(view) // 8:
                self._files[relpath] = (*self._write_file(tmp, relpath, [view]), None)
                continue
            encoding = {
                "kind": ENCODING_KIND,
                "raw_size": len(view),
                "chunk_size": COMPRESS_CHUNK,
                "chunks": [len(c) for c in chunks],
            }
            self._files[relpath] = (*self._write_file(tmp, relpath, chunks), encoding)
        self._stop_pool()

    def add_json(self, relpath: str, obj: Any) -> None:
        """Write ``obj`` as canonical JSON (sorted keys, compact, ASCII); read back with Archive.read_json."""
        self.add_bytes(relpath, _dumps(_json_data(obj, relpath)))

    # publishing ----------------------------------------------------------------------------------
    def commit(self, *, fingerprint: dict, meta: dict) -> str:
        """Write the manifest last, publish the archive atomically, clean old versions; return the digest."""
        tmp = self._require_open()
        if not isinstance(fingerprint, dict):
            raise ArchiveError(f"fingerprint must be a dict, got {type(fingerprint).__name__}")
        if not isinstance(meta, dict):
            raise ArchiveError(f"meta must be a dict, got {type(meta).__name__}")
        self._write_pending(tmp)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "foundry_version": __version__,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
            "fingerprint": _json_data(fingerprint, "fingerprint"),
            "files": {rel: _entry(*record) for rel, record in sorted(self._files.items())},
            "meta": _json_data(meta, "meta"),
        }
        manifest["manifest_sha256"] = _self_checksum(manifest)
        data = _manifest_bytes(manifest)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ArchiveError(
                f"manifest of {self.path} would be {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit; "
                "move bulky meta into a member file"
            )
        digest = hashlib.sha256(data).hexdigest()
        try:
            self._publish(tmp, data, digest)
        except BaseException as e:
            self._state = "failed"
            if isinstance(e, OSError):
                raise ArchiveError(f"cannot publish archive {self.path}: {_oserr(e)}") from None
            raise
        self._tmp = None
        self._state = "committed"
        self.digest = digest
        # Best effort from here on: the new archive is live whatever happens to the cleanup.
        try:
            _clean_siblings(self._names, keep=self._names.version(digest), versions=True)
            _fsync_path(self._names.parent)
        except OSError:
            pass
        return digest

    def _publish(self, tmp: str, data: bytes, digest: str) -> None:
        names = self._names
        fd = os.open(
            os.path.join(tmp, MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666
        )
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        for d in sorted(self._dirs, key=lambda s: s.count("/"), reverse=True):
            _fsync_path(os.path.join(tmp, d))
        _fsync_path(tmp)
        kind = _classify(names)  # again: someone may have put data there meanwhile
        version = names.version(digest)
        vpath = os.path.join(names.parent, version)
        if kind == "ours" and os.readlink(names.path) == version and _same_manifest(vpath, data):
            _rmtree(tmp)  # identical manifest bytes imply identical content: nothing to publish
            return
        if os.path.lexists(vpath):
            if kind == "ours" and os.readlink(names.path) == version:
                raise ArchiveError(
                    f"cannot publish archive {self.path}: digest prefix collides with the live version"
                )
            _rmtree(vpath)  # a stale leftover with the same name, not the live version
        os.rename(tmp, vpath)
        _fsync_path(names.parent)
        link = names.scratch("link")
        os.symlink(version, link)
        if kind in ("absent", "ours", "link"):
            os.replace(link, names.path)
        elif _exchange(link, names.path):
            _rmtree(link)  # after the exchange, `link` names the old plain directory
        else:
            # No atomic exchange on this system: move the old plain directory aside first.
            aside = names.scratch("old")
            os.rename(names.path, aside)
            os.replace(link, names.path)
            _rmtree(aside)
        _fsync_path(names.parent)


def _entry(size: int, sha: str, encoding: dict | None) -> dict:
    entry: dict[str, Any] = {"size": size, "sha256": sha}
    if encoding is not None:
        entry["encoding"] = encoding
    return entry


def _same_manifest(directory: str, data: bytes) -> bool:
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            return f.read(len(data) + 1) == data
    except OSError:
        return False


def _write_all(fd: int, view: memoryview) -> None:
    written = 0
    while written < len(view):
        written += os.write(fd, view[written : written + (1 << 30)])


# --------------------------------------------------------------------------------------------------
# reading


class Archive:
    """A fully verified archive held in memory; nothing is re-read from disk after :func:`open_archive`."""

    def __init__(self, path: Path, manifest: dict, digest: str, contents: dict[str, bytes]):
        self.path = path
        self.manifest = manifest
        self.digest = digest
        self.meta: dict = manifest["meta"]
        self.fingerprint: dict = manifest["fingerprint"]
        self.format_version: int = manifest["format_version"]
        self.files: dict[str, int] = {rel: len(b) for rel, b in sorted(contents.items())}
        self._contents = contents

    def __repr__(self) -> str:
        return f"Archive({str(self.path)!r}, digest={self.digest[:16]}, files={len(self.files)})"

    def read_bytes(self, relpath: str) -> bytes:
        """The verified bytes of member ``relpath``."""
        try:
            return self._contents[relpath]
        except (KeyError, TypeError):
            raise ArchiveError(f"archive {self.path} has no file {_one_line(repr(relpath), 120)}") from None

    def read_json(self, relpath: str) -> Any:
        """Member ``relpath`` parsed as strict JSON."""
        data = self.read_bytes(relpath)
        try:
            return _loads(data)
        except (ValueError, RecursionError) as e:
            raise ArchiveError(
                f"archive {self.path}: {relpath} is not valid JSON: {_one_line(str(e), 120)}"
            ) from None


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode() + b"\n"


def _self_checksum(manifest: dict) -> str:
    """sha256 of the manifest as written, minus its ``manifest_sha256`` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(_manifest_bytes(body)).hexdigest()


def _self_checksum_matches(raw: bytes, manifest: dict) -> bool:
    """Whether ``manifest_sha256`` matches the rest of the manifest.

    Fast path: a manifest as SAVE wrote it is the canonical text of the checksummed body with the
    ``manifest_sha256`` line added, so hashing the file with that one line cut out is enough. Any
    other layout of the same JSON (reformatted by a tool) is checked the slow way, by writing the
    body out canonically (json's pure-Python indenting encoder: tens of ms on a large manifest).
    """
    stored = manifest["manifest_sha256"]
    line = b'\n "manifest_sha256": "' + stored.encode("ascii", "replace") + b'",'
    at = raw.find(line)
    if at >= 0 and hashlib.sha256(raw[:at] + raw[at + len(line) :]).hexdigest() == stored:
        return True
    return stored == _self_checksum(manifest)


def _check_manifest(m: Any, where: str) -> dict:
    """Strict schema check of a parsed manifest; version checks come first so a newer format is
    reported as such rather than as a schema error."""
    if not isinstance(m, dict):
        raise ArchiveError(f"{where}: manifest.json must hold a JSON object, got {type(m).__name__}")
    fmt = m.get("format", MISSING)
    if fmt is MISSING:
        raise ArchiveError(f"{where}: manifest.json has no 'format' field; this is not a Foundry archive")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise ArchiveError(
            f"{where}: manifest.json field 'format' is {_one_line(repr(fmt), 80)}, expected {FORMAT!r}; "
            "this is not a Foundry archive"
        )
    ver = m.get("format_version", MISSING)
    if ver is MISSING:
        raise ArchiveError(f"{where}: manifest.json has no 'format_version' field")
    if isinstance(ver, bool) or not isinstance(ver, int):
        raise ArchiveError(
            f"{where}: manifest.json field 'format_version' must be an integer, got {_one_line(repr(ver), 80)}"
        )
    if ver > FORMAT_VERSION:
        raise ArchiveError(
            f"{where}: archive format version {ver} is newer than this Foundry reads ({FORMAT_VERSION}): "
            "upgrade Foundry or SAVE again"
        )
    if ver < MIN_FORMAT_VERSION:
        raise ArchiveError(
            f"{where}: archive format version {ver} is older than this Foundry reads "
            f"({MIN_FORMAT_VERSION}..{FORMAT_VERSION}): SAVE again"
        )
    for key in _MANIFEST_KEYS:
        if key not in m:
            raise ArchiveError(f"{where}: manifest.json has no {key!r} field")
    extra = sorted(set(m) - set(_MANIFEST_KEYS))
    if extra:
        raise ArchiveError(f"{where}: manifest.json has unknown field {_one_line(repr(extra[0]), 80)}")
    ms = m["manifest_sha256"]
    if not isinstance(ms, str) or not _HEX64.fullmatch(ms):
        raise ArchiveError(
            f"{where}: manifest.json field 'manifest_sha256' must be 64 lowercase hex characters"
        )
    fv = m["foundry_version"]
    if not isinstance(fv, str) or not fv:
        raise ArchiveError(f"{where}: manifest.json field 'foundry_version' must be a non-empty string")
    cu = m["created_utc"]
    if not isinstance(cu, str):
        raise ArchiveError(f"{where}: manifest.json field 'created_utc' must be an ISO-8601 string")
    try:
        when = _dt.datetime.fromisoformat(cu)
    except ValueError:
        raise ArchiveError(
            f"{where}: manifest.json field 'created_utc' is not an ISO-8601 time: {_one_line(repr(cu), 60)}"
        ) from None
    if when.utcoffset() != _dt.timedelta(0):
        raise ArchiveError(f"{where}: manifest.json field 'created_utc' must be in UTC (+00:00)")
    for key in ("fingerprint", "meta"):
        if not isinstance(m[key], dict):
            raise ArchiveError(
                f"{where}: manifest.json field {key!r} must be an object, got {type(m[key]).__name__}"
            )
    files = m["files"]
    if not isinstance(files, dict):
        raise ArchiveError(
            f"{where}: manifest.json field 'files' must be an object, got {type(files).__name__}"
        )
    for rel, entry in files.items():
        try:
            check_relpath(rel)
        except ArchiveError as e:
            raise ArchiveError(f"{where}: manifest.json lists a bad file: {e}") from None
        shown = _one_line(repr(rel), 120)
        allowed = [list(_ENTRY_KEYS)] + ([list(_ENCODED_ENTRY_KEYS)] if ver >= 2 else [])
        if not isinstance(entry, dict) or sorted(entry) not in allowed:
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} must be an object with exactly 'size' and 'sha256'"
                + (" (and optionally 'encoding')" if ver >= 2 else "")
            )
        size, sha = entry["size"], entry["sha256"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} has a bad size {_one_line(repr(size), 40)}"
            )
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} has a bad sha256 (need 64 lowercase hex)"
            )
        if "encoding" in entry:
            _check_encoding(entry["encoding"], size, f"{where}: manifest.json entry for {shown}")
    # A name that is both a file and a directory prefix of another file cannot exist on disk.
    names = set(files)
    for rel in files:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                raise ArchiveError(
                    f"{where}: manifest.json lists {'/'.join(parts[:i])!r} both as a file and a directory"
                )
    return m


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_encoding(enc: Any, size: int, what: str) -> None:
    """A compressed member's ``encoding``: the chunk layout must add up exactly."""
    if not isinstance(enc, dict) or sorted(enc) != ["chunk_size", "chunks", "kind", "raw_size"]:
        raise ArchiveError(f"{what} has a bad 'encoding' (need kind, raw_size, chunk_size, chunks)")
    if enc["kind"] != ENCODING_KIND:
        raise ArchiveError(
            f"{what} uses encoding {_one_line(repr(enc['kind']), 40)}, this Foundry reads {ENCODING_KIND!r}"
        )
    raw, chunk, chunks = enc["raw_size"], enc["chunk_size"], enc["chunks"]
    if not _is_count(raw) or raw > _MAX_RAW_SIZE:
        raise ArchiveError(f"{what} has a bad encoding raw_size {_one_line(repr(raw), 40)}")
    if not _is_count(chunk) or not _MIN_CHUNK <= chunk <= _MAX_CHUNK:
        raise ArchiveError(f"{what} has a bad encoding chunk_size {_one_line(repr(chunk), 40)}")
    if (
        not isinstance(chunks, list)
        or len(chunks) != -(-raw // chunk)
        or not all(_is_count(c) and c > 0 for c in chunks)
        or sum(chunks) != size
    ):
        raise ArchiveError(f"{what} has an encoding whose chunks do not add up to its size and raw_size")


def _inflate(data: bytes, start: int, end: int, expected: int) -> bytes | None:
    """One chunk of a compressed member: exactly ``expected`` bytes from one complete zlib stream,
    or None when the chunk is damaged (never more than ``expected`` + 1 bytes are produced)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(memoryview(data)[start:end], expected + 1)
    except zlib.error:
        return None
    if len(out) != expected or not d.eof or d.unused_data or d.unconsumed_tail:
        return None
    return out


def _map_on_threads(fn: Callable[[Any], Any], items: list, threads: int, name: str) -> list:
    """``[fn(x) for x in items]``, on up to ``threads`` threads (for work that releases the GIL)."""
    workers = min(threads, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        return list(pool.map(fn, items))


# deflate cannot expand data more than about 1032:1; a chunk claiming more is damaged, and is
# refused before its claimed size is allocated.
_MAX_INFLATE_RATIO = 1100


@functools.cache
def _bytes_maker():
    make = ctypes.pythonapi.PyBytes_FromStringAndSize
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    return make


def _fresh_bytes(size: int) -> bytes:
    """A new, not yet shared bytes object of ``size`` bytes for native code to fill in place (the
    C-API idiom PyBytes_FromStringAndSize(NULL, n)): no zeroing, no copy after inflating."""
    return _bytes_maker()(None, size)


def _decode_members(contents: dict[str, bytes], files: dict[str, Any], where: str) -> None:
    """Replace each compressed member's stored bytes by its content, inflating all chunks of all
    members on threads; the first damaged member in sorted order is the one reported.

    With the native library each chunk is inflated straight into its place in the member's final
    buffer (native/inflate.c, GIL released); without it, Python's zlib inflates each chunk into its
    own object and the chunks are joined."""
    native = _native.inflate_fn()
    members = sorted(rel for rel in files if files[rel].get("encoding") is not None)
    jobs: list[tuple[str, int, int, int, int]] = []
    targets: dict[str, bytes] = {}
    damaged: set[str] = set()  # known damaged without inflating anything
    for rel in members:
        enc = files[rel]["encoding"]
        chunk_jobs, pos, too_large = [], 0, False
        for i, length in enumerate(enc["chunks"]):
            expected = min(enc["chunk_size"], enc["raw_size"] - i * enc["chunk_size"])
            too_large |= expected > _MAX_INFLATE_RATIO * length + 1024
            chunk_jobs.append((rel, pos, pos + length, i * enc["chunk_size"], expected))
            pos += length
        if too_large:
            damaged.add(rel)
            continue
        if native is not None:
            try:
                targets[rel] = _fresh_bytes(enc["raw_size"])
            except MemoryError:
                raise ArchiveError(
                    f"{where}: file {_one_line(repr(rel), 120)} inflates to {enc['raw_size']} bytes, "
                    "more than this process can allocate"
                ) from None
        jobs += chunk_jobs
    if not members:
        return

    def run(job: tuple[str, int, int, int, int]) -> bytes | bool | None:
        rel, start, end, out_at, expected = job
        if native is None:
            return _inflate(contents[rel], start, end, expected)
        src = _native.bytes_address(contents[rel]) + start
        return native(src, end - start, _native.bytes_address(targets[rel]) + out_at, expected) == 0

    parts = _map_on_threads(run, jobs, _ZLIB_THREADS, "foundry-inflate")
    by_member: dict[str, list] = {rel: [] for rel in members}
    for (rel, _, _, _, _), part in zip(jobs, parts):
        by_member[rel].append(part)
    for rel, chunks in by_member.items():  # sorted
        if rel in damaged or any(part is None or part is False for part in chunks):
            raise ArchiveError(
                f"{where}: file {_one_line(repr(rel), 120)} does not decompress; it is damaged, SAVE again"
            )
        if native is not None:
            contents[rel] = targets[rel]
        else:
            contents[rel] = chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read_exact(fd: int, size: int, what: str) -> bytes:
    """Read exactly ``size`` bytes, allocating at most size + 1; refuse short or grown files.

    One ``os.read`` per GiB: a member up to 1 GiB lands in a single bytes object without a copy.
    """
    chunks: list[bytes] = []
    got = 0
    while got <= size:
        chunk = os.read(fd, min(size + 1 - got, _READ_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got != size:
        raise ArchiveError(
            f"{what} is {'shorter' if got < size else 'longer'} than the expected {size} bytes; "
            "it is damaged or being modified, SAVE again"
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _raise(e: OSError) -> None:
    raise e


def _open_member(root_fd: int, rel: str) -> int:
    """Open ``rel`` below ``root_fd`` refusing a symlink at every component (O_NOFOLLOW each step)."""
    parts = rel.split("/")
    fd = root_fd
    opened: list[int] = []
    try:
        for part in parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            opened.append(fd)
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    finally:
        for d in opened:
            os.close(d)


def _member_error(where: str, rel: str, e: OSError) -> ArchiveError:
    shown = _one_line(repr(rel), 120)
    if e.errno == errno.ENOENT:
        return ArchiveError(f"{where}: file {shown} listed in the manifest is missing; SAVE again")
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return ArchiveError(
            f"{where}: file {shown} is reached through a symlink or non-directory; refusing it"
        )
    return ArchiveError(f"{where}: cannot read file {shown}: {_oserr(e)}")


def _verify(root_fd: int, where: str, expected_fingerprint: dict | None, expected_digest: str | None):
    # 1. manifest: a regular file, bounded size, strict JSON
    try:
        mfd = os.open(
            MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=root_fd
        )
    except FileNotFoundError:
        raise ArchiveError(f"{where}: manifest.json is missing (an interrupted SAVE?); SAVE again") from None
    except OSError as e:
        raise ArchiveError(f"{where}: cannot open manifest.json: {_oserr(e)}") from None
    try:
        st = os.fstat(mfd)
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveError(f"{where}: manifest.json is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ArchiveError(
                f"{where}: manifest.json is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
            )
        try:
            raw = _read_exact(mfd, st.st_size, f"{where}: manifest.json")
        except OSError as e:
            raise ArchiveError(f"{where}: cannot read manifest.json: {_oserr(e)}") from None
    finally:
        os.close(mfd)
    try:
        manifest = _loads(raw)
    except RecursionError:
        raise ArchiveError(
            f"{where}: manifest.json is nested too deeply; it is damaged, SAVE again"
        ) from None
    except ValueError as e:
        raise ArchiveError(
            f"{where}: manifest.json is not valid JSON (truncated or damaged?): {_one_line(str(e), 100)}; SAVE again"
        ) from None
    # 2. schema and version, then the manifest's own checksum (covers meta and fingerprint text,
    #    which no member checksum does)
    _check_manifest(manifest, where)
    if not _self_checksum_matches(raw, manifest):
        raise ArchiveError(
            f"{where}: manifest.json is damaged: its content does not match its own checksum "
            "(manifest_sha256); SAVE again"
        )
    digest = hashlib.sha256(raw).hexdigest()
    # 3. pinned digest and fingerprint: cheap, and a mismatch makes hashing gigabytes pointless
    if expected_digest is not None and digest != expected_digest:
        raise ArchiveError(
            f"{where}: archive digest {digest} does not match the pinned trust.archive_digest {expected_digest}"
        )
    if expected_fingerprint is not None:
        compare_fingerprint(manifest["fingerprint"], expected_fingerprint)
    files: dict[str, Any] = manifest["files"]
    # 4. the tree: nothing but directories and listed regular files, no symlinks anywhere
    seen: set[str] = set()
    try:
        for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=root_fd, onerror=_raise):
            rel_dir = "" if dirpath == "." else dirpath[2:] + "/"
            for name in dirnames + filenames:
                rel = rel_dir + name
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                shown = _one_line(repr(rel), 120)
                if stat.S_ISLNK(st.st_mode):
                    raise ArchiveError(f"{where}: {shown} is a symlink; archives never contain symlinks")
                if stat.S_ISDIR(st.st_mode):
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise ArchiveError(f"{where}: {shown} is not a regular file")
                if rel == MANIFEST_NAME:
                    continue
                if rel not in files:
                    raise ArchiveError(
                        f"{where}: file {shown} is not listed in the manifest; refusing extra content"
                    )
                seen.add(rel)
    except OSError as e:
        raise ArchiveError(f"{where}: cannot list the archive: {_oserr(e)}") from None
    for rel in sorted(files):
        if rel not in seen:
            raise ArchiveError(
                f"{where}: file {_one_line(repr(rel), 120)} listed in the manifest is missing; SAVE again"
            )

    # 5. contents: exact size and sha256, bytes kept for read_bytes. Files are read on this thread
    # (so their memory comes from the main allocator arena), then hashed on a few threads (sha256 of
    # large buffers releases the GIL: most of a LOAD's archive time). The first damaged file in
    # sorted order is the one reported, as with one thread.
    names = sorted(files)
    contents: dict[str, bytes] = {}
    for rel in names:
        size = files[rel]["size"]
        shown = _one_line(repr(rel), 120)
        try:
            fd = _open_member(root_fd, rel)
        except OSError as e:
            raise _member_error(where, rel, e) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArchiveError(f"{where}: {shown} is not a regular file")
            if st.st_size != size:
                raise ArchiveError(
                    f"{where}: file {shown} is {st.st_size} bytes, the manifest lists {size}; it is damaged, SAVE again"
                )
            contents[rel] = _read_exact(fd, size, f"{where}: file {shown}")
        except OSError as e:
            raise _member_error(where, rel, e) from None
        finally:
            os.close(fd)

    def digest_of(rel: str) -> str:
        return hashlib.sha256(contents[rel]).hexdigest()

    digests = _map_on_threads(digest_of, names, _READ_THREADS, "foundry-sha")
    for rel, got in zip(names, digests):
        if got != files[rel]["sha256"]:
            shown = _one_line(repr(rel), 120)
            raise ArchiveError(f"{where}: file {shown} fails its sha256 check; it is damaged, SAVE again")
    # 6. compressed members (format 2): inflated only after their checksums passed
    _decode_members(contents, files, where)
    return manifest, digest, contents


def open_archive(
    path: str | os.PathLike,
    *,
    expected_fingerprint: dict | None = None,
    expected_digest: str | None = None,
) -> Archive:
    """Open and fully verify the archive at ``path`` (see docs/archive-format.md for the order of checks).

    Raises :class:`ArchiveNotFound` when nothing is there, :class:`FingerprintMismatch` when it was saved
    for another setup, :class:`ArchiveError` for anything else.
    """
    p = Path(path)
    where = f"archive {p}"
    if expected_digest is not None:
        if not isinstance(expected_digest, str) or not _HEX64.fullmatch(expected_digest.lower()):
            raise ArchiveError("expected archive digest must be 64 hex characters (sha256)")
        expected_digest = expected_digest.lower()
    if expected_fingerprint is not None and not isinstance(expected_fingerprint, dict):
        raise ArchiveError(f"expected fingerprint must be a dict, got {type(expected_fingerprint).__name__}")
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            root_fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.islink(p):
                raise ArchiveError(
                    f"{where} is a dangling symlink to {os.readlink(p)!r}; SAVE again"
                ) from None
            raise ArchiveNotFound(f"no Foundry archive at {p}; run SAVE first") from None
        except NotADirectoryError:
            raise ArchiveError(f"{where} is not a directory") from None
        except OSError as e:
            raise ArchiveError(f"cannot open {where}: {_oserr(e)}") from None
        try:
            try:
                manifest, digest, contents = _verify(root_fd, where, expected_fingerprint, expected_digest)
            except FingerprintMismatch:
                raise
            except ArchiveError:
                # A concurrent SAVE may have swapped in a new version and removed the one we were reading.
                if attempt + 1 < _OPEN_ATTEMPTS and _swapped(p, root_fd):
                    continue
                raise
            return Archive(p, manifest, digest, contents)
        finally:
            os.close(root_fd)
    raise AssertionError("unreachable")  # pragma: no cover


def _swapped(p: Path, root_fd: int) -> bool:
    try:
        now = os.stat(p)
        was = os.fstat(root_fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino)


# --------------------------------------------------------------------------------------------------
# fingerprints


def _show(value: Any) -> str:
    return _one_line(repr(value), 120)


def _canon(value: Any, field: str, side: str) -> bytes:
    try:
        return _dumps(canonical_json_value(value, f"{side} fingerprint {field}"))
    except ValueError as e:
        raise ArchiveError(_one_line(str(e))) from None
    except RecursionError:
        raise ArchiveError(f"{side} fingerprint {field}: nested too deeply") from None


def _mismatch(field: str, saved: Any, current: Any) -> FingerprintMismatch:
    if saved is MISSING:
        text = f"archive was saved without {field}, this machine has {_show(current)}"
    elif current is MISSING:
        text = f"archive was saved for {field}={_show(saved)}, this machine has no {field}"
    else:
        text = f"archive was saved for {field}={_show(saved)}, this machine has {_show(current)}"
    return FingerprintMismatch(text + "; SAVE again on this setup", field, saved, current)


def _compare_values(field: str, saved: Any, current: Any) -> None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current), key=str):
            _compare_values(f"{field}.{key}", saved.get(key, MISSING), current.get(key, MISSING))
        return
    if saved is MISSING or current is MISSING:
        raise _mismatch(field, saved, current)
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        # Name the first difference: long lists (capture sizes) would otherwise print alike once cut.
        for i, (a, b) in enumerate(zip(saved, current)):
            _compare_values(f"{field}[{i}]", a, b)
        if len(saved) != len(current):
            n = min(len(saved), len(current))
            raise _mismatch(f"{field}[{n}:]", list(saved[n:]), list(current[n:]))
        return
    # Compare JSON encodings: a tuple equals the list JSON gives back, but True != 1 and 1 != 1.0.
    if _canon(saved, field, "saved") != _canon(current, field, "current"):
        raise _mismatch(field, saved, current)


def compare_fingerprint(saved: Mapping, current: Mapping) -> None:
    """Raise :class:`FingerprintMismatch` naming the first differing field.

    Order: :data:`~foundry_core.fingerprint.FINGERPRINT_FIELDS` (the fingerprint scheme, GPU, driver,
    CUDA, torch, Foundry, rank layout, ``model``), then any other keys sorted. Dict values (``model``)
    are compared key by key in sorted order and reported as ``model.<key>``. A key present on one
    side only is a mismatch. Values are compared as JSON (a tuple equals a list; ``True`` != ``1``).
    """
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping):
        raise ArchiveError("fingerprints must be dicts")
    order = list(FINGERPRINT_FIELDS) + sorted((set(saved) | set(current)) - set(FINGERPRINT_FIELDS), key=str)
    for field in order:
        _compare_values(str(field), saved.get(field, MISSING), current.get(field, MISSING))


# --------------------------------------------------------------------------------------------------
# removal


def remove_archive(path: str | os.PathLike, *, lock_timeout: float = 0.0) -> None:
    """Remove the archive at ``path`` (atomically: it is gone as a whole) with its leftovers.

    Nothing there is fine. A path that is not a Foundry archive is refused, not deleted. The
    ``.<name>.lock`` file stays: deleting a lock file that others may be waiting on is unsafe.
    """
    names = _Names(path)
    lock = _Lock(names, float(lock_timeout), "remove")
    lock.acquire()
    try:
        kind = _classify(names)
        if kind in ("ours", "link"):
            os.unlink(names.path)
        elif kind in ("plain", "empty"):
            aside = names.scratch("old")
            os.rename(names.path, aside)
            _rmtree(aside)
        if kind != "absent":
            _fsync_path(names.parent)
        _clean_siblings(names, keep=None, versions=True)
    except OSError as e:
        raise ArchiveError(f"cannot remove archive {names.path}: {_oserr(e)}") from None
    finally:
        lock.release()
