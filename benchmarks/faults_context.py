"""The benchmark's state shared by every case: options, paths, the base's reference, the budget, the
servers still running and the mounts to undo."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import engine_run as cs
from faults_filesystem import run_command

#: Seconds one server start takes when nothing was measured yet (H200, 2026-12-01 cold_start runs):
#: a SAVE is always cold, a LOAD from the base archive is warm, a refusal ends after the imports.
DEFAULT_TIMES = {"save": 170.0, "load": 65.0, "refuse": 45.0}
MARGIN_S = 25.0  # kept back from the budget for stopping servers and writing the result


@dataclasses.dataclass
class Ctx:
    opts: argparse.Namespace
    bench: Any  # engine_run.Bench
    engine: str
    logs: Path
    workdir: Path
    home: Path
    tmp: Path
    started: float
    base_toml: Path
    kv_tokens: int | None = None
    kv_bytes: int | None = None
    times: dict[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_TIMES))
    reference: dict[str, Any] | None = None
    sustained_reference: list[list[dict[str, Any]]] | None = None
    #: --resume: the earlier call's records of the cases this call runs again (kill points merge)
    earlier_cases: dict[str, Any] = dataclasses.field(default_factory=dict)
    sizes: dict[str, Any] = dataclasses.field(default_factory=dict)
    base_state: dict[str, Any] | None = None
    live: set = dataclasses.field(default_factory=set)
    mounts: list = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    staged_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stopping: bool = False

    @property
    def base_dir(self) -> Path:
        """The base SAVE's archive directory; every staged case's copy is put back at this path."""
        return self.workdir / "base" / "archive"

    @property
    def pristine(self) -> Path:
        """The base archive as its SAVE left it, copied from for each staged case."""
        return self.workdir / "base" / "pristine"

    @property
    def base_cache_root(self) -> Path:
        """FOUNDRY_CACHE_ROOT of the base and of every staged start: with the same archive path this
        gives the same private cache folder, so carried caches whose files name their folder
        (FlashInfer's and tvm-ffi's build files) hit, and staged LOADs are warm."""
        return self.workdir / "base-caches"

    def left(self) -> float:
        return self.opts.budget - (time.monotonic() - self.started)

    def deadline(self) -> float:
        """When a server must be ready: its timeout, or what the budget leaves."""
        return time.monotonic() + max(20.0, min(self.opts.timeout, self.left() - MARGIN_S))

    # A server is a faults_server.Server (typed Any here: that module imports this one).
    def register(self, server: Any) -> None:
        with self.lock:
            if self.stopping:
                raise SystemExit("benchmark is stopping")
            self.live.add(server)

    def unregister(self, server: Any) -> None:
        with self.lock:
            self.live.discard(server)

    def mount(self, argv: list[str], target: Path) -> tuple[bool, str]:
        if self.opts.no_mount or os.geteuid() != 0:
            return False, "not mounting (--no-mount or not root)"
        ok, detail = run_command(argv)
        if ok:
            with self.lock:
                self.mounts.append(target)
        return ok, detail

    def umount(self, target: Path) -> None:
        ok, _ = run_command(["umount", str(target)])
        if not ok:
            run_command(["umount", "-l", str(target)])
        with self.lock:
            with contextlib.suppress(ValueError):
                self.mounts.remove(target)

    def shutdown(self) -> None:
        """End every server still running and undo every mount (on any exit)."""
        with self.lock:
            self.stopping = True
            servers = list(self.live)
        for s in servers:  # all at once first: stopping them one by one may take 20 s each
            with contextlib.suppress(ProcessLookupError, PermissionError, AttributeError):
                os.killpg(s.proc.pid, signal.SIGTERM)
        t_end = time.monotonic() + 5.0
        while time.monotonic() < t_end and any(s.alive() for s in servers):
            time.sleep(0.1)
        for s in servers:
            with contextlib.suppress(Exception):
                s.stop()
        for m in list(reversed(self.mounts)):
            self.umount(m)

    def gpu_settle(self) -> float | None:
        """Between cases run one at a time: wait for the GPU memory of ended servers to come back."""
        if self.opts.parallel > 1:
            return None
        return cs.wait_gpu_free(self.bench.gpu_baseline_mib)
