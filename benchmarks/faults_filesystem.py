"""Privileged file-system tricks engine_faults needs as root (mounts, writability probes) and the
removal of folders a previous call may have left mounted or read-only."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def run_command(argv: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return done.returncode == 0, (done.stderr or done.stdout).strip()[-300:]


def writable(path: Path) -> bool:
    """Whether a file can be created in ``path`` (making the directory if needed), as the plugins'
    startup check does."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".faults-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def read_only_mounts() -> list[Path]:
    """Read-only mounts a test may point an archive directory at: only well-known system ones."""
    found = []
    try:
        rows = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    for row in rows:
        parts = row.split()
        if len(parts) < 4:
            continue
        mount = parts[1].replace("\\040", " ")
        if mount in ("/sys", "/proc/sys", "/sys/fs/cgroup") and "ro" in parts[3].split(","):
            found.append(Path(mount))
    return found


def clean_dir(path: Path) -> None:
    """Remove a folder a previous call may have left mounted or read-only."""
    if not path.exists():
        return
    for m in sorted(_mounts_under(path), key=len, reverse=True):
        run_command(["umount", "-l", m])
    for dirpath, dirs, _files in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(Path(dirpath, d), 0o755)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    try:
        rows = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    prefix = str(path.resolve())
    return [
        r.split()[1] for r in rows if len(r.split()) > 1 and (r.split()[1] + "/").startswith(prefix + "/")
    ]
