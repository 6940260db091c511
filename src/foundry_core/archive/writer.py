"""Writing an archive: :class:`ArchiveWriter` collects members and commits them with their manifest.

Separate from reading because a SAVE and a LOAD share only the format rules (format.py): the
writer builds the archive in a scratch directory beside the target, under the lock, compresses
members on threads (codec.py) and hands the finished directory to publish.py, which swaps it in
atomically.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import hashlib
import os
from pathlib import Path
from typing import Any

from foundry_core import __version__

from .codec import _COMPRESS_MIN, _chunk_encoding, _compress_pool, _start_compressing
from .errors import ArchiveError, _oserr
from .format import (
    FORMAT,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    _dumps,
    _entry,
    _json_data,
    _manifest_bytes,
    _self_checksum,
    check_relpath,
)
from .publish import (
    ANY_VERSION,
    _classify,
    _clean_siblings,
    _fsync_path,
    _Lock,
    _Names,
    _publish,
    _rmtree,
    _write_all,
    require_version,
)


class ArchiveWriter:
    """Builds an archive in a temporary sibling directory and publishes it atomically on :meth:`commit`.

    Use as a context manager: ``__enter__`` takes the lock (``lock_timeout`` seconds of waiting; 0
    refuses at once when another SAVE holds it) and creates the temporary directory; leaving the block
    without a commit (an exception, KeyboardInterrupt) removes the temporary directory and leaves any
    existing archive untouched.

    ``expected_version``: publish only over this publication of ``path`` (:func:`published_version`
    taken when the caller decided to SAVE; None: only where none is published). When another SAVE
    published since, ``__enter__`` raises :class:`ArchiveSuperseded` under the lock, before anything
    is written: of two replicas that decided to SAVE at the same moment, only the first publishes.
    The default replaces whatever is there.
    """

    def __init__(
        self, path: str | os.PathLike, *, lock_timeout: float = 0.0, expected_version: object = ANY_VERSION
    ):
        self._names = _Names(path)
        self.path = Path(self._names.path)
        self._lock = _Lock(self._names, float(lock_timeout), "SAVE into")
        self._expected = expected_version
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
            require_version(self._names.path, self._expected)
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
                self._pool = _compress_pool()
            self._pending[relpath] = (view, _start_compressing(self._pool, view))
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
            encoding = _chunk_encoding(len(view), chunks)
            if encoding is None:
                self._files[relpath] = (*self._write_file(tmp, relpath, [view]), None)
                continue
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
            _publish(self._names, tmp, self._dirs, data, digest)
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
