"""What an engine plugin's ``register()`` may call at once: nothing heavy is imported here.

:func:`start_readahead` looks at the command line and the environment only; when they name a
Foundry configuration, one daemon thread imports the engine layer and starts the archive's
read-ahead (:mod:`foundry_core.engine.readahead`), so that ``register()`` itself pays a thread
start and the engine's imports run on while the files they need are read. Never raises.

:func:`from_interpreter_start` starts it sooner: the one line of ``foundry_graphs_early.pth``,
which the core's wheel installs into site-packages, calls it while Python starts, before the
engine's first import, and only when the command line names ``--foundry-config`` (any other
interpreter of that environment runs one ``any()`` over its arguments). vLLM loads its plugins only
once its API server has imported (15-22 s into a cold start on one H100), too late to read those
imports' files ahead; SGLang's comes midway through its launcher's.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .process import process_age
from .switches import config_path, switched_on

_started = False
#: Seconds from this process's start to each named point of Foundry's (:func:`mark`): where a
#: worker's start went before and after Foundry's own steps, in its start report.
MARKS: dict[str, float] = {}
_marks_pid = os.getpid()  # a forked child starts its own marks: its age counts from its own start


def mark(name: str) -> None:
    """Note the process's age now under ``name`` (the first time in this process). Never raises."""
    global _marks_pid
    if _marks_pid != os.getpid():
        MARKS.clear()
        _marks_pid = os.getpid()
    if name not in MARKS:
        age = process_age()
        if age is not None:
            MARKS[name] = age


class _Handoff(logging.Handler):
    """The read-ahead's log lines from :func:`from_interpreter_start`, before any engine has set up
    its logging: kept until the engine's plugin names its logger (:func:`start_readahead`), then
    passed to it, and each later line straight away."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.pending: list[logging.LogRecord] = []
        self.target: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:  # handle() holds self.lock
        if self.target is None:
            self.pending.append(record)
        else:
            self.target.handle(record)

    def hand_to(self, logger: logging.Logger) -> None:
        with self.lock:
            self.target, pending, self.pending = logger, self.pending, []
        for record in pending:
            logger.handle(record)


_handoff: _Handoff | None = None


def from_interpreter_start() -> None:
    """The read-ahead from the start of the interpreter (``foundry_graphs_early.pth``), its lines
    held for the engine's logger. Never raises."""
    global _handoff
    try:
        log = logging.getLogger("foundry.readahead")
        if _handoff is None:
            _handoff = _Handoff()
            log.addHandler(_handoff)
            log.propagate = False  # no engine has configured logging yet: nothing to print to
            log.setLevel(logging.INFO)
        start_readahead(log)
    except Exception:  # noqa: BLE001 - runs inside site.py: the interpreter starts on regardless
        return


def start_readahead(log: str | logging.Logger = "foundry") -> threading.Thread | None:
    """The read-ahead of this launch's archive on a daemon thread (None where it reads nothing, or
    started already). ``log``: the engine's logger (or its name); where the read-ahead began at
    interpreter start, the lines it logged so far go to it now. Never raises."""
    global _started
    if _started:
        if _handoff is not None and isinstance(log, str):
            _handoff.hand_to(logging.getLogger(log))
        return None
    if not switched_on("FOUNDRY_READAHEAD"):
        return None
    if os.environ.get("FOUNDRY_READAHEAD_STARTED"):  # the process that started this one reads ahead
        return None
    if config_path(sys.argv) is None:
        return None
    _started = True
    argv = list(sys.argv)
    logger = log if isinstance(log, logging.Logger) else logging.getLogger(log)

    def run() -> None:
        try:
            from foundry_core.engine import readahead

            readahead.run_for_launch(argv, log=logger)
        except Exception as e:  # noqa: BLE001 - read-ahead is an optimisation; the start goes on
            logger.debug("Foundry: read-ahead not started (%s)", e)

    try:
        thread = threading.Thread(target=run, name="foundry-readahead-config", daemon=True)
        thread.start()
    except Exception:  # noqa: BLE001 - register() never raises into the engine's plugin loader
        return None
    return thread
