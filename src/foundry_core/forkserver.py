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
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

#: The modules the server imports, for :mod:`foundry_core.forkserver_preload` (set while it starts).
PRELOAD_ENV = "FOUNDRY_FORKSERVER_PRELOAD"
_PRELOAD_MODULE = "foundry_core.forkserver_preload"
# Resource limits a launcher may change after the server started (SGLang raises the open-file and
# stack limits in _set_envs_and_config): the worker takes the launcher's values at start.
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_NPROC")
_started: tuple[str, ...] | None = None


def start(preload: Sequence[str], log: logging.Logger | None = None) -> bool:
    """Start the fork server, which imports ``preload`` (best effort, in its own process). Never raises."""
    global _started
    if _started is not None:
        return True
    try:
        import multiprocessing
        from multiprocessing import forkserver

        if "forkserver" not in multiprocessing.get_all_start_methods():
            return False
        multiprocessing.get_context("forkserver").set_forkserver_preload([_PRELOAD_MODULE])
        os.environ[PRELOAD_ENV] = ",".join(preload)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(PRELOAD_ENV, None)  # the launcher's own environment, as the user gave it
    except Exception as e:  # noqa: BLE001 - an optimisation: the workers are spawned instead
        if log is not None:
            log.debug("Foundry: fork server not started (%s)", e)
        return False
    _started = tuple(preload)
    return True


def running() -> tuple[str, ...] | None:
    """The modules the server this process started imports, or None where it started none."""
    if _started is None:
        return None
    from multiprocessing import forkserver

    return _started if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None else None


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
    return {"environ": dict(os.environ), "limits": limits, "umask": umask, "affinity": affinity}


def apply_launch_state(state: dict[str, Any]) -> None:
    """In a worker forked from the server: the launcher's state, as a spawned worker would have it."""
    from foundry_core import forkserver_preload

    if forkserver_preload.CUDA_INITIALISED:
        raise RuntimeError(
            "Foundry: the fork server initialised CUDA while importing "
            f"{', '.join(forkserver_preload.IMPORTED) or 'its modules'}; a worker forked from it "
            "cannot use CUDA (set FOUNDRY_WORKER_START=spawn)"
        )
    # The server forwards SIGQUIT to the launcher; a worker keeps the default, as a spawned one.
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    environ = state["environ"]
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
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
