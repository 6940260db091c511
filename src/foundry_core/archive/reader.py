"""Reading an archive: :func:`open_archive` verifies everything, then hands out an in-memory :class:`Archive`.

The order of checks (docs/archive-format.md): the manifest (a bounded regular file, strict JSON,
its schema and its own checksum), the pinned digest and the fingerprint (cheap, before any member
is read), the tree (nothing unlisted, no symlinks), then every member's size and sha256, and last
the inflation of compressed members. Separate from the writer because it is the trust boundary:
nothing here writes, and nothing is re-read from disk once verified.

Inflating can wait (``open_archive(..., inflate=False)``): every check that can refuse the archive has
run by then, since each member's checksum covers its stored (compressed) bytes, and a LOAD's start
has better things to do with that half second than wait for it (:meth:`Archive.inflate_ahead`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .codec import BACKGROUND_THREADS, _decode_members, _map_on_threads
from .errors import ArchiveError, ArchiveNotFound, FingerprintMismatch, _one_line, _oserr
from .format import _HEX64, MANIFEST_NAME, MAX_MANIFEST_BYTES, _check_manifest, _loads, _self_checksum_matches

# Threads that hash archive files at open; sha256 runs at ~1-2 GB/s per core.
_READ_THREADS = max(1, min(8, os.cpu_count() or 1))
_READ_CHUNK = 1 << 30
_OPEN_ATTEMPTS = 3


class Archive:
    """A fully verified archive held in memory; nothing is re-read from disk after :func:`open_archive`."""

    def __init__(
        self,
        path: Path,
        manifest: dict,
        digest: str,
        contents: dict[str, bytes],
        pending: Iterable[str] = (),
    ):
        self.path = path
        self.manifest = manifest
        self.digest = digest
        self.meta: dict = manifest["meta"]
        self.fingerprint: dict = manifest["fingerprint"]
        self.format_version: int = manifest["format_version"]
        #: Compressed members whose checksums passed but which are not inflated yet.
        self._pending = set(pending)
        listed = manifest.get("files") or {}
        #: Each member's content size (what :meth:`read_bytes` returns), inflated or not yet.
        self.files: dict[str, int] = {
            rel: listed[rel]["encoding"]["raw_size"] if rel in self._pending else len(b)
            for rel, b in sorted(contents.items())
        }
        self._contents = contents
        self._inflating = threading.Lock()
        #: Seconds of each step of :func:`open_archive` (manifest, tree, read, hash, inflate) and
        #: the bytes read, for start reports.
        self.open_timings: dict[str, float] = {}
        #: Seconds spent inflating after :func:`open_archive` returned (``inflate=False``).
        self.inflate_s = 0.0

    def __repr__(self) -> str:
        return f"Archive({str(self.path)!r}, digest={self.digest[:16]}, files={len(self.files)})"

    def read_bytes(self, relpath: str) -> bytes:
        """The verified bytes of member ``relpath`` (inflated first where that has not happened yet)."""
        if relpath in getattr(self, "_pending", ()):
            self.inflate([relpath])
        try:
            return self._contents[relpath]
        except (KeyError, TypeError):
            raise ArchiveError(f"archive {self.path} has no file {_one_line(repr(relpath), 120)}") from None

    def inflate(self, members: Iterable[str] | None = None, threads: int | None = None) -> None:
        """Inflate the compressed members not inflated yet (``members`` of them; all with None), on
        up to ``threads`` threads (one per core, at most 16, with None).
        Thread-safe: a caller that needs a member another thread is inflating waits for it. Raises
        :class:`ArchiveError` naming the first member, in sorted order, that does not decompress;
        nothing of that call is kept then, so every later read of it raises the same."""
        if not getattr(self, "_pending", None):  # nothing left (or an Archive made without open_archive)
            return
        with self._inflating:
            todo = sorted(self._pending if members is None else self._pending.intersection(members))
            if not todo:
                return
            t0 = time.perf_counter()
            listed = self.manifest["files"]
            work = {rel: self._contents[rel] for rel in todo}
            _decode_members(work, {rel: listed[rel] for rel in todo}, f"archive {self.path}", threads)
            self._contents.update(work)
            self._pending.difference_update(todo)
            self.inflate_s += time.perf_counter() - t0

    def inflate_ahead(self) -> threading.Thread | None:
        """Inflate every pending member on a daemon thread (native inflation and zlib release the
        GIL) and return it, or None when nothing is pending. It inflates on half the cores
        (:data:`~foundry_core.archive.codec.BACKGROUND_THREADS`), leaving the rest to the work it
        overlaps; a reader that needs a member before it is done waits for it. A member that does not
        decompress is reported where it is read (:meth:`read_bytes`), not on the thread."""
        if not getattr(self, "_pending", None):  # nothing left (or an Archive made without open_archive)
            return None

        def run() -> None:
            try:
                self.inflate(threads=BACKGROUND_THREADS)
            except ArchiveError:  # read_bytes of that member raises it again, in its caller
                pass

        thread = threading.Thread(target=run, name="foundry-inflate-ahead", daemon=True)
        thread.start()
        return thread

    def read_json(self, relpath: str) -> Any:
        """Member ``relpath`` parsed as strict JSON."""
        data = self.read_bytes(relpath)
        try:
            return _loads(data)
        except (ValueError, RecursionError) as e:
            raise ArchiveError(
                f"archive {self.path}: {relpath} is not valid JSON: {_one_line(str(e), 120)}"
            ) from None


def _read_exact(fd: int, size: int, what: str) -> bytes:
    """Read exactly ``size`` bytes, allocating at most size + 1; refuse short or grown files.

    One ``os.read`` per GiB: a member up to 1 GiB lands in a single bytes object without a copy.
    Callers pass regular files only (a pipe may stop short anywhere).
    """
    chunks: list[bytes] = []
    got = 0
    while got <= size:
        want = min(size + 1 - got, _READ_CHUNK)
        chunk = os.read(fd, want)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        if got == size and len(chunk) < want:
            break  # a regular file's read stops short only at its end: no second read to see it
    if got != size:
        raise ArchiveError(
            f"{what} is {'shorter' if got < size else 'longer'} than the expected {size} bytes; "
            "it is damaged or being modified, SAVE again"
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_member(root_fd: int, rel: str, dirs: _DirFds | None = None) -> int:
    """Open ``rel`` below ``root_fd`` refusing a symlink at every component (O_NOFOLLOW each step).
    ``dirs`` keeps the directories opened for the previous member, so that members read in sorted
    order open each directory once, not once per member; without it, this member's are closed again."""
    parts = rel.split("/")
    chain = dirs if dirs is not None else _DirFds(root_fd)
    try:
        return os.open(
            parts[-1],
            os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
            dir_fd=chain.open(parts[:-1]),
        )
    finally:
        if dirs is None:
            chain.close()


