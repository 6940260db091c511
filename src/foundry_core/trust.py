"""Where an archive may be loaded from, and who could have written it.

An archive is machine code plus raw device pointers, so loading one is running it. Two cheap
guards sit in front of the checksums and the fingerprint: the archive must resolve to a place under
the directory the operator configured (a symlink swapped to point elsewhere is refused), and an
archive or directory that anyone on the machine can write is reported, since anyone could then
have replaced it with a consistent, checksummed archive of their own.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

from .archive import ArchiveError


class ArchiveLocationError(ArchiveError):
    """The archive resolves outside the directory it may be loaded from."""


class WritableArchiveWarning(UserWarning):
    """An archive (or a directory above it) is writable by every user of the machine."""


def check_location(path: str | os.PathLike, trusted_root: str | os.PathLike) -> Path:
    """Resolve ``path`` (following symlinks) and require it to lie under ``trusted_root``."""
    root = Path(trusted_root).resolve()
    real = Path(path).resolve()
    if real != root and root not in real.parents:
        raise ArchiveLocationError(
            f"archive {path} resolves to {real}, outside the configured directory {root}: refusing to load it"
        )
    return real


def _open_to_all(mode: int) -> bool:
    # A symlink's own mode reads 0777 on Linux but grants nothing; what it points to is checked
    # on its own (and archives never contain symlinks: open_archive refuses them).
    if stat.S_ISLNK(mode):
        return False
    return bool(mode & stat.S_IWOTH) and not (stat.S_ISDIR(mode) and mode & stat.S_ISVTX)


def world_writable(path: str | os.PathLike, stop_at: str | os.PathLike | None = None) -> list[Path]:
    """What every user may write: files and directories inside the archive, the archive itself, and
    its parents (up to ``stop_at``, inclusive).

    A sticky directory (like /tmp) only lets owners replace their own entries, so it is not counted.
    """
    found = []
    real = Path(path).resolve()
    if real.is_dir():
        for dirpath, dirnames, filenames in os.walk(real):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                try:
                    if _open_to_all(p.lstat().st_mode):
                        found.append(p)
                except OSError:
                    continue
    stop = Path(stop_at).resolve() if stop_at is not None else None
    for p in (real, *real.parents):
        try:
            mode = p.stat().st_mode
        except OSError:
            break
        if _open_to_all(mode):
            found.append(p)
        if stop is not None and p == stop:
            break
    return found


def warn_if_world_writable(path: str | os.PathLike, stop_at: str | os.PathLike | None = None) -> list[Path]:
    found = world_writable(path, stop_at)
    if found:
        warnings.warn(
            f"Foundry archive {path}: {found[0]} is writable by every user; anyone on this machine could "
            "replace the archive (chmod o-w, or pin trust.archive_digest)",
            WritableArchiveWarning,
            stacklevel=3,
        )
    return found
