"""Imported by the fork server of :mod:`foundry_core.forkserver` (only there): its preloading.

``multiprocessing``'s server imports this one module; it imports the modules the launcher named in
``FOUNDRY_FORKSERVER_PRELOAD``, each on its own, so that one that fails (missing, or raising at
import) costs only itself, never the server. It records whether an import initialised CUDA, in
torch or in the driver itself, and writes both to the report the launcher reads before it forks a
worker from here (:func:`foundry_core.forkserver.unusable`; a worker forked anyway refuses to run,
:func:`foundry_core.forkserver.apply_launch_state`). It passes the
``SIGQUIT`` a worker sends its parent on a failure to the launcher, the server's parent.
"""

from __future__ import annotations

import json
import os
import signal
import sys

IMPORTED: list[str] = []
FAILED: list[str] = []
CUDA_INITIALISED = False


def _preload() -> None:
    global CUDA_INITIALISED
    for name in filter(None, os.environ.get("FOUNDRY_FORKSERVER_PRELOAD", "").split(",")):
        try:
            __import__(name)
            IMPORTED.append(name)
        except Exception:  # noqa: BLE001 - the worker imports it itself, as a spawned one would
            FAILED.append(name)
    torch = sys.modules.get("torch")
    try:
        CUDA_INITIALISED = bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA has no context to inherit
        CUDA_INITIALISED = False
    CUDA_INITIALISED = CUDA_INITIALISED or driver_initialised()
    _write_report(os.environ.get("FOUNDRY_FORKSERVER_REPORT"))


def _write_report(path: str | None) -> None:
    if not path:
        return
    data = {"imported": IMPORTED, "failed": FAILED, "cuda_initialised": CUDA_INITIALISED}
    try:  # whole or absent: the launcher reads it while this is written
        with open(f"{path}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.tmp", path)
    except OSError:  # the launcher waits, then starts its workers without this server
        pass


def driver_initialised() -> bool:
    """Whether something in this process initialised the CUDA driver (``cuInit``; e.g. a module
    that asked ``torch.cuda.is_available()`` at import, which leaves torch's own flag unset): a
    process forked after that cannot use CUDA either."""
    import ctypes

    try:  # only where the driver library is loaded already: loading it initialises nothing
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int()
    # CUDA_ERROR_NOT_INITIALIZED (3) before cuInit; CUDA_SUCCESS (0) after it.
    return lib.cuDeviceGetCount(ctypes.byref(count)) == 0


def _forward_to_launcher(launcher: int) -> None:
    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(launcher, signum)
        except OSError:
            pass

    signal.signal(signal.SIGQUIT, forward)


if os.environ.get("FOUNDRY_FORKSERVER_PRELOAD") is not None:  # in the server, not in a test's import
    _forward_to_launcher(os.getppid())
    _preload()
