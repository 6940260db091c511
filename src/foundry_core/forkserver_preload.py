"""Imported by the fork server of :mod:`foundry_core.forkserver` (only there): its preloading.

``multiprocessing``'s server imports this one module; it imports the modules the launcher named in
``FOUNDRY_FORKSERVER_PRELOAD``, each on its own, so that one that fails (missing, or raising at
import) costs only itself, never the server. It records whether an import initialised CUDA (in torch
or in the driver itself) and which environment variables the imports read, with the values they
saw: a module that keeps a setting from its import keeps the server's value in every worker forked
from here, so a worker is only right where the launcher's environment still has those values. Both
go into the report the launcher reads before it forks a worker from here
(:func:`foundry_core.forkserver.unusable`; a worker forked anyway refuses to run,
:func:`foundry_core.forkserver.apply_launch_state`). It passes the ``SIGQUIT`` a worker sends its
parent on a failure to the launcher, the server's parent.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

IMPORTED: list[str] = []
FAILED: list[str] = []
CUDA_INITIALISED = False
#: Each environment variable the preload read -> the value it saw (None: unset).
ENV_READ: dict[str, str | None] = {}
#: Each variable the preload read -> where it was read ("file:line" of the first frame outside the
#: standard library, the file below its import root), a few at most: whether a worker may keep what
#: was read depends on who read it (:data:`foundry_core.forkserver.READER_VIEWS`).
ENV_READERS: dict[str, list[str]] = {}
_MAX_READERS = 4
#: Each variable -> the places (named as in :data:`ENV_READERS`) each of whose reads of it was
#: followed by a write of it from the very same call, holding what was read at its front or end: a
#: read only to grow it (OpenCV 5's loader puts its own folder in front of ``LD_LIBRARY_PATH`` in a
#: helper function). What such a reader made is the environment's value, which a worker is handed
#: from the launcher; it keeps nothing of its own. Set when the recording ends.
ENV_GROWN: dict[str, list[str]] = {}
# Variable -> (the frame that last read it, where, the value it got): a write from that same frame
# grows it. The frame is held, not its id, so that no later call can come to the same address.
_last_read: dict[str, tuple[Any, str, str | None]] = {}
# (variable, place) -> how often it was read there, and how often such a read was grown.
_reads: dict[tuple[str, str], int] = {}
_grown: dict[tuple[str, str], int] = {}
#: Prefixes of the variables a known module read by going through the whole environment.
ENV_PREFIXES: list[str] = []
#: Where a module not in :data:`PREFIX_LISTERS` went through the whole environment: no list of
#: names tells what it kept, so no worker can fork from here.
ENV_LISTED: list[str] = []
#: Modules (by file, below site-packages) that go through the whole environment at import for the
#: variables of one prefix: tqdm's ``envwrap("TQDM_")`` (imported with torch) and networkx's
#: backend priorities (imported with torch's compile stack).
PREFIX_LISTERS = {"tqdm/utils.py": "TQDM_", "networkx/utils/backends.py": "NETWORKX_BACKEND_PRIORITY"}
# The server's own variables, set by the launcher only while it starts the server.
_OWN = ("FOUNDRY_FORKSERVER_PRELOAD", "FOUNDRY_FORKSERVER_REPORT")
#: Variables the dynamic loader reads once, when a process starts: the server keeps the values it
#: was started with (:data:`LOADER_ENV`) for every worker forked from it, whatever the worker's
#: ``os.environ`` says (:func:`foundry_core.forkserver.loader_view`).
LOADER_VARS = ("LD_LIBRARY_PATH", "LD_PRELOAD")
LOADER_ENV: dict[str, str | None] = {v: os.environ.get(v) for v in LOADER_VARS}
_STDLIB_FRAMES = ("<frozen ", os.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def _preload() -> None:
    global CUDA_INITIALISED
    names = list(filter(None, os.environ.get("FOUNDRY_FORKSERVER_PRELOAD", "").split(",")))
    with recording_environment_reads():
        for name in names:
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


class recording_environment_reads:
    """Within it, :data:`ENV_READ` grows with each read of ``os.environ`` (``os.getenv``, ``.get``,
    ``in`` and indexing all come through ``__getitem__``) and each pass through it
    (``.items()``, ``.copy()``) goes to :data:`ENV_PREFIXES` or :data:`ENV_LISTED`. Variables read
    by C code through ``getenv(3)`` are not seen: the preloaded modules are chosen with that in mind
    (:data:`foundry_sglang_plugin.SCHEDULER_PRELOAD`)."""

    def __enter__(self) -> recording_environment_reads:
        environ_type = type(os.environ)
        self._saved = (environ_type.__getitem__, environ_type.__iter__, environ_type.__setitem__)
        getitem, listing, setitem = self._saved

        def read(environ: object, key: str) -> str:
            if environ is not os.environ:  # os.environb
                return getitem(environ, key)
            caller = sys._getframe(1).f_code
            if caller.co_name in ("__iter__", "copy") and caller.co_filename.startswith(_STDLIB_FRAMES):
                return getitem(environ, key)  # the values of a listing (.items(), .copy()), recorded as one
            if key in _OWN:
                return getitem(environ, key)
            frame = _note_reader(key)
            try:
                value = getitem(environ, key)
            except KeyError:
                value = None
                raise
            finally:
                ENV_READ.setdefault(key, value)
                if frame is not None:
                    _last_read[key] = (*frame, value)
            return value

        def listed(environ: object) -> Iterator[str]:
            if environ is not os.environ:
                return listing(environ)
            caller = sys._getframe(1)
            while caller.f_back is not None and caller.f_code.co_filename.startswith(_STDLIB_FRAMES):
                caller = caller.f_back  # past os and collections.abc to the module that asked
            where = caller.f_code.co_filename
            prefix = next((p for f, p in PREFIX_LISTERS.items() if where.endswith("/" + f)), None)
            if prefix is None:
                ENV_LISTED.append(f"{where}:{caller.f_lineno}")
            else:  # the variables of its prefix, as it sees them now
                if prefix not in ENV_PREFIXES:
                    ENV_PREFIXES.append(prefix)
                for name in list(listing(environ)):
                    if name.startswith(prefix) and name not in _OWN:
                        ENV_READ.setdefault(name, getitem(environ, name))
            return listing(environ)

        def written(environ: object, key: str, value: str) -> None:
            setitem(environ, key, value)
            if environ is os.environ and key in _last_read:
                _note_writer(key, value)

        environ_type.__getitem__ = read  # type: ignore[method-assign]
        environ_type.__iter__ = listed  # type: ignore[method-assign]
        environ_type.__setitem__ = written  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        environ_type = type(os.environ)
        environ_type.__getitem__, environ_type.__iter__, environ_type.__setitem__ = self._saved  # type: ignore[method-assign]
        _last_read.clear()
        for (key, place), n in _grown.items():
            if n == _reads.get((key, place)):  # every read there was grown
                ENV_GROWN.setdefault(key, []).append(place)


def in_stdlib(filename: str) -> bool:
    """Whether ``filename`` is the standard library's (frozen modules included; not the
    site-packages folder a Python install may keep inside it)."""
    if filename.startswith(_STDLIB_FRAMES):
        return True
    return filename.startswith(_STDLIB_DIR) and "-packages" not in filename[len(_STDLIB_DIR) :]


def code_site(filename: str, lineno: int) -> str:
    """``file:line`` with the file below the import root it came from (site-packages, a --target
    folder), so that the preload's readers and the launcher's writers are named alike. A package's
    own folder on ``sys.path`` is no root (OpenCV puts ``cv2/`` there): its modules keep their
    package's name. The file's name alone where no root holds it."""
    roots = [
        r
        for r in (p.rstrip(os.sep) + os.sep for p in sys.path if p)
        if filename.startswith(r) and not os.path.isfile(r + "__init__.py")
    ]
    short = filename[len(max(roots, key=len)) :] if roots else os.path.basename(filename)
    return f"{short}:{lineno}"


def _caller_outside_stdlib(depth: int) -> Any:
    """The first frame at or above ``depth`` (from the caller's caller) that is not the standard
    library's, or None."""
    frame = sys._getframe(depth + 1)
    while frame is not None and in_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _note_reader(key: str) -> tuple[Any, str] | None:
    """Add where ``key`` is being read (the caller of ``os.environ``'s lookup) to :data:`ENV_READERS`;
    returns that frame and place, or None where it is not known. Never raises into the import that
    reads: a reader not noted excuses nothing (fails closed)."""
    readers = ENV_READERS.setdefault(key, [])
    found = None
    try:
        frame = _caller_outside_stdlib(2)
        if frame is None:
            return None
        reader = code_site(frame.f_code.co_filename, frame.f_lineno)
        found = (frame, reader)
        _reads[key, reader] = _reads.get((key, reader), 0) + 1
    except Exception:  # noqa: BLE001 - see above
        reader = "..."
    if reader not in readers and len(readers) < _MAX_READERS:
        readers.append(reader)
    elif reader not in readers:
        readers[-1] = "..."  # more than can be listed: no reader list can excuse it
    return found


def _note_writer(key: str, value: str) -> None:
    """``key`` is being set to ``value``: where the same call read it last and the new value holds
    what it read at its front or end (or nothing was there), that read grew it (:data:`ENV_GROWN`).
    Never raises into the import that writes."""
    try:
        frame = _caller_outside_stdlib(2)
        last, reader, seen = _last_read.pop(key)
        if frame is last and (not seen or value.startswith(seen) or value.endswith(seen)):
            _grown[key, reader] = _grown.get((key, reader), 0) + 1
    except Exception:  # noqa: BLE001 - the reader stays unexcused
        pass


def _write_report(path: str | None) -> None:
    if not path:
        return
    data = {
        "imported": IMPORTED,
        "failed": FAILED,
        "cuda_initialised": CUDA_INITIALISED,
        "env_read": ENV_READ,
        "env_readers": ENV_READERS,
        "env_grown": ENV_GROWN,
        "env_prefixes": ENV_PREFIXES,
        "env_listed": ENV_LISTED,
        "loader_env": LOADER_ENV,
    }
    try:  # whole or absent: the launcher reads it while this is written
        with open(f"{path}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.tmp", path)
    except OSError:  # the launcher waits, then starts its workers without this server
        pass


def environment_changes(
    read: Mapping[str, str | None],
    prefixes: Iterable[str],
    environ: Mapping[str, str],
    resynced: Iterable[str] = (),
) -> list[str]:
    """The variables a preloaded module may have kept that ``environ`` (a worker's environment)
    has otherwise: those in ``read`` (name -> the value it saw; None: unset), and the variables of
    a listed prefix that ``read`` does not hold. ``resynced``: variables the worker applies again
    to the modules that kept them, so a change to them is harmless."""
    prefixes = tuple(prefixes)
    names = set(read)
    if prefixes:
        names.update(n for n in environ if n.startswith(prefixes))
    skip = set(resynced)
    return sorted(n for n in names if n not in skip and environ.get(n) != read.get(n))


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
