"""A LOAD's read-ahead in a helper process of its own (:func:`start`).

Planning a read-ahead is pure Python: each recorded path's real path, its trust check and a stat,
thousands of them. In the launcher it ran on a thread, which the engine's imports, holding the GIL,
let run only now and then: on one H100 (SGLang 0.5.23, 53f6b5a) its "reading ahead" line came about
10 s after the plugin registered, with the page cache dropped or not, by when the launcher's imports
it was there to speed up were mostly done. A helper process has a GIL of its own and another core.
It runs :func:`foundry_core.engine.readahead.child_main`, loaded from its file alone (``python -I
-S``: no site, no package ``__init__``, nothing but the standard library), and reports its plan and
its result as JSON lines; the page cache it fills is the whole machine's. It is given the
launcher's trusted roots rather than working them out (its own ``sys.path`` is not the engine's),
and it stops when the launcher is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

_CHILD = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('foundry_readahead_helper', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.child_main(json.loads(sys.argv[2]))\n"
)


class HelperReplay:
    """The helper's read-ahead as the launcher sees it: its plan and result once it reports them."""

    def __init__(
        self,
        proc: subprocess.Popen,
        on_plan: Callable[[dict[str, Any]], None],
        on_done: Callable[[dict[str, Any]], None],
        on_error: Callable[[str], None],
    ) -> None:
        self.proc = proc
        self.plan: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self._reader = threading.Thread(
            target=self._read, args=(on_plan, on_done, on_error), name="foundry-readahead-helper", daemon=True
        )
        self._reader.start()

    def _read(self, on_plan: Callable, on_done: Callable, on_error: Callable) -> None:
        try:
            for line in self.proc.stdout:  # blocked in read(2): the GIL is free meanwhile
                message = json.loads(line)
                if "plan" in message:
                    self.plan = message["plan"]
                    on_plan(self.plan)
                elif "replay" in message:
                    self.result = message["replay"]
                    on_done(self.result)
                elif "error" in message:
                    on_error(message["error"])
        except (OSError, ValueError, TypeError):  # a helper that died mid-line: nothing more to say
            pass
        finally:
            self.proc.wait()

    def join(self, timeout: float | None = None) -> bool:
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": (self.plan or {}).get("files"), "done_s": None}
        out.update(self.result or {})
        out["helper_pid"] = self.proc.pid
        return out


def start(
    module_file: str,
    args: dict[str, Any],
    on_plan: Callable[[dict[str, Any]], None],
    on_done: Callable[[dict[str, Any]], None],
    on_error: Callable[[str], None],
) -> HelperReplay | None:
    """Start the helper on ``args`` (see ``child_main``); None where no interpreter can be started
    (the caller then reads ahead on its own threads)."""
    if not sys.executable:
        return None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, module_file, json.dumps(args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            close_fds=True,
        )
    except (OSError, ValueError):
        return None
    return HelperReplay(proc, on_plan, on_done, on_error)
