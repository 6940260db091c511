"""Workers forked from a fork server that imported the heavy third-party modules ahead.

Where an engine's launcher has initialised CUDA before it starts its workers (SGLang 0.5.23 on a GPU
host: a kernel module asks the GPU for its name at import), a worker forked from the launcher could
not use CUDA, so the engine spawns it, and each spawned worker imports torch and the engine again
(24.5 s of a 64 s SGLang LOAD on an H200). A fork server started from the plugin's ``register()``,
before the launcher's own heavy imports, is a fresh interpreter that never touches CUDA: it imports
the third-party modules the plugin names while the launcher goes on, and each worker forked from it
starts with them in place (``multiprocessing``'s ``forkserver`` start method).

A worker forked from the server must get what a spawned one gets from the launcher at
``Process.start()``. :class:`WithLaunchState` wraps the worker's target: when ``multiprocessing``
pickles the process (inside ``start()``, after the engine has set that worker's variables) it takes
the launcher's environment, resource limits, CPU affinity and umask along, and the worker applies
them before anything else of the process object is unpickled. The server's own parent is the
launcher: a worker that tells its parent about a failure (SGLang's schedulers send ``SIGQUIT``) tells
the server, which passes the signal on (:mod:`foundry_core.forkserver_preload`).

:func:`start` is cheap (the server is a new interpreter; its imports run there) and never raises.
When its preload is done the server writes a report (what it imported, whether an import initialised
CUDA, which environment variables the imports read and the values they saw); :func:`unusable` waits
for it before the first worker would fork, so that a server no worker could use CUDA from, or whose
modules may keep a setting the launcher changed after the preload read it, is passed over for a
spawned start, with the reason, instead of failing the worker or running it with the old setting.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from foundry_core.forkserver_preload import code_site, in_stdlib

#: The modules the server imports, for :mod:`foundry_core.forkserver_preload` (set while it starts).
PRELOAD_ENV = "FOUNDRY_FORKSERVER_PRELOAD"
#: Where the server writes its report once the preload is done (set while it starts).
REPORT_ENV = "FOUNDRY_FORKSERVER_REPORT"
#: How long a launcher waits for the server's preload before it starts its workers without it. The
#: preload imports what the launcher imports at the same time, so it is normally done by then.
READY_TIMEOUT_S = 180.0
_PRELOAD_MODULE = "foundry_core.forkserver_preload"
# Resource limits a launcher may change after the server started (SGLang raises the open-file and
# stack limits in _set_envs_and_config): the worker takes the launcher's values at start.
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_NPROC")
_started: tuple[str, ...] | None = None
_resynced: tuple[str, ...] = ()
_report: Path | None = None
_unusable: str | None = None  # once the report is read
#: Variable -> where the launcher last set or removed it after the server started ("file:line" of
#: the first frame outside the standard library), for the reason a server is passed over.
_changed_by: dict[str, str] = {}


def start(preload: Sequence[str], log: logging.Logger | None = None, resynced: Sequence[str] = ()) -> bool:
    """Start the fork server, which imports ``preload`` (best effort, in its own process). Never raises.
    ``resynced``: environment variables the workers apply again to the modules that read them at
    import (a launcher may change them after the preload read them)."""
    global _started, _report, _unusable, _resynced
    if _started is not None:
        return True
    try:
        import multiprocessing
        from multiprocessing import forkserver

        if "forkserver" not in multiprocessing.get_all_start_methods():
            return False
        multiprocessing.get_context("forkserver").set_forkserver_preload([_PRELOAD_MODULE])
        folder = tempfile.mkdtemp(prefix="foundry-forkserver-")  # this user's only: nobody else writes it
        atexit.register(shutil.rmtree, folder, True)
        _report, _unusable = Path(folder) / "report.json", None
        os.environ[PRELOAD_ENV] = ",".join(preload)
        os.environ[REPORT_ENV] = str(_report)
        try:
            forkserver.ensure_running()
        finally:
            # The launcher's own environment, as the user gave it.
            os.environ.pop(PRELOAD_ENV, None)
            os.environ.pop(REPORT_ENV, None)
    except Exception as e:  # noqa: BLE001 - an optimisation: the workers are spawned instead
        if log is not None:
            log.debug("Foundry: fork server not started (%s)", e)
        return False
    _started, _resynced = tuple(preload), tuple(resynced)
    try:  # audit hooks stay for the process's life: the hook itself returns at once for other events
        sys.addaudithook(_note_environment_change)
    except Exception:  # noqa: BLE001 - only the reason's detail is lost
        pass
    return True


def _note_environment_change(event: str, args: tuple) -> None:
    """Audit hook (``os.environ`` assignments and removals raise ``os.putenv``/``os.unsetenv``):
    where each variable was last changed. Never raises: an exception here would reach the caller."""
    if event != "os.putenv" and event != "os.unsetenv":
        return
    try:
        frame = sys._getframe(1)
        while frame is not None and (
            in_stdlib(frame.f_code.co_filename) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back
        if frame is not None:
            _changed_by[os.fsdecode(args[0])] = code_site(frame.f_code.co_filename, frame.f_lineno)
    except Exception:  # noqa: BLE001 - see above
        pass


def running() -> tuple[str, ...] | None:
    """The modules the server this process started imports, or None where it started none."""
    if _started is None:
        return None
    return _started if _server_pid() is not None else None


def _server_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _server_alive(pid: int) -> bool:
    try:  # WNOWAIT: an exited server stays waitable for multiprocessing's own check
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def unusable(timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """Why workers cannot fork from the server this process started, or None where they can. Waits
    (up to ``timeout_s``) for the server's preload to finish, as a worker forked from it would.
    Never raises."""
    global _unusable
    if _started is None or _report is None:
        return "no fork server was started"
    if _unusable is not None:
        return _unusable
    pid = _server_pid()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            report = json.loads(_report.read_text())
            break
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            _unusable = f"its preload report is unreadable ({e})"
            return _unusable
        if pid is None or not _server_alive(pid):
            _unusable = "it exited before its preload was done"
            return _unusable
        if time.monotonic() >= deadline:
            return f"its preload was not done within {timeout_s:.0f} s"
        time.sleep(0.05)
    if report.get("cuda_initialised"):
        imported = ", ".join(report.get("imported") or []) or "its modules"
        _unusable = f"it initialised CUDA while importing {imported}"
        return _unusable
    # Not kept: the launcher's environment may change again before its next launch.
    return _kept_settings(
        report.get("env_read") or {},
        report.get("env_prefixes") or [],
        report.get("env_listed") or [],
        process_environ(),
        _resynced,
        _changed_by,
        report.get("env_readers") or {},
        report.get("loader_env") or {},
        report.get("env_grown") or {},
    )


def _kept_settings(
    read: dict,
    prefixes: list,
    listed: list,
    environ: Any,
    resynced: Sequence[str],
    changed_by: dict[str, str] | None = None,
    readers: dict[str, list[str]] | None = None,
    loader_env: dict[str, str | None] | None = None,
    grown: dict[str, list[str]] | None = None,
) -> str | None:
    """Why a worker forked from the server could keep a setting other than ``environ``'s, or None.
    ``readers``: where the preload read each variable; a change none of them keeps is harmless.
    ``loader_env``: the values the server's dynamic loader started with, which its workers keep.
    ``grown``: the readers that read a variable only to set it in the same call, which keep nothing."""
    from foundry_core.forkserver_preload import environment_changes

    if listed:
        return f"its preload went through the whole environment ({listed[0]})"
    readers = readers or {}
    by = changed_by or {}
    for name, seen in sorted((loader_env or {}).items()):
        if loader_view(name, seen) != loader_view(name, environ.get(name)):
            where = f", by {by[name]}" if name in by else ""
            return (
                f"its dynamic loader took {name} when it started ({_how_changed(seen, environ.get(name))}"
                f"{where} since), and a worker forked from it searches as the server does"
            )
    grown = grown or {}
    changed = [
        n
        for n in environment_changes(read, prefixes, environ, resynced)
        if not _kept_by_none(
            n, read.get(n), environ.get(n), readers.get(n) or [], by.get(n), grown.get(n) or ()
        )
    ]
    if not changed:
        return None
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    # How each one changed, never the values (a variable may hold a secret).
    shown = [
        f"{n} ({_how_changed(read.get(n), environ.get(n))}{', by ' + by[n] if n in by else ''}"
        f"{'; read by ' + ', '.join(readers[n]) if readers.get(n) else ''})"
        for n in changed[:3]
    ]
    return (
        f"its preload read {', '.join(shown)}{more} before the launcher changed "
        f"{'it' if len(changed) == 1 else 'them'}, and a module may keep what it read"
    )


def _libcuda_folders(value: str | None) -> list[str]:
    """Triton's view of ``LD_LIBRARY_PATH`` (``triton.backends.nvidia.driver.libcuda_dirs``, cached
    for the process): at most the folders on it that hold ``libcuda.so.1``, in order."""
    return [d for d in (value or "").split(":") if d and os.path.isfile(os.path.join(d, "libcuda.so.1"))]


#: (variable, the file that reads it, below site-packages) -> what that reader keeps of the value.
#: A change that leaves the view of every reader as it was is harmless to a forked worker: OpenCV,
#: imported by SGLang's launcher after the server's preload, puts its own library folder (no
#: ``libcuda.so.1`` there) at the front of ``LD_LIBRARY_PATH``, which Triton's driver read.
READER_VIEWS: dict[tuple[str, str], Callable[[str | None], Any]] = {
    ("LD_LIBRARY_PATH", "triton/backends/nvidia/driver.py"): _libcuda_folders,
}


def loader_view(name: str, value: str | None) -> Any:
    """What the dynamic loader makes of ``value``: for ``LD_LIBRARY_PATH`` the folders on it that
    hold a shared library, in order (an empty entry is the working folder, as glibc reads it); a
    folder with none, or none at all, changes no library a worker finds. Other variables as given."""
    if name != "LD_LIBRARY_PATH":
        return value
    folders = []
    for entry in re.split("[:;]", value or ""):
        folder = os.path.realpath(entry or ".")
        try:
            if folder not in folders and any(".so" in f for f in os.listdir(folder)):
                folders.append(folder)
        except OSError:  # gone, not a folder, unreadable: the loader skips it too
            continue
    return folders


def _kept_by_none(
    name: str,
    seen: str | None,
    now: str | None,
    readers: list[str],
    changer: str | None = None,
    grown: Sequence[str] = (),
) -> bool:
    """Whether every recorded reader of ``name`` keeps only a view of it that ``seen`` and ``now``
    share (False where a reader is unknown, or there were more than the preload lists). A reader
    that read the value only to set it in the same call (``grown``, seen by the preload: OpenCV 5's
    loader grows ``LD_LIBRARY_PATH`` in a helper function) or at the very line that made the
    launcher's change (``changer``: OpenCV 4 does it in one statement) keeps nothing: what it made
    is the launcher's value, which the worker is handed (:func:`apply_launch_state`)."""
    if not readers:
        return False
    for reader in readers:
        if reader == changer or reader in grown:
            continue
        file = reader.rsplit(":", 1)[0]
        view = next(
            (
                v
                for (var, f), v in READER_VIEWS.items()
                if var == name and (file == f or file.endswith("/" + f))
            ),
            None,
        )
        if view is None or view(seen) != view(now):
            return False
    return True