class _DirFds:
    """The chain of directories (each opened with O_NOFOLLOW below the one before) leading to the
    member read last; :meth:`open` keeps the part it shares with the next member's directory. A
    caches archive has ~130 members three directories deep: this saves six system calls on each,
    and each system call hands the GIL over to whichever thread wants it."""

    def __init__(self, root_fd: int):
        self.root_fd = root_fd
        self.names: list[str] = []
        self.fds: list[int] = []

    def open(self, parts: list[str]) -> int:
        keep = 0
        while keep < len(self.names) and keep < len(parts) and self.names[keep] == parts[keep]:
            keep += 1
        self._close_from(keep)
        for part in parts[keep:]:
            fd = os.open(part, _DIR_FLAGS, dir_fd=self.fds[-1] if self.fds else self.root_fd)
            self.names.append(part)
            self.fds.append(fd)
        return self.fds[-1] if self.fds else self.root_fd

    def _close_from(self, keep: int) -> None:
        while len(self.fds) > keep:
            self.names.pop()
            os.close(self.fds.pop())

    def close(self) -> None:
        self._close_from(0)


def _member_error(where: str, rel: str, e: OSError) -> ArchiveError:
    shown = _one_line(repr(rel), 120)
    if e.errno == errno.ENOENT:
        return ArchiveError(f"{where}: file {shown} listed in the manifest is missing; SAVE again")
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return ArchiveError(
            f"{where}: file {shown} is reached through a symlink or non-directory; refusing it"
        )
    return ArchiveError(f"{where}: cannot read file {shown}: {_oserr(e)}")


def _walk_tree(root_fd: int, where: str, files: dict[str, Any]) -> set[str]:
    """The listed members found below ``root_fd``; refuses a symlink, anything but a directory or
    a regular file, and a file the manifest does not list. Each directory is listed once, below
    the one before it (O_NOFOLLOW); an entry's type comes from the listing itself (d_type), so an
    entry costs no system call of its own (os.fwalk plus a stat per entry cost one each)."""
    seen: set[str] = set()
    todo = [("", os.dup(root_fd))]
    try:
        while todo:
            rel_dir, dfd = todo.pop()
            try:
                with os.scandir(dfd) as listing:
                    entries = list(listing)
                for entry in entries:
                    rel = rel_dir + entry.name
                    shown = _one_line(repr(rel), 120)
                    if entry.is_symlink():
                        raise ArchiveError(f"{where}: {shown} is a symlink; archives never contain symlinks")
                    if entry.is_dir(follow_symlinks=False):
                        todo.append((rel + "/", os.open(entry.name, _DIR_FLAGS, dir_fd=dfd)))
                        continue
                    if not entry.is_file(follow_symlinks=False):
                        raise ArchiveError(f"{where}: {shown} is not a regular file")
                    if rel == MANIFEST_NAME:
                        continue
                    if rel not in files:
                        raise ArchiveError(
                            f"{where}: file {shown} is not listed in the manifest; refusing extra content"
                        )
                    seen.add(rel)
            finally:
                os.close(dfd)
    finally:
        for _, dfd in todo:
            os.close(dfd)
    return seen


