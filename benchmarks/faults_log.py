"""A server's output as engine_faults reads it: the log lines Foundry and the engines write, the
thread that copies the output into its log and watches for lines, and what a finished log says."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

# --- log patterns --------------------------------------------------------------------------------

#: Per engine: the Foundry mode line, the capture's first line, "ready", and a published SAVE.
ENGINE_PATTERNS: dict[str, dict[str, str]] = {
    "sglang": {
        "mode": r"Foundry (SAVE|LOAD): rank \d+, archive",
        "capture_begin": r"Capturing batches|Capture (?:target )?decode .{0,20}?graph begin",
        "ready": r"The server is fired up and ready to roll|Application startup complete",
        "published": r"Foundry SAVE: (\d+) decode graphs persisted",
    },
    "vllm": {
        "mode": r"Foundry rank \d+: (SAVE|LOAD) \(",
        "capture_begin": r"Capturing CUDA graphs",
        "ready": r"Application startup complete",
        # The graph archive written (its publication is the manifest's); "saved" before 4db6fd5's successor.
        "published": r"Foundry rank \d+: (?:saved|wrote) (\d+) decode graphs to",
    },
}
#: Lines both plugins write (foundry_core.engine.decide / handover, the plugins' launch checks).
LOG_PATTERNS: dict[str, str] = {
    "stock_fallback": r"auto mode serves without Foundry this time",
    "not_writable": r"archive_dir \S+ is not writable",
    "save_failed": r"Foundry rank \d+: SAVE failed \((.*)\); serving with the graphs just captured",
    "save_refused": r"mode = save cannot go on",
    "archive_refused": r"Foundry rank \d+: archive \S+ refused \((.*)\)",
    "caches_refused_auto": r"carried caches \S+ refused \((.*)\); the engine compiles as usual",
    "caches_refused_load": r"carried caches \S+ refused \((.*)\); mode=load cannot go on",
    "caches_saved": r"Foundry rank \d+: compile caches saved to",
    "caches_not_saved": r"compile caches not saved",
    "caches_handed": r"carried cache files handed to the engine",
    "random_cache_folder": r"Foundry caches: \S+ not usable .*using a random folder",
    "rebuilt_despite_caches": r"the engine built \d+ cache files although the carried caches",
    "lock_held": r"another SAVE \(.*\) holds",
    "no_space": r"No space left on device|File too large|\[Errno 28\]|\[Errno 27\]|ENOSPC|EFBIG",
    "read_only_fs": r"Read-only file system|\[Errno 30\]|Permission denied|\[Errno 13\]",
    "traceback": r"Traceback \(most recent call last\)",
    "error_line": r"^error: |\bError: |Exception: ",
}
ENGINE_PID = re.compile(r"\(EngineCore(?:_DP\d+)? pid=(\d+)\)")
_FACT_RES = {k: re.compile(v) for k, v in LOG_PATTERNS.items()}
EXCERPT_RE = re.compile(r"Foundry|" + "|".join(f"(?:{LOG_PATTERNS[k]})" for k in ("no_space", "traceback")))


@dataclasses.dataclass
class Watch:
    pattern: re.Pattern
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    t: float | None = None
    line: str | None = None

    def is_set(self) -> bool:
        return self.event.is_set()


class Pump(threading.Thread):
    """Copies a server's output into its log, one line per ``\\n`` *or* ``\\r`` (a progress bar's
    updates are separate lines, seen as they come, not when the bar ends), each stamped with the
    seconds since spawn; :meth:`watch` is set by the first matching line."""

    _SPLIT = re.compile(rb"[\r\n]")

    def __init__(self, stream: Any, path: Path, t0: float):
        super().__init__(daemon=True)
        self.stream, self.path, self.t0 = stream, path, t0
        self.lines: list[tuple[float, str]] = []
        self._watches: list[Watch] = []
        self._lock = threading.Lock()

    def watch(self, pattern: str) -> Watch:
        w = Watch(re.compile(pattern))
        with self._lock:
            for t, line in self.lines:
                if w.pattern.search(line):
                    w.t, w.line = t, line[-500:]
                    w.event.set()
                    break
            else:
                self._watches.append(w)
        return w

    def _emit(self, f: Any, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip()
        if not line.strip():
            return
        t = time.monotonic() - self.t0
        with self._lock:
            self.lines.append((t, line))
            for w in [w for w in self._watches if w.pattern.search(line)]:
                w.t, w.line = t, line[-500:]
                w.event.set()
                self._watches.remove(w)
        f.write(f"[{t:9.3f}] {line}\n")
        f.flush()

    def run(self) -> None:
        fd = self.stream.fileno()
        buf = b""
        with open(self.path, "w", encoding="utf-8") as f:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                parts = self._SPLIT.split(buf + chunk)
                buf = parts.pop()
                for part in parts:
                    self._emit(f, part)
            if buf:
                self._emit(f, buf)

    def snapshot(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.lines)


def log_facts(lines: list[tuple[float, str]], engine: str) -> dict[str, Any]:
    """What a server's log says: Foundry's mode (save / load / stock: auto that served without
    Foundry), each known line's first occurrence (time, text, the reason it gives) and count, and the
    engine-core pids (vLLM)."""
    mode_re = re.compile(ENGINE_PATTERNS[engine]["mode"])
    published_re = re.compile(ENGINE_PATTERNS[engine]["published"])
    facts: dict[str, Any] = {"mode": None, "lines": {}, "counts": {}, "engine_pids": []}
    for t, line in lines:
        m = mode_re.search(line)
        if m and facts["mode"] is None:
            facts["mode"] = m.group(1).lower()
            facts["mode_line"] = {"t_s": round(t, 3), "line": line.strip()[-400:]}
        for key, rx in [*_FACT_RES.items(), ("published", published_re)]:
            m = rx.search(line)
            if not m:
                continue
            facts["counts"][key] = facts["counts"].get(key, 0) + 1
            if key not in facts["lines"]:
                hit = {"t_s": round(t, 3), "line": line.strip()[-600:]}
                if m.groups():
                    hit["reason"] = m.group(1)[-400:]
                facts["lines"][key] = hit
        for pid in ENGINE_PID.findall(line):
            if int(pid) not in facts["engine_pids"]:
                facts["engine_pids"].append(int(pid))
    if facts["mode"] is None and "stock_fallback" in facts["lines"]:
        facts["mode"] = "stock"
    return facts


def excerpt(lines: list[tuple[float, str]], limit: int = 60) -> list[str]:
    """Foundry's lines and error lines, stamped, each cut to 500 characters."""
    picked = [f"[{t:8.2f}] {line.strip()[-500:]}" for t, line in lines if EXCERPT_RE.search(line)]
    return picked[:limit] if len(picked) <= limit else [*picked[: limit // 2], "...", *picked[-limit // 2 :]]
