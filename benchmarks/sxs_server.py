"""One server start: spawn, log with a clock, wait for health, time the first streamed token, read
the phases of the start from the engine's log, take its greedy outputs, stop it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Four different prompts as token ids inside the small tokenizer's vocabulary.
PROMPTS = [[3 + (37 * i + 11 * j) % 4096 for j in range(6 + 5 * i)] for i in range(4)]
OUTPUT_TOKENS = 32
TOP_LOGPROBS = 5

#: Moments that split a start into phases, in the order they happen: the first line that matches;
#: of a tuple, the first line that matches its first pattern matching any line (a preference).
MARKS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "sglang": {
        "imports_done": r"server_args=",  # 0.5.23 logs a dict, earlier releases ServerArgs(...)
        # The scheduler's model runner begins (after its spawn and imports, and Foundry's steps).
        "worker_up": r"Init parallel begin",
        "weights_begin": r"Load weight begin",
        "weights_end": r"Load weight end",
        "ready_log": r"The server is fired up and ready to roll",
    },
    "vllm": {
        "imports_done": r"non-default args:",
        "worker_up": r"Initializing a V1 LLM engine",  # the engine core's first line, after its imports
        "weights_begin": r"Starting to load model|Loading model from scratch",  # the latter: 0.33.0
        # vLLM's own loading figure ends at "Model loading took"; "Loading weights took" (the files
        # read, 2.4 s earlier in 0.33.0) stands in where a release logs only that.
        "weights_end": (r"Model loading took", r"Loading weights took"),
        # the files read: what follows, to "Model loading took", is mostly full gc.collect() passes
        "weights_read": r"Loading weights took",
        "compile_end": r"torch\.compile (?:takes|took) [\d.]+ s in total",
        "ready_log": r"Application startup complete",
    },
}
#: A graph capture stage per engine: (the line that begins it, the line that ends it, whether the begin
#: line is written only when the stage ends). vLLM's is a progress bar whose line closes with the bar
#: (0.33.0: its memory profiling captures throwaway graphs in a first stage, then the real capture).
#: A LOAD runs SGLang's capture step too (installing the restored graphs): same lines.
CAPTURE: dict[str, tuple[str, str, bool]] = {
    "sglang": (
        r"Capture (?:\w+ )?decode .{0,20}?graph begin",
        r"Capture (?:\w+ )?decode .{0,20}?graph end",
        False,
    ),
    "vllm": (r"Capturing CUDA graphs", r"Graph capturing finished", True),
}
#: Phase -> (start mark, end mark); a phase with a missing mark is None. ``jit`` and ``graphs`` are
#: sums of spans instead (:func:`phases`).
PHASES = {
    "imports": ("spawn", "imports_done"),
    # Worker processes started (SGLang's schedulers, vLLM's engine core: a spawned one imports the
    # engine again) to their first line; then their set-up before the weights.
    "spawn": ("imports_done", "worker_up"),
    "setup": ("worker_up", "weights_begin"),
    "weights": ("weights_begin", "weights_end"),
    "compile": ("weights_end", "compile_end"),
    "warmups": ("graphs_end", "ready"),
}
#: FlashInfer building a kernel module at first use (no flashinfer-jit-cache installed); the build
#: logs nothing until it is done, so it lasts until the next line of the engine that is no build line.
_JIT = re.compile(r"Building JIT module")
_API_SERVER = re.compile(r"^\(APIServer pid=")  # vLLM's front process: it logs while the engine builds
_RESTORED = re.compile(r"Foundry rank 0: restored \d+ decode graphs in ([\d.]+) s")
_STAMP = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\] ?(.*)$")
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for 127.0.0.1


class ServerDied(RuntimeError):
    pass


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: servers started back to back bind
    theirs only seconds later, and the kernel may offer a just-probed port again in between."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def http_json(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _HTTP.open(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:2000]
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")[:2000]


class LogPump(threading.Thread):
    """Copies the server's stdout+stderr into its log, each line stamped with seconds since spawn."""

    def __init__(self, stream: Any, path: Path, t0: float):
        super().__init__(daemon=True)
        self.stream, self.path, self.t0 = stream, path, t0

    def run(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                f.write(f"[{time.monotonic() - self.t0:9.3f}] {line}\n")
                f.flush()


def read_log(path: Path) -> list[tuple[float, str]]:
    """The log's lines as the pump wrote them (a progress bar's carriage returns stay inside its line),
    each with its seconds since spawn."""
    out, t = [], 0.0
    # bytes decoded, not read_text: text mode would turn a bar's carriage returns into line breaks
    text = path.read_bytes().decode(errors="replace") if path.is_file() else ""
    for line in text.split("\n"):
        if not line:
            continue
        m = _STAMP.match(line)
        if m:
            t, line = float(m.group(1)), m.group(2)
        out.append((t, line))
    return out


def _first_marks(lines: list[tuple[float, str]], engine: str) -> dict[str, float]:
    marks: dict[str, float] = {"spawn": 0.0}
    for key, spec in MARKS[engine].items():
        for rx in map(re.compile, (spec,) if isinstance(spec, str) else spec):
            t = next((t for t, line in lines if rx.search(line)), None)
            if t is not None:
                marks[key] = round(t, 3)
                break
    return marks


Spans = list[tuple[float, float]]


def _spans(lines: list[tuple[float, str]], engine: str) -> tuple[Spans, Spans, Spans]:
    """(start, end) of each JIT build and each graph capture stage, and (time, seconds) of each
    restore line (vLLM's LOAD captures nothing and says how long its restore took).

    A capture stage whose begin line is written only when it ends (vLLM's bar) is counted from the
    engine's line before it: the stage began after that line, so this may count some unlogged moments
    before the capture too. Where that line ended a JIT build, the build is counted up to the bar's
    line and the stage from there: which of the two took the moments in between, no line says."""
    begin, end, begin_written_late = CAPTURE[engine]
    begin_rx, end_rx = re.compile(begin), re.compile(end)
    jits: Spans = []
    stages: Spans = []
    restores: Spans = []
    before = 0.0  # the engine's last logged moment before this line
    jit_from = stage_from = None
    for t, line in lines:
        if _API_SERVER.match(line):
            continue  # another process: says nothing of where the engine is
        if jit_from is not None and not _JIT.search(line):
            jits.append((jit_from, t))
            jit_from, before = None, t
        if _JIT.search(line):
            jit_from = t if jit_from is None else jit_from
        elif stage_from is None and begin_rx.search(line):
            stage_from = before if begin_written_late else t
        elif stage_from is not None and end_rx.search(line):
            stages.append((stage_from, t))
            stage_from = None
        elif m := _RESTORED.search(line):
            restores.append((t, float(m.group(1))))
        before = t
    if jit_from is not None:  # the start ended while building (a timeout): counted to its last line
        jits.append((jit_from, before))
    return jits, stages, restores


def _within(a: float, b: float, spans: Spans) -> float:
    """Seconds of ``spans`` that fall between ``a`` and ``b``."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def phases(lines: list[tuple[float, str]], engine: str, ready_s: float | None) -> dict[str, Any]:
    """Each phase's seconds (None where a mark is missing) and the marks. ``jit``: FlashInfer's kernel
    builds, taken out of whatever phase they fell in. ``graphs``: every capture stage summed (vLLM
    0.33.0 captures twice at SAVE: its memory profiling's throwaway graphs, then the graphs it keeps),
    plus a LOAD's restore seconds; what lies between two stages (vLLM: KV cache, kernel autotune) is
    in no phase. ``warmups``: from the end of the last stage to ready. ``after_weights_read`` (vLLM,
    inside ``weights``): from the files read to "Model loading took", where the loader and the memory
    profiler run their full ``gc.collect()`` passes: what Foundry's ``gc.freeze()`` shortens."""
    marks = _first_marks(lines, engine)
    jits, stages, restores = _spans(lines, engine)
    if stages:
        marks["graphs_begin"] = round(stages[0][0], 3)
    if stages or restores:
        marks["graphs_end"] = round(max([e for _, e in stages] + [t for t, _ in restores]), 3)
    if ready_s is not None:
        marks["ready"] = ready_s

    def between(a: str, b: str) -> float | None:
        if a not in marks or b not in marks:
            return None
        return round(marks[b] - marks[a] - _within(marks[a], marks[b], jits), 3)

    out: dict[str, Any] = {name: between(a, b) for name, (a, b) in PHASES.items() if name != "warmups"}
    out["jit"] = round(sum(e - s for s, e in jits), 3) if jits else None
    graphs = sum(e - s - _within(s, e, jits) for s, e in stages) + sum(took for _, took in restores)
    out["graphs"] = round(graphs, 3) if stages or restores else None
    out["warmups"] = between(*PHASES["warmups"])
    if "weights_read" in marks:
        out["after_weights_read"] = between("weights_read", "weights_end")
    out["marks"] = marks
    return out


_REPORT = re.compile(r"Foundry (?:rank \d+: )?(?:LOAD|SAVE) report: (\{.*\})\s*$")
_PLANNED = re.compile(
    r"Foundry: reading ahead (\d+) files(?:.*planned in ([0-9.]+) s)?(?:.*?, ([0-9.]+) s into this process)?"
)
_READ_AHEAD = re.compile(r"Foundry: read ahead (\d+) of (\d+) files \(([0-9.]+) MB\) in ([0-9.]+) s")
_STARTS_BY = re.compile(r"Foundry: schedulers start by (\w+)(?: \((.*)\))?\s*$")
#: What of a start report a result keeps (the rest stays in the log)
_REPORT_KEYS = (
    "foundry_critical_s",
    "foundry_steps_s",
    "check_archive_split",
    "scheduler_start",
    "restore_s",
    "process_age_s",  # SGLang: when the plugin, and Foundry's session, came in the scheduler's life
    "gc_frozen",  # vLLM: the import heap set aside from the collector (None: switched off)
    "gc_frozen_objects",  # the same, counted (until 3842b70)
)


def foundry_facts(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """Foundry's own lines of a start's log, for the result: its start report (the first rank's:
    steps, the archive check's split, how the scheduler started), when the read-ahead was planned
    and what it read, and the launcher's scheduler start method with its reason."""
    out: dict[str, Any] = {}
    for t, line in lines:
        if "report" not in out and (m := _REPORT.search(line)):
            try:
                report = json.loads(m.group(1))
            except ValueError:
                continue
            out["report"] = {k: report[k] for k in _REPORT_KEYS if k in report}
            new = (report.get("caches") or {}).get("new_files") or {}
            if "total" in new:
                out["report"]["caches_new_files"] = new["total"]
        elif "readahead_planned_at_s" not in out and (m := _PLANNED.search(line)):
            # the process's own age where the line says it: a plan made at interpreter start is
            # logged only once the engine's plugin hands Foundry its logger
            out["readahead_planned_at_s"] = float(m.group(3)) if m.group(3) else round(t, 3)
            out["readahead_files"] = int(m.group(1))
            if m.group(2):
                out["readahead_plan_s"] = float(m.group(2))
        elif m := _READ_AHEAD.search(line):
            out["readahead_done_at_s"] = round(t, 3)
            out["readahead_read"] = {"files": int(m.group(1)), "of": int(m.group(2)), "mb": float(m.group(3))}
        elif "scheduler_start" not in out and (m := _STARTS_BY.search(line)):
            out["scheduler_start"] = {"method": m.group(1), "reason": m.group(2)}
    return out


def refusal(lines: list[tuple[float, str]]) -> str | None:
    """The line that says why a server stopped: the last Foundry line, exception or error."""
    for _, line in reversed(lines):
        if re.search(r"\[Foundry\]|Foundry:|SystemExit|Error|error:|refus", line):
            return line.strip()[-400:]
    return lines[-1][1].strip()[-400:] if lines else None


def kill_group(proc: subprocess.Popen) -> None:
    """End the server and everything it spawned, SIGTERM then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or its zombie keeps the group "alive"
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


def wait_ready(base: str, proc: subprocess.Popen, deadline: float) -> str:
    """Poll every 50 ms until /health and /v1/models answer 200; returns the model id."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerDied(f"server exited with status {proc.returncode} before it was ready")
        try:
            if http_json(base + "/health", timeout=2.0)[0] == 200:
                status, models = http_json(base + "/v1/models", timeout=2.0)
                if status == 200 and isinstance(models, dict) and models.get("data"):
                    return models["data"][0]["id"]
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    raise TimeoutError("server not ready before the start's timeout")


def first_streamed_token(base: str, model: str, timeout: float) -> float:
    """POST a streamed completion; the monotonic time its first chunk with text or a token came."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with _HTTP.open(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or [{}]
            if choices[0].get("text") is not None or choices[0].get("token_ids"):
                return time.monotonic()
    raise RuntimeError("the streamed completion ended without a token")


def outputs(base: str, engine: str, model: str, timeout: float) -> dict[str, Any]:
    """Greedy tokens and top-5 logprobs of :data:`PROMPTS`, one request per prompt in turn, so that
    every start runs the same batches: sent in one request, a prompt the engine schedules alone in
    one start and beside the others in another is prefilled by other kernels (on the H100 on
    2026-12-05 one of five stock vLLM starts answered the first prompt so, from its prefill on).
    ``batched``: the same prompts in one request (decode batches of four), kept beside them."""
    deadline = time.monotonic() + timeout
    out: dict[str, Any] = {"tokens": [], "top_logprobs": []}
    for prompt in PROMPTS:
        one = _completions(base, engine, model, prompt, max(1.0, deadline - time.monotonic()))
        out["tokens"] += one["tokens"]
        out["top_logprobs"] += one["top_logprobs"]
    out["prompts_differ"] = len({json.dumps(t) for t in out["tokens"]}) > 1
    out["batched"] = _completions(base, engine, model, PROMPTS, max(1.0, deadline - time.monotonic()))
    return out


def _completions(base: str, engine: str, model: str, prompt: Any, timeout: float) -> dict[str, Any]:
    """Tokens and top-5 logprobs of one completions request, a choice per prompt in order."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
    body.update(logprobs=TOP_LOGPROBS, ignore_eos=True, return_token_ids=True)
    if engine == "vllm":
        body["return_tokens_as_token_ids"] = True
    status, resp = http_json(base + "/v1/completions", body, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {str(resp)[:300]}")
    out: dict[str, Any] = {"tokens": [], "top_logprobs": []}
    for c in sorted(resp.get("choices") or [], key=lambda c: c.get("index", 0)):
        lp = c.get("logprobs") or {}
        out["tokens"].append(c.get("token_ids") or lp.get("tokens") or [])
        out["top_logprobs"].append(
            [sorted((str(k), v) for k, v in (d or {}).items()) for d in lp.get("top_logprobs") or []]
        )
    return out


class Server:
    """A started server: ``with Server(...) as s:`` measures ready and TTFT on entry, stops on exit."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, engine: str, timeout_s: float):
        self.argv, self.env, self.log, self.engine, self.timeout_s = argv, env, log, engine, timeout_s
        self.rec: dict[str, Any] = {}
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pump = LogPump(self.proc.stdout, self.log, t0)
        self.pump.start()
        try:
            self.model = wait_ready(self.base, self.proc, deadline)
            self.rec["ready_s"] = round(time.monotonic() - t0, 3)
            t_first = first_streamed_token(self.base, self.model, max(5.0, deadline - time.monotonic()))
            self.rec["ttft_cold_s"] = round(t_first - t0, 3)
            self.rec["outputs"] = outputs(
                self.base, self.engine, self.model, max(5.0, deadline - time.monotonic())
            )
        except BaseException as e:
            self.__exit__(None, None, None)
            self.rec["error"] = f"{type(e).__name__}: {e}"[:500]
            self.rec["refusal"] = refusal(read_log(self.log))
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.pump.join(timeout=5.0)
            lines = read_log(self.log)
            self.rec["phases"] = phases(lines, self.engine, self.rec.get("ready_s"))
            facts = foundry_facts(lines)
            if facts:
                self.rec["foundry"] = facts
            self.proc = None