def _verify(
    root_fd: int, where: str, expected_fingerprint: dict | None, expected_digest: str | None, inflate: bool
):
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
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
        # Imported here: foundry_core.fingerprint imports this package for its error types.
        from foundry_core.fingerprint import compare_fingerprint

        compare_fingerprint(manifest["fingerprint"], expected_fingerprint)
    files: dict[str, Any] = manifest["files"]
    timings["manifest_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    # 4. the tree: nothing but directories and listed regular files, no symlinks anywhere
    try:
        seen = _walk_tree(root_fd, where, files)
    except OSError as e:
        raise ArchiveError(f"{where}: cannot list the archive: {_oserr(e)}") from None
    for rel in sorted(files):
        if rel not in seen:
            raise ArchiveError(
                f"{where}: file {_one_line(repr(rel), 120)} listed in the manifest is missing; SAVE again"
            )

    timings["tree_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    # 5. contents: exact size and sha256, bytes kept for read_bytes. Files are read on this thread
    # (so their memory comes from the main allocator arena), then hashed on a few threads (sha256 of
    # large buffers releases the GIL: most of a LOAD's archive time). The first damaged file in
    # sorted order is the one reported, as with one thread.
    names = sorted(files)
    contents: dict[str, bytes] = {}
    dirs = _DirFds(root_fd)
    try:
        for rel in names:
            size = files[rel]["size"]
            try:
                fd = _open_member(root_fd, rel, dirs)
            except OSError as e:
                raise _member_error(where, rel, e) from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ArchiveError(f"{where}: {_one_line(repr(rel), 120)} is not a regular file")
                if st.st_size != size:
                    raise ArchiveError(
                        f"{where}: file {_one_line(repr(rel), 120)} is {st.st_size} bytes, the manifest "
                        f"lists {size}; it is damaged, SAVE again"
                    )
                contents[rel] = _read_exact(fd, size, f"{where}: file {_one_line(repr(rel), 120)}")
            except OSError as e:
                raise _member_error(where, rel, e) from None
            finally:
                os.close(fd)
    finally:
        dirs.close()

    timings["read_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    timings["stored_bytes"] = float(sum(len(b) for b in contents.values()))
    # What the members hold once inflated: the inflating's work, for start reports.
    timings["content_bytes"] = float(
        sum((files[rel].get("encoding") or {}).get("raw_size", files[rel]["size"]) for rel in names)
    )

    def digest_of(rel: str) -> str:
        return hashlib.sha256(contents[rel]).hexdigest()

    digests = _map_on_threads(
        digest_of, names, _READ_THREADS, "foundry-sha", [len(contents[r]) for r in names]
    )
    for rel, got in zip(names, digests):
        if got != files[rel]["sha256"]:
            shown = _one_line(repr(rel), 120)
            raise ArchiveError(f"{where}: file {shown} fails its sha256 check; it is damaged, SAVE again")
    timings["hash_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    # 6. compressed members (format 2): inflated only after their checksums passed, or left to the
    # Archive (inflate=False)
    pending = sorted(rel for rel in names if files[rel].get("encoding") is not None)
    if inflate:
        _decode_members(contents, files, where)
        pending = []
    timings["inflate_s"] = time.perf_counter() - t0
    return manifest, digest, contents, timings, pending


def open_archive(
    path: str | os.PathLike,
    *,
    expected_fingerprint: dict | None = None,
    expected_digest: str | None = None,
    inflate: bool = True,
) -> Archive:
    """Open and fully verify the archive at ``path`` (see docs/archive-format.md for the order of checks).
    ``inflate=False``: compressed members are inflated when first read, or by
    :meth:`Archive.inflate_ahead`, after every check has passed.

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
                manifest, digest, contents, timings, pending = _verify(
                    root_fd, where, expected_fingerprint, expected_digest, inflate
                )
            except FingerprintMismatch:
                raise
            except ArchiveError:
                # A concurrent SAVE may have swapped in a new version and removed the one we were reading.
                if attempt + 1 < _OPEN_ATTEMPTS and _swapped(p, root_fd):
                    continue
                raise
            archive = Archive(p, manifest, digest, contents, pending)
            archive.open_timings = {k: round(v, 4) for k, v in timings.items()}
            return archive
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
