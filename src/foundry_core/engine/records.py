"""Files the engine layer writes beside an archive: records, manifests and start reports.

One format for every engine: JSON, written to a temporary sibling, flushed and fsynced, renamed over
the old file, and the directory fsynced. A record that marks a SAVE finished must never be seen
half-written or lost after a crash once the rename was reported.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically and durably.

    The temporary sibling is named ``<name>.<host>-<pid>.<random>.tmp``; one left by a writer on
    this host that was killed (its process is gone) is removed by the next write of the same record.
    Another host's (or container's) temporaries are left alone: its processes cannot be seen here."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.{_writer()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a crash only once the directory is on disk
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    _remove_orphans(path)


def _host() -> str:
    """This host's name reduced to characters safe in a file name (no ``-``: it ends the host)."""
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def _writer() -> str:
    """``<host>-<pid>`` of this process."""
    return f"{_host()}-{os.getpid()}"


def _remove_orphans(path: Path) -> None:
    """Remove temporaries of ``path`` written on this host by processes that no longer exist."""
    host = _host()
    for tmp in path.parent.glob(f"{path.name}.{host}-*.tmp"):
        pid = tmp.name[len(path.name) + len(host) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def read_json(path: str | os.PathLike) -> Any | None:
    """The JSON at ``path``, or None when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