def _how_changed(seen: str | None, now: str | None) -> str:
    """How a variable went from what the preload saw to the launcher's value, in a word or two."""
    if seen is None:
        return "set since"
    if now is None:
        return "unset since"
    if now.startswith(seen):
        return "grown at the end"
    if now.endswith(seen):
        return "grown at the front"
    if seen.startswith(now) or seen.endswith(now):
        return "shortened"
    return "another value"


class WithLaunchState:
    """A worker target that carries the launcher's process state from ``Process.start()`` to the worker."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.state: dict[str, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled inside Process.start(): the state is the launcher's at that moment.
        return {"func": self.func, "state": launch_state()}

    def __setstate__(self, data: dict[str, Any]) -> None:
        # Unpickled in the worker before the process's arguments, so that they and the target
        # run under the launcher's environment.
        apply_launch_state(data["state"])
        self.func = data["func"]
        self.state = data["state"]


def launch_state() -> dict[str, Any]:
    import resource

    limits = {}
    for name in _LIMITS:
        if hasattr(resource, name):
            limits[name] = resource.getrlimit(getattr(resource, name))
    umask = os.umask(0)
    os.umask(umask)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "environ": process_environ(),
        "limits": limits,
        "umask": umask,
        "affinity": affinity,
        "resynced": list(_resynced),
        "changed_by": dict(_changed_by),
    }


def process_environ() -> dict[str, str]:
    """The environment a process started from here now gets (a spawned worker's, the fork server's):
    the C library's ``environ``. It also holds what native code set with ``setenv(3)``, which
    ``os.environ`` (read once, at interpreter start) never shows. ``os.environ`` where it cannot be read."""
    import ctypes

    try:
        entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError):
        return dict(os.environ)
    out: dict[str, str] = {}
    i = 0
    while entries[i] is not None:
        key, sep, value = entries[i].partition(b"=")
        if sep and key:
            out.setdefault(os.fsdecode(key), os.fsdecode(value))  # getenv(3) takes the first
        i += 1
    return out


def apply_launch_state(state: dict[str, Any]) -> None:
    """In a worker forked from the server: the launcher's state, as a spawned worker would have it."""
    from foundry_core import forkserver_preload

    if forkserver_preload.CUDA_INITIALISED:
        raise RuntimeError(
            "Foundry: the fork server initialised CUDA while importing "
            f"{', '.join(forkserver_preload.IMPORTED) or 'its modules'}; a worker forked from it "
            "cannot use CUDA (set FOUNDRY_WORKER_START=spawn)"
        )
    why = _kept_settings(
        forkserver_preload.ENV_READ,
        forkserver_preload.ENV_PREFIXES,
        forkserver_preload.ENV_LISTED,
        state["environ"],
        state.get("resynced", ()),
        state.get("changed_by"),
        forkserver_preload.ENV_READERS,
        forkserver_preload.LOADER_ENV,
        forkserver_preload.ENV_GROWN,
    )
    if why:
        raise RuntimeError(
            f"Foundry: a worker forked from the fork server: {why} (set FOUNDRY_WORKER_START=spawn)"
        )
    # The server forwards SIGQUIT to the launcher; a worker keeps the default, as a spawned one.
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    environ = state["environ"]
    current = process_environ()  # the server's native code may have set some that os.environ lacks
    for key in [k for k in {**current, **os.environ} if k not in environ]:
        os.environ.pop(key, None)
        os.unsetenv(key)
    for key, value in environ.items():
        if os.environ.get(key) != value or current.get(key) != value:
            os.environ[key] = value
    import resource

    for name, (soft, hard) in state["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):  # a hard limit above the server's needs privileges: keep it
            pass
    os.umask(state["umask"])
    if state["affinity"] is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, state["affinity"])
        except OSError:
            pass
