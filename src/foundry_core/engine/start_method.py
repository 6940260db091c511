"""How an engine's launcher should start its GPU worker processes: ``fork`` where that is safe.

An engine that starts its workers with ``spawn`` (SGLang's schedulers) pays its imports twice: the
launcher imported torch and the engine, and every spawned worker imports them again in a fresh
interpreter (24.5 s of a 64 s SGLang LOAD on an H200, docs/cold-start.md). A forked worker starts
with the launcher's modules in place. Forking is safe only where the launcher holds nothing a child
cannot inherit:

* CUDA not initialised in the launcher: a forked child cannot use the parent's CUDA context, and
  torch refuses CUDA in a child forked after it (``Cannot re-initialize CUDA in forked subprocess``);
* no other Python threads running (a lock one of them held at the fork stays locked in the child);
  Foundry's read-ahead readers are the exception: they only make system calls and hold no lock
  the child takes;
* nothing the engine does per worker that needs a fresh ``exec`` (the plugin names those:
  ``blockers``, e.g. a library ``LD_PRELOAD``-ed into each worker, a ``numactl`` prefix).

Where CUDA is initialised in the launcher, or another thread runs there, a worker can still start
from the imported third-party modules: forked from the fork server the plugin started at its
registration (:mod:`foundry_core.forkserver`, a clean interpreter that never touches CUDA), where
one runs. The engine's own reasons to ``exec`` each worker (``blockers``) rule that out too.

:func:`decide` applies these rules; the user's ``FOUNDRY_WORKER_START`` (``auto``, ``fork``,
``forkserver``, ``spawn``) can ask for spawn always, or for fork or the fork server, which the
safety rules still override. The choice and its reason travel to the workers in
:data:`CHOSEN_ENV` for their start reports.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

ENV = "FOUNDRY_WORKER_START"
CHOSEN_ENV = "FOUNDRY_WORKER_START_CHOSEN"
#: Threads that may run at a fork: the read-ahead's readers, which make system calls only (no
#: import, no lock a child could need). Its planning and recording threads import and log: while
#: one of them runs, workers are spawned.
FORK_SAFE_THREADS = ("foundry-readahead-reader-",)


@dataclass(frozen=True)
class Choice:
    method: str  # "fork", "forkserver" or "spawn"
    reason: str


def requested(environ: Mapping[str, str] | None = None) -> str:
    value = (os.environ if environ is None else environ).get(ENV, "auto").strip().lower()
    return value if value in ("auto", "fork", "forkserver", "spawn") else "auto"


def cuda_initialized() -> bool:
    """Whether this process has a CUDA context through torch (torch not imported: no)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support has no context to inherit
        return False


def foreign_threads(threads: Iterable[threading.Thread] | None = None) -> list[str]:
    """Names of the live Python threads other than the calling one and Foundry's readers."""
    me = threading.current_thread()
    out = []
    for t in threading.enumerate() if threads is None else threads:
        if t is me or not t.is_alive() or t.name.startswith(FORK_SAFE_THREADS):
            continue
        out.append(t.name)
    return sorted(out)


def decide(
    *,
    blockers: Iterable[str] = (),
    cuda: bool | None = None,
    threads: Iterable[str] | None = None,
    forkserver: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Choice:
    """Fork, fork server or spawn, with the reason. ``cuda`` and ``threads`` default to this
    process's state; ``forkserver`` names the modules a running fork server imported (None: none runs)."""
    wanted = requested(environ)
    if wanted == "spawn":
        return Choice("spawn", f"{ENV}=spawn")
    if not hasattr(os, "fork") or "fork" not in _methods():
        return Choice("spawn", "this platform cannot fork")
    reasons = list(blockers)
    if reasons:
        return Choice("spawn", "; ".join(reasons))
    unsafe = []
    if cuda if cuda is not None else cuda_initialized():
        unsafe.append("CUDA is initialised in the launching process (a forked worker could not use it)")
    others = foreign_threads() if threads is None else sorted(threads)
    if others:
        unsafe.append(f"other threads run in the launching process ({', '.join(others[:5])})")
    if forkserver is not None and (unsafe or wanted == "forkserver"):
        return Choice(
            "forkserver",
            "; ".join(unsafe or [f"{ENV}=forkserver"])
            + f": workers fork from Foundry's fork server, which imported {', '.join(forkserver)}",
        )
    if unsafe:
        return Choice("spawn", "; ".join(unsafe))
    return Choice(
        "fork",
        "CUDA not initialised and no other threads in the launching process: workers start from its "
        "imported modules" + (f" ({ENV}=fork)" if wanted == "fork" else ""),
    )


def _methods() -> list[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()


def export(choice: Choice, environ: dict[str, str] | None = None) -> None:
    value = json.dumps(asdict(choice))
    if environ is not None:
        environ[CHOSEN_ENV] = value
        return
    from .launch_env import set_for_launch

    set_for_launch(CHOSEN_ENV, value)  # gone again at the next launch in this process


def chosen(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """In a worker: how its launcher started it and why (None where no choice was exported)."""
    raw = (os.environ if environ is None else environ).get(CHOSEN_ENV)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return {"method": str(data["method"]), "reason": str(data["reason"])}
    except (ValueError, KeyError, TypeError):
        return None
