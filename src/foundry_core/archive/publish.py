"""Publishing an archive safely beside others: sibling names, the lock, the atomic swap, cleanup.

On disk, ``path`` is a symlink to a sibling ``.<name>.<digest16>`` directory. A SAVE builds a new
sibling under a scratch name, renames it to its versioned name and swaps the symlink atomically
(replacing a plain directory from an older layout with ``renameat2(RENAME_EXCHANGE)`` where the
system has it), so ``path`` is always either absent, the complete old archive or the complete new
one. Separate from the writer because it is all about the directory that holds the archive, not
its content: what may be replaced (:func:`_classify`), who may write (:class:`_Lock`), what is
left over (:func:`_clean_siblings`), and the fsyncs that make each step durable. Removal of an
archive (:func:`remove_archive`) follows the same rules.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable

from .errors import ArchiveError, ArchiveSuperseded, _oserr
from .format import FORMAT, MANIFEST_NAME, MAX_MANIFEST_BYTES


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


#: ``expected_version`` of :class:`ArchiveWriter` that accepts whatever is published (the default).
ANY_VERSION: object = type("AnyVersion", (), {"__repr__": lambda self: "ANY_VERSION"})()


def published_version(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """Which publication the archive at ``path`` is now, or None when none is published: the
    identity (inode, modification time, size) of the manifest it resolves to. Every publication
    puts a new manifest file in place, so two calls return the same value only when no SAVE
    published in between. A caller deciding to SAVE takes it and passes it to
    :class:`ArchiveWriter` as ``expected_version``."""
    try:
        st = os.stat(os.path.join(os.fspath(path), MANIFEST_NAME))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def require_version(path: str | os.PathLike, expected: object) -> None:
    """Raise :class:`ArchiveSuperseded` when the archive at ``path`` is no longer the publication
    ``expected`` (:func:`published_version`); :data:`ANY_VERSION` accepts anything. Only final under
    the archive's lock, where :class:`ArchiveWriter` calls it."""
    if expected is not ANY_VERSION and published_version(path) != expected:
        raise ArchiveSuperseded(
            f"not saving {os.fspath(path)}: another SAVE published it since this one began; its archive stays"
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


def _publish(names: _Names, tmp: str, dirs: Iterable[str], data: bytes, digest: str) -> None:
    """Write the manifest ``data`` last into the finished scratch directory ``tmp`` (whose member
    directories are ``dirs``), make it durable, and make it the archive at ``names.path``."""
    fd = os.open(os.path.join(tmp, MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    for d in sorted(dirs, key=lambda s: s.count("/"), reverse=True):
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
                f"cannot publish archive {names.path}: digest prefix collides with the live version"
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
