"""Engine-level fault cases (issue 19) against a real SGLang or vLLM server with Foundry, on one GPU.

    python benchmarks/engine_faults.py --engine sglang --out $OUT/faults-sglang-h200.json --logs $OUT/logs

Every case starts real servers (``sglang.launch_server`` / ``vllm serve`` with ``--enable-foundry``,
built by ``benchmarks/engine_run.py``: same command, environment, model directory and requests),
does something unkind to them or to their archive directory, and records a verdict (``pass``,
``fail``, ``inconclusive``, ``skipped``, ``error``) with the checks behind it, timings, each server's
mode and the Foundry lines of its log. First, once, a **base** SAVE (``mode = "auto"``, empty archive
directory) gives the reference outputs (greedy tokens and top-5 logprobs of 4 prompts) and the archive
that the cases needing a complete one start from (a fresh copy each). Cases (``--cases``, default all
but the last):

* ``kill_during_save``: a SAVE SIGKILLed (its whole process group) at each ``--kill-points`` point,
  each restart in auto mode being the next point's target, the last one serving: ``capture`` (the
  engine's first capture progress line), ``persisting`` (the graph archive's scratch directory
  exists: ``fc.save`` is writing), ``published`` (the graph archive is published, the record that
  marks a SAVE finished, ``rank0.sglang.json`` / ``rank0.vllm.json``, is not written yet),
  ``complete`` (that record exists). Pass: each restart SAVEs (LOADs only where the kill came after
  the record was written), the last serves the reference outputs, the directory then holds one
  complete, consistent archive.
* ``disk_full``: the archive directory on a small tmpfs (root and ``mount`` permitted), else the
  servers run under RLIMIT_FSIZE set between the largest file the base SAVE wrote elsewhere and the
  largest member of its graph archive. Auto: serves the reference outputs with a ``SAVE failed``
  warning and leaves no archive; save: stops with a line naming the cause, leaves no archive.
* ``read_only_dir``: the directory read-only (chmod 0555; as root, where that changes nothing, a
  read-only bind mount, else an existing read-only mount, else a path under /proc that cannot be
  created). Auto serves with a warning; save refuses at startup with one line.
* ``two_replicas``: two auto servers spawned together on one empty directory. Pass: both serve the
  reference outputs, exactly one published, the directory holds one consistent archive (checked
  here and with ``python -m foundry_core.cli verify``).
* ``archive_replaced``: while a LOAD server runs (and keeps answering), a save-mode server publishes
  a new archive into its directory; then a next auto start loads the new one (graph and carried
  caches digests differ from the base's).
* ``damaged_cache``: one byte flipped in a member of the carried caches (``rank0.caches``): auto
  LOADs the graphs with a warning naming the reason and compiles as usual; load mode refuses.
* ``sustained_load`` (only when listed): a LOAD server under a request schedule of mixed batch
  sizes for ``--sustain`` seconds (two passes of the schedule at least), each answer compared with
  the base server's answer to the same request, the server's device memory sampled for growth; a
  stock server (no ``--enable-foundry``, the plugins' Inductor pin in its environment) started
  beside it answers two passes of the same schedule, compared with the LOAD's first two and with
  the base's. A base made by a call that did not list ``sustained_load`` (reused by ``--resume``)
  has no answers to the schedule: then stock's two passes are the reference for every LOAD pass
  (``reference: "stock server"``).

Budget: ``--budget`` seconds for everything; a case whose estimate (from the base's measured SAVE
and the LOADs seen so far) does not fit what is left is skipped with the reason. The JSON at
``--out`` is rewritten after every case; ``--resume`` keeps the cases (and the base) of an earlier
call on the same machine (same engine, commit and workdir), so the cases can be spread over several
device calls; ``kill_during_save`` run again keeps the earlier call's kills at the points it does not
run (``--kill-points capture,persisting`` in one call, ``published`` with ``--resume`` in the next).
SAVEs are always cold (Foundry compiles a SAVE into fresh private cache folders); HOME and TMPDIR
are shared by every server and never emptied, and the cases that start from the base archive get
its carried caches, so LOADs are warm. ``--parallel N`` runs up to N cases at once
(each server's KV cache is pinned by ``--kv-cache-gib`` so that servers can share the GPU).

The cases that start from the base archive (``archive_replaced``, ``damaged_cache``,
``sustained_load``) get a fresh copy of it put back at the base's own path, and start with the base's
TOML path (rewritten before each start) and cache root: for vLLM the TOML's absolute path is part of
the archive's fingerprint (vLLM hashes ``additional_config``), and Foundry names a start's private
cache folder after the archive path, so the carried caches whose files name their folder hit. Such
cases never run at the same time. Default model: the 4-layer Qwen3 of ``examples/qwen3-tiny`` with
dummy weights (``--model 1.7b`` for the Qwen3-1.7B shape), graphs up to batch 64 (``--max-bs``).

On the GPU machine: ``benchmarks/run_faults_h200.sh`` (one device call; see its header).

Table mode, anywhere (no GPU, no engine), from the results of earlier calls, one or more per engine:

    python benchmarks/engine_faults.py table --out benchmarks/results/faults-h200.json \
        benchmarks/results/faults-*-h200*.json

writes one row per case of CASES and engine of ENGINES: the case's verdict as ``outcome`` and, derived
from its checks, ``partial_archive_loadable``, ``served_after``, ``outputs_identical`` and
``strict_mode_refused`` (null, with ``notes``, where a field does not apply); sustained_load's row adds
its requests, duration, mismatches and memory growth. Of several results of one engine, each row takes
the newest (by ``date``) in which its case ran, and names that result's file, commit and date. A case
or engine without a result is a row ``not run`` with null fields; ``all_required_rows_passed`` is true
only when every row passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import engine_run as cs  # noqa: E402  (beside this file)

REPO = cs.REPO
SRC = cs.SRC
ENGINES = cs.ENGINES
CASES = (
    "kill_during_save",
    "disk_full",
    "read_only_dir",
    "two_replicas",
    "archive_replaced",
    "damaged_cache",
    "sustained_load",
)
DEFAULT_CASES = CASES[:-1]  # sustained_load only when asked for
#: Cases that start from a copy of the base archive (and so share the base's TOML path).
STAGED = ("archive_replaced", "damaged_cache", "sustained_load")
KILL_POINTS = ("capture", "persisting", "published", "complete")
MODELS = {"tiny": REPO / "examples" / "qwen3-tiny" / "config.json", "1.7b": None}
VERDICTS = ("pass", "fail", "inconclusive", "skipped", "error")
#: Seconds one server start takes when nothing was measured yet (H200, 2026-12-01 cold_start runs):
#: a SAVE is always cold, a LOAD from the base archive is warm, a refusal ends after the imports.
DEFAULT_TIMES = {"save": 170.0, "load": 65.0, "refuse": 45.0}
MARGIN_S = 25.0  # kept back from the budget for stopping servers and writing the result
REFUSAL_GRACE_S = 60.0  # a start that printed its refusal has this long to end by itself
#: A stock server's additions to its environment: the Inductor defaults both plugins pin in the
#: engine's processes (foundry_core.engine.inductor.PINNED, spelled out; a test keeps them equal).
STOCK_ENV = {"TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "0"}
MAX_TOKENS = 32
SUSTAIN_SIZES = (1, 3, 8, 16, 32, 64)
RANK = 0
RECORD_NAMES = {"sglang": f"rank{RANK}.sglang.json", "vllm": f"rank{RANK}.vllm.json"}
START_REPORT = f"rank{RANK}.start.json"  # vLLM's start report, beside the archive

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

# --- arguments ---------------------------------------------------------------------------------------


def _names(text: str, known: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in known]
    if unknown or len(set(names)) != len(names) or not names:
        p.error(f"{what} takes each of {', '.join(known)} at most once (got {text!r})")
    return [x for x in known if x in names]  # the fixed order is part of the method


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--out", required=True, help="result JSON (rewritten after every case)")
    p.add_argument("--logs", required=True, help="directory for one log per server")
    p.add_argument("--workdir", default=None, help="model, archives, HOME, TMPDIR (default: new temp dir)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--budget", type=float, default=3600.0, help="seconds for everything (base included)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one server may take to be ready")
    p.add_argument(
        "--kill-points",
        default="persisting",
        help=f"kill_during_save: where SAVEs are killed, a chain (comma-separated subset of {KILL_POINTS})",
    )
    p.add_argument("--kill-delay", type=float, default=0.5, help="seconds after the capture's first line")
    p.add_argument(
        "--disk-full-size",
        default="1m",
        help="tmpfs size for disk_full (smaller if the base "
        "archive is small: at most half the base graph archive's bytes)",
    )
    p.add_argument("--sustain", type=float, default=120.0, help="seconds of sustained_load")
    p.add_argument("--sample-every", type=float, default=5.0, help="sustained_load: memory sample interval")
    p.add_argument("--parallel", type=int, default=1, help="cases run at once (staged cases stay serial)")
    p.add_argument("--no-mount", action="store_true", help="never mount (tmpfs, bind): use the fallbacks")
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (examples/qwen3-tiny, 4 layers), 1.7b (the Qwen3-1.7B shape) or a config.json",
    )
    p.add_argument(
        "--weights",
        choices=("dummy", "seeded"),
        default="dummy",
        help="dummy (the engines' own random weights, the path every GPU run so far "
        "took) or seeded (a checkpoint from foundry_tools.weights: outputs that differ more by prompt)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens generated per prompt")
    p.add_argument(
        "--max-bs",
        type=int,
        default=64,
        help="largest decode batch with a graph (SGLang --cuda-graph-max-bs-decode, vLLM --max-num-seqs); "
        "0 keeps engine_run.py's 512",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="KV cache per server (SGLang --max-total-tokens, vLLM --kv-cache-memory-bytes), so that "
        "servers started together size it alike; 0 lets the engines profile memory",
    )
    p.add_argument("--region-size", default="128GiB", help="Foundry region per rank ([region] size)")
    p.add_argument("--resume", action="store_true", help="keep the cases of an earlier call in --out")
    opts = p.parse_args(argv)
    opts.cases = _names(opts.cases, CASES, "--cases", p)
    opts.kill_points = _names(opts.kill_points, KILL_POINTS, "--kill-points", p)
    if opts.model in MODELS:
        opts.model_config = str(MODELS[opts.model]) if MODELS[opts.model] else None
    elif Path(opts.model).is_file():
        opts.model_config = str(Path(opts.model).resolve())
    else:
        p.error(f"--model: {opts.model!r} is neither {', '.join(MODELS)} nor a config.json")
    if opts.parallel < 1:
        p.error("--parallel must be at least 1")
    return opts


# --- server command line -------------------------------------------------------------------------------


def set_arg(argv: list[str], flag: str, value: Any) -> list[str]:
    """``argv`` with ``flag``'s value replaced, or the pair added before the Foundry flags."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
        return argv
    at = argv.index("--enable-foundry") if "--enable-foundry" in argv else len(argv)
    argv[at:at] = [flag, str(value)]
    return argv


def kv_sizes(config: dict[str, Any], gib: float, max_model_len: int = 4096) -> tuple[int | None, int | None]:
    """(SGLang max_total_tokens, vLLM kv_cache_memory_bytes) for ``gib`` GiB of bf16 KV cache, each at
    least two full-length requests; (None, None) for 0 (the engines profile memory themselves)."""
    if gib <= 0:
        return None, None
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", heads)) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    per_token = int(config.get("num_hidden_layers", 1)) * kv_heads * head_dim * 2 * 2
    context = int(config.get("max_position_embeddings") or max_model_len)
    tokens = max(int(gib * (1 << 30)) // per_token, 2 * context)
    return tokens, max(int(gib * (1 << 30)), 2 * max_model_len * per_token)


def server_argv(
    engine: str,
    model_dir: Path,
    port: int,
    toml: Path | None,
    *,
    dummy: bool,
    max_bs: int,
    kv_tokens: int | None,
    kv_bytes: int | None,
) -> list[str]:
    argv = cs.server_command(engine, model_dir, port, toml, dummy=dummy)
    if engine == "sglang":
        argv = set_arg(argv, "--cuda-graph-max-bs-decode", max_bs) if max_bs else argv
        argv = set_arg(argv, "--max-total-tokens", kv_tokens) if kv_tokens else argv
    else:
        argv = set_arg(argv, "--max-num-seqs", max_bs) if max_bs else argv
        argv = set_arg(argv, "--kv-cache-memory-bytes", kv_bytes) if kv_bytes else argv
    return argv


def write_toml(path: Path, archive_dir: Path, mode: str, region_size: str) -> None:
    text = cs.foundry_toml(archive_dir, region_size).replace('mode = "auto"', f'mode = "{mode}"')
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- the server's output ----------------------------------------------------------------------------------


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


# --- outputs ---------------------------------------------------------------------------------------------


def compare_outputs(got: dict[str, Any] | None, want: dict[str, Any] | None) -> dict[str, Any]:
    """Tokens and logprobs (chosen and top-5) of ``got`` against ``want``; where they differ, the
    first differing token and the largest logprob difference."""
    if not got or not want:
        return {"tokens": None, "logprobs": None, "equal": None}
    tokens = got.get("tokens") == want.get("tokens")
    lp = ("token_logprobs", "top_logprobs")
    logprobs = [got.get(k) for k in lp] == [want.get(k) for k in lp]
    out: dict[str, Any] = {"tokens": tokens, "logprobs": logprobs, "equal": tokens and logprobs}
    if not tokens:
        for i, (a, b) in enumerate(zip(got.get("tokens") or [], want.get("tokens") or [])):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is not None or len(a) != len(b):
                out["first_difference"] = {
                    "prompt": i,
                    "position": j,
                    "got": a[j : j + 4] if j is not None else len(a),
                    "want": b[j : j + 4] if j is not None else len(b),
                }
                break
    if not logprobs:
        worst = 0.0
        for a, b in zip(got.get("token_logprobs") or [], want.get("token_logprobs") or []):
            for x, y in zip(a or [], b or []):
                if isinstance(x, int | float) and isinstance(y, int | float):
                    worst = max(worst, abs(x - y))
        out["max_logprob_difference"] = worst
    return out


def sustained_requests(max_bs: int) -> list[list[list[int]]]:
    """sustained_load's schedule: one request per batch size, each prompt different in ids and length."""
    sizes = [k for k in SUSTAIN_SIZES if k <= max(max_bs or 512, 1)]
    words, first = cs.TOKENIZER_WORDS, len(cs.TOKENIZER_SPECIALS)
    return [
        [[first + (53 * i + 7 * j + 13 * k) % words for j in range(4 + (7 * i + k) % 24)] for i in range(k)]
        for k in sizes
    ]


# --- the archive directory ----------------------------------------------------------------------------------


def _scratch_re(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(name)}\.(?:tmp|link|old)-\d+-[0-9a-f]{{8}}")


def quick_state(archive_dir: Path, engine: str) -> dict[str, Any]:
    """Cheap enough to poll every few milliseconds: the graph archive's scratch directories, where
    its link points, and whether the record that marks a SAVE finished exists."""
    try:
        names = os.listdir(archive_dir)
    except OSError:
        names = []
    scratch = _scratch_re(f"rank{RANK}")
    link = archive_dir / f"rank{RANK}"
    try:
        target = os.readlink(link)
    except OSError:
        target = None
    return {
        "scratch": sorted(n for n in names if scratch.fullmatch(n) and ".tmp-" in n),
        "link": target,
        "record": RECORD_NAMES[engine] in names,
    }


def _archive_member(path: Path) -> dict[str, Any]:
    """One archive (graphs or carried caches) at ``path``, opened with every check but the machine's
    fingerprint (foundry_core.archive.open_archive: CPU only)."""
    out: dict[str, Any] = {"present": os.path.lexists(path), "link": None, "ok": False}
    if not out["present"]:
        return out
    with contextlib.suppress(OSError):
        out["link"] = os.readlink(path)
    real = path.resolve()
    files = [p for p in real.rglob("*") if p.is_file()] if real.is_dir() else []
    out["bytes"] = sum(p.stat().st_size for p in files)
    if files:
        biggest = max(files, key=lambda p: p.stat().st_size)
        out["max_member"] = {"name": biggest.relative_to(real).as_posix(), "bytes": biggest.stat().st_size}
    try:
        from foundry_core.archive import ArchiveError, open_archive
    except ImportError as e:
        out["error"] = f"foundry_core not importable here: {e}"
        return out
    try:
        archive = open_archive(path)
    except ArchiveError as e:
        out["error"] = " ".join(str(e).split())[:600]
        return out
    meta = archive.meta
    out.update(ok=True, digest=archive.digest, kind=meta.get("kind"))
    if isinstance(meta.get("graphs"), list):
        out["graphs"] = len(meta["graphs"])
        out["graph_names"] = sorted(str(g.get("name")) for g in meta["graphs"] if isinstance(g, dict))
    if "slots" in meta:
        out["slots"] = meta["slots"]
    return out


def archive_state(archive_dir: Path, engine: str) -> dict[str, Any]:
    """Everything a case asks of an archive directory after the fact: the graph archive and the
    carried caches (verified), the finishing record and whether it agrees with the graph archive,
    version directories, leftovers of killed writes. ``complete``: graphs and caches open and the
    record is there; ``consistent``: complete, the record matches the graph archive, one version of
    each, nothing left over; ``any_archive``: anything of an archive at all (lock files aside)."""
    name = f"rank{RANK}"
    try:
        entries = sorted(os.listdir(archive_dir))
    except OSError as e:
        return {
            "dir": str(archive_dir),
            "exists": False,
            "error": str(e),
            "complete": False,
            "consistent": False,
            "any_archive": False,
            "record": {"present": False},
        }
    graph = _archive_member(archive_dir / name)
    caches = _archive_member(archive_dir / f"{name}.caches")
    record_path = archive_dir / RECORD_NAMES[engine]
    record: dict[str, Any] = {"present": record_path.exists(), "name": RECORD_NAMES[engine]}
    data = None
    if record["present"]:
        try:
            data = json.loads(record_path.read_text())
            record["valid"] = isinstance(data, dict) and "fingerprint" in data
        except (OSError, ValueError) as e:
            record.update(valid=False, error=str(e))
    matches = None
    if isinstance(data, dict) and graph.get("ok"):
        if engine == "sglang":
            outputs = data.get("outputs") or {}
            matches = data.get("slots") == graph.get("slots") and set(outputs) <= set(
                graph.get("graph_names", [])
            )
        else:
            listed = {str(g.get("name")) for g in data.get("graphs") or [] if isinstance(g, dict)}
            matches = data.get("sizing") == graph.get("slots") and listed == set(graph.get("graph_names", []))
    record["matches_graph_archive"] = matches
    versions = {
        n: [e for e in entries if re.fullmatch(rf"\.{re.escape(n)}\.[0-9a-f]{{16}}", e)]
        for n in (name, f"{name}.caches")
    }
    leftovers = [
        e for e in entries if _scratch_re(name).fullmatch(e) or _scratch_re(f"{name}.caches").fullmatch(e)
    ]
    leftovers += [
        e for e in entries if re.fullmatch(rf"{re.escape(name)}\.(?:sglang|vllm|start)\.json\..*\.tmp", e)
    ]
    complete = bool(graph.get("ok") and caches.get("ok") and record.get("valid"))
    return {
        "dir": str(archive_dir),
        "exists": True,
        "entries": entries[:60],
        "graph": graph,
        "caches": caches,
        "record": record,
        "versions": versions,
        "leftovers": leftovers,
        "complete": complete,
        "consistent": bool(
            complete and matches and all(len(v) == 1 for v in versions.values()) and not leftovers
        ),
        # A record with no verified graph archive behind it: what a LOAD must never be offered.
        "loadable_partial": bool(record.get("valid") and not graph.get("ok")),
        "any_archive": bool(
            graph["present"] or caches["present"] or record["present"] or leftovers or any(versions.values())
        ),
    }


def stage_archive(src: Path, dst: Path) -> None:
    """A copy of the base archive (links kept relative, locks and start reports left behind)."""
    shutil.rmtree(dst, ignore_errors=True)
    # Leftovers of a write the base server's stop interrupted (a late caches save) stay behind too.
    skip = shutil.ignore_patterns("*.lock", START_REPORT, "*.tmp", ".*.tmp-*", ".*.link-*", ".*.old-*")
    shutil.copytree(src, dst, symlinks=True, ignore=skip)


def flip_byte(archive: Path) -> dict[str, Any]:
    """Flip one byte in the middle of the largest member of the archive at ``archive`` (a link to
    its version directory); the manifest is left alone, so only that member's sha256 check fails."""
    real = archive.resolve()
    members = sorted(p for p in real.rglob("*") if p.is_file() and p.name != "manifest.json")
    if not members:
        raise RuntimeError(f"{archive} has no member to damage")
    victim = max(members, key=lambda p: (p.stat().st_size, p.as_posix()))
    size = victim.stat().st_size
    offset = size // 2
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
    return {
        "member": victim.relative_to(real).as_posix(),
        "bytes": size,
        "offset": offset,
        "old": old,
        "new": old ^ 0xFF,
    }


def largest_file(roots: list[Path]) -> dict[str, Any]:
    best: dict[str, Any] = {"bytes": 0, "path": None}
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for fn in files:
                p = Path(dirpath, fn)
                with contextlib.suppress(OSError):
                    if not p.is_symlink() and p.stat().st_size > best["bytes"]:
                        best = {"bytes": p.stat().st_size, "path": str(p)}
    return best


def rlimit_threshold(archive_max: int | None, other_max: int | None) -> tuple[int | None, str]:
    """RLIMIT_FSIZE for disk_full's fallback: three quarters of the largest graph-archive member, if
    that still leaves a quarter of headroom over every other file the base SAVE wrote."""
    if not archive_max or other_max is None:
        return None, "the base SAVE's file sizes are unknown"
    limit = archive_max * 3 // 4
    if limit <= other_max * 5 // 4:
        return None, (
            f"largest graph-archive member {archive_max} B is not clearly larger than the largest other "
            f"file the SAVE wrote ({other_max} B): a file size limit cannot fail only the archive"
        )
    return limit, f"RLIMIT_FSIZE {limit} B: graph member {archive_max} B, other files at most {other_max} B"


# --- privileged file-system tricks (root) ----------------------------------------------------------------------


def _run(argv: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return done.returncode == 0, (done.stderr or done.stdout).strip()[-300:]


def writable(path: Path) -> bool:
    """Whether a file can be created in ``path`` (making the directory if needed), as the plugins'
    startup check does."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".faults-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def read_only_mounts() -> list[Path]:
    """Read-only mounts a test may point an archive directory at: only well-known system ones."""
    found = []
    try:
        rows = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    for row in rows:
        parts = row.split()
        if len(parts) < 4:
            continue
        mount = parts[1].replace("\\040", " ")
        if mount in ("/sys", "/proc/sys", "/sys/fs/cgroup") and "ro" in parts[3].split(","):
            found.append(Path(mount))
    return found


# --- one server ----------------------------------------------------------------------------------------------


class Server:
    """One engine server with Foundry (``mode`` in the TOML), its own port, log, cache root and
    report folder, in its own process group."""

    def __init__(
        self,
        ctx: Ctx,
        case: str,
        label: str,
        *,
        mode: str,
        archive_dir: Path,
        toml: Path,
        fsize_limit: int | None = None,
        cache_root: Path | None = None,
        stock: bool = False,
    ):
        self.ctx, self.case, self.label, self.mode = ctx, case, label, mode
        # stock: the same server without --enable-foundry (no TOML, no plugin), with a HOME and
        # TMPDIR of its own so that what it compiles stays out of the Foundry servers' caches.
        self.stock = stock
        self.archive_dir, self.toml, self.fsize_limit = archive_dir, toml, fsize_limit
        self.rundir = ctx.workdir / "runs" / case / label
        self.cache_root = cache_root or self.rundir / "caches"
        self.log_name = f"{case}-{label}.log"
        self.proc: subprocess.Popen | None = None
        self.pump: Pump | None = None
        self.t0 = 0.0
        self.port = 0
        self.rec: dict[str, Any] = {"label": label, "mode_requested": mode, "archive_dir": str(archive_dir)}
        self.model_id: str | None = None
        self.finished = False
        self._reports: dict[int, dict] = {}
        self._stop_watch = threading.Event()

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, *, write: bool = True) -> Server:
        ctx = self.ctx
        shutil.rmtree(self.rundir, ignore_errors=True)
        self.rundir.mkdir(parents=True)
        if write and not self.stock:
            write_toml(self.toml, self.archive_dir, self.mode, ctx.opts.region_size)
        self.port = cs.free_port()
        argv = server_argv(
            ctx.engine,
            ctx.bench.model_dir,
            self.port,
            None if self.stock else self.toml,
            dummy=ctx.bench.dummy_weights,
            max_bs=ctx.opts.max_bs,
            kv_tokens=ctx.kv_tokens,
            kv_bytes=ctx.kv_bytes,
        )
        home, tmp = ctx.home, ctx.tmp
        if self.stock:
            home, tmp = self.rundir / "home", self.rundir / "tmp"
            home.mkdir()
            tmp.mkdir()
        paths = cs.RunPaths(
            home=home,
            tmp=tmp,
            kept_home=home,
            kept_tmp=tmp,
            cache_root=self.cache_root,
            report_dir=self.rundir / "report",
        )
        env = cs.child_env(
            dict(os.environ),
            ctx.engine,
            "stock_cold" if self.stock else "save",
            paths,
            ctx.bench.shim,
            ctx.bench.other_plugins,
            ctx.bench.user_base,
        )
        if self.stock:
            # What both plugins set in the engine's processes (foundry_core's Inductor pin): without
            # it a stock process benchmarks halved reduction blocks and may sum in another order.
            env.update(STOCK_ENV)
        self.report_dir = paths.report_dir
        self.rec.update(command=shlex.join(argv), port=self.port, log=self.log_name, toml=str(self.toml))
        self.rec["toml_text"] = self.toml.read_text() if self.toml.exists() else None
        ctx.register(self)  # refused while the benchmark stops: no server is ever left unregistered
        self.t0 = time.monotonic()
        self.rec["spawn_offset_s"] = round(self.t0 - ctx.started, 3)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.rundir),
            start_new_session=True,
        )
        self.rec["pid"] = self.proc.pid
        if self.fsize_limit:
            # Set from here, not in a preexec_fn (unsafe beside threads): the server writes nothing
            # big for seconds, and every process it starts later inherits the limit.
            import resource

            resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (self.fsize_limit, self.fsize_limit))
            self.rec["rlimit_fsize"] = self.fsize_limit
        self.pump = Pump(self.proc.stdout, ctx.logs / self.log_name, self.t0)
        self.pump.start()
        if ctx.engine == "vllm" and not self.stock:  # its start report lands beside the archive
            threading.Thread(target=self._watch_reports, daemon=True).start()
        return self

    def _watch_reports(self) -> None:
        path = self.archive_dir / START_REPORT
        while not self._stop_watch.wait(0.25):
            self._read_report_file(path)

    def _read_report_file(self, path: Path) -> None:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                self._reports[data["pid"]] = data

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, deadline: float) -> bool:
        self.rec["stage"] = "starting"
        try:
            self.model_id = cs.wait_ready(f"http://127.0.0.1:{self.port}", self.proc, deadline)
        except (cs.ServerDied, TimeoutError, OSError) as e:
            self.rec["error"] = f"{type(e).__name__}: {e}"
            return False
        self.rec["ready_s"] = self.elapsed()
        self.rec["stage"] = "ready"
        return True

    def wait_exit_or_ready(self, deadline: float, line: str | None = None) -> str:
        """For a start that must fail: 'exited', 'ready' (it served after all) or 'timeout'. Once a
        line matching ``line`` (a LOG_PATTERNS key) is seen, the server has REFUSAL_GRACE_S left to
        end by itself."""
        ready = self.pump.watch(ENGINE_PATTERNS[self.ctx.engine]["ready"])
        said = self.pump.watch(LOG_PATTERNS[line]) if line else None
        while time.monotonic() < deadline:
            if said is not None and said.is_set():
                deadline = min(deadline, self.t0 + said.t + REFUSAL_GRACE_S)
            if self.proc.poll() is not None:
                self.rec["exited_s"] = self.elapsed()
                return "exited"
            if ready.is_set():
                try:
                    status, _ = cs.http_json(f"http://127.0.0.1:{self.port}/health", timeout=2.0)
                except OSError:
                    status = None
                if status == 200:
                    self.rec["ready_s"] = self.elapsed()
                    return "ready"
            time.sleep(0.2)
        return "timeout"

    def complete(self, prompts: list[list[int]] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        body = cs.completion_body(self.ctx.engine, self.model_id or "", self.ctx.opts.max_tokens)
        if prompts is not None:
            body["prompt"] = prompts
        status, resp = cs.http_json(f"http://127.0.0.1:{self.port}/v1/completions", body, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {str(resp)[:300]}")
        return cs.extract_outputs(resp)

    def check(self, reference: dict[str, Any] | None, what: str = "request") -> dict[str, Any]:
        """One request of the reference prompts, compared with the reference; kept in the record."""
        entry: dict[str, Any] = {"what": what, "t_s": self.elapsed()}
        try:
            got = self.complete()
        except (RuntimeError, OSError) as e:
            entry.update(error=f"{type(e).__name__}: {e}", equal=False)
        else:
            entry.update(compare_outputs(got, reference))
            if entry.get("equal") is False:
                entry["outputs"] = got
        self.rec.setdefault("requests", []).append(entry)
        return entry

    def kill9(self) -> float:
        """SIGKILL the whole process group now; returns the server's clock at the kill."""
        t = self.elapsed()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.rec["killed_at_s"] = t
        return t

    def stop(self) -> None:
        if self.finished or self.proc is None:
            return
        self.finished = True
        self.rec["exited_by_itself"] = self.proc.poll() is not None and "killed_at_s" not in self.rec
        if "killed_at_s" in self.rec:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything it started since
        cs.kill_group(self.proc)
        self.rec["exit_code"] = self.proc.wait()
        self.pump.join(timeout=10)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()
        self._stop_watch.set()
        self.ctx.unregister(self)
        lines = self.pump.snapshot()
        facts = log_facts(lines, self.ctx.engine)
        self.rec["mode_logged"] = facts["mode"]
        self.rec["facts"] = facts
        self.rec["report"] = self.report(facts["engine_pids"])
        self.rec["excerpt"] = excerpt(lines)
        if not self.rec.get("ready_s") or self.rec.get("error"):
            self.rec["log_tail"] = "\n".join(line for _, line in lines[-40:])[-5000:]

    def report(self, engine_pids: list[int]) -> dict[str, Any] | None:
        if self.ctx.engine == "sglang":
            try:
                return json.loads((self.report_dir / f"rank{RANK}.json").read_text())
            except (OSError, ValueError):
                return None
        self._read_report_file(self.archive_dir / START_REPORT)
        for pid in engine_pids:
            if pid in self._reports:
                return self._reports[pid]
        return None


# --- the benchmark's state ---------------------------------------------------------------------------------------


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

    def register(self, server: Server) -> None:
        with self.lock:
            if self.stopping:
                raise SystemExit("benchmark is stopping")
            self.live.add(server)

    def unregister(self, server: Server) -> None:
        with self.lock:
            self.live.discard(server)

    def mount(self, argv: list[str], target: Path) -> tuple[bool, str]:
        if self.opts.no_mount or os.geteuid() != 0:
            return False, "not mounting (--no-mount or not root)"
        ok, detail = _run(argv)
        if ok:
            with self.lock:
                self.mounts.append(target)
        return ok, detail

    def umount(self, target: Path) -> None:
        ok, _ = _run(["umount", str(target)])
        if not ok:
            _run(["umount", "-l", str(target)])
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


class CaseRun:
    """One case's folder, servers and record."""

    def __init__(self, ctx: Ctx, name: str):
        self.ctx, self.name = ctx, name
        self.dir = ctx.workdir / "cases" / name
        _clean(self.dir, ctx)
        self.dir.mkdir(parents=True)
        self.rec: dict[str, Any] = {"name": name, "checks": {}, "details": {}, "servers": {}}
        self.servers: list[Server] = []

    def server(self, label: str, **kwargs: Any) -> Server:
        s = Server(self.ctx, self.name, label, **kwargs)
        self.servers.append(s)
        self.rec["servers"][label] = s.rec
        return s

    def close(self) -> None:
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()


def _clean(path: Path, ctx: Ctx | None = None) -> None:
    """Remove a folder a previous call may have left mounted or read-only."""
    if not path.exists():
        return
    for m in sorted(_mounts_under(path), key=len, reverse=True):
        _run(["umount", "-l", m])
    for dirpath, dirs, _files in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(Path(dirpath, d), 0o755)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    try:
        rows = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    prefix = str(path.resolve())
    return [
        r.split()[1] for r in rows if len(r.split()) > 1 and (r.split()[1] + "/").startswith(prefix + "/")
    ]


# --- verdicts -------------------------------------------------------------------------------------------------


def verdict(checks: dict[str, bool | None]) -> str:
    """pass: every check true; fail: any false; inconclusive: none false but some unknown."""
    if not checks:
        return "inconclusive"
    values = list(checks.values())
    if any(v is False for v in values):
        return "fail"
    return "pass" if all(v is True for v in values) else "inconclusive"


def restart_ok(kill: dict[str, Any], restart_mode: str | None) -> bool | None:
    """After a kill, auto mode must SAVE; it may LOAD only an archive that was complete (record
    written, graph and caches verified) when the kill came."""
    if restart_mode is None:
        return None
    state = kill.get("state_after") or {}
    if restart_mode == "save":
        return True
    return restart_mode == "load" and bool(state.get("complete"))


def requests_equal(rec: dict[str, Any]) -> bool | None:
    """Every request a server answered equals the reference (None: it answered none)."""
    requests = rec.get("requests") or []
    if not requests:
        return None
    return all(r.get("equal") is True for r in requests)


def refused_cleanly(rec: dict[str, Any], key: str) -> dict[str, bool | None]:
    """A start that must fail: it never became ready, ended by itself with a nonzero status, and
    its log has the expected line (``key`` in LOG_PATTERNS)."""
    facts = rec.get("facts") or {}
    return {
        "never_ready": rec.get("ready_s") is None,
        "exited_nonzero": bool(rec.get("exited_by_itself")) and rec.get("exit_code") not in (0, None),
        "line": key in (facts.get("lines") or {}),
    }


# --- the cases -------------------------------------------------------------------------------------------------


def _serve_and_check(srv: Server, ref: dict[str, Any] | None, deadline: float) -> bool:
    if not srv.wait_ready(deadline):
        return False
    srv.check(ref)
    return True


def _auto_beside_save(ctx: Ctx, auto: Server, save: Server, expected: str) -> tuple[bool, str]:
    """Start an ``auto`` and a ``save`` server at once (the KV caches are pinned, so both fit):
    whether ``auto`` served the reference outputs, and how the ``save`` start ended
    (``expected``: the outcome its case wants, as ``wait_exit_or_ready`` names it)."""

    def auto_job() -> bool:
        auto.start()
        ok = _serve_and_check(auto, ctx.reference, ctx.deadline())
        auto.stop()
        return ok

    def save_job() -> str:
        save.start()
        outcome = save.wait_exit_or_ready(ctx.deadline(), expected)
        save.stop()
        return outcome

    served, outcome = _together(auto_job, save_job)
    return served, outcome


def _together(*jobs: Callable[[], Any]) -> list[Any]:
    """Run the jobs on threads and return their results once all have ended; the first exception a
    job raised is raised then."""
    results: list[Any] = [None] * len(jobs)

    def one(i: int, job: Callable[[], Any]) -> None:
        try:
            results[i] = job()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def reach_point(srv: Server, point: str, deadline: float, kill_delay: float) -> dict[str, Any]:
    """Wait until ``point`` of srv's SAVE and SIGKILL it there; the record says how it was seen. The
    point is looked for before whether the server ended or became ready (both can come within
    milliseconds of a record written last)."""
    engine = srv.ctx.engine
    pats = ENGINE_PATTERNS[engine]
    begin = srv.pump.watch(pats["capture_begin"])
    ready = srv.pump.watch(pats["ready"])
    before = quick_state(srv.archive_dir, engine)
    out: dict[str, Any] = {"point": point, "reached": False}
    while time.monotonic() < deadline:
        ended = srv.proc.poll() is not None
        if begin.is_set() and point == "capture":
            time.sleep(kill_delay)
            out.update(reached=True, how=f"capture line: {begin.line[-200:]}", t_s=srv.kill9())
            return out
        if begin.is_set():
            now = quick_state(srv.archive_dir, engine)
            fresh = [s for s in now["scratch"] if s not in before["scratch"]]
            published = now["link"] is not None and now["link"] != before["link"]
            if point == "persisting" and fresh:
                out.update(reached=True, how=f"graph archive scratch directory {fresh[0]} present")
            elif point == "published" and published and not now["record"]:
                out.update(reached=True, how=f"graph archive published ({now['link']}), no record yet")
            elif point == "complete" and now["record"]:
                out.update(reached=True, how="record written")
            elif point in ("persisting", "published") and (
                now["record"] or (point == "persisting" and published)
            ):
                out.update(why="the SAVE got past this point between two looks", late=True)
            if out["reached"] or out.get("late"):
                out["t_s"] = srv.kill9()
                return out
        if ended:
            out["why"] = f"server exited with status {srv.proc.returncode} first"
            return out
        if ready.is_set():
            out["why"] = "server became ready first"
            return out
        time.sleep(0.005 if begin.is_set() else 0.05)
    out["why"] = "timed out before the point"
    return out


def case_kill_during_save(ctx: Ctx, run: CaseRun) -> None:
    archive = run.dir / "archive"
    toml = run.dir / "foundry.toml"
    kills: list[dict[str, Any]] = []
    final: Server | None = None
    for i, point in enumerate(ctx.opts.kill_points):
        srv = run.server(f"target{i}-{point}", mode="auto", archive_dir=archive, toml=toml).start()
        hit = reach_point(srv, point, ctx.deadline(), ctx.opts.kill_delay)
        if not hit["reached"] and not hit.get("late"):
            kills.append({**hit, "server": srv.label})
            final = srv if "ready" in hit.get("why", "") else None
            break
        srv.stop()
        ctx.gpu_settle()
        hit["state_after"] = archive_state(archive, ctx.engine)
        hit["server"] = srv.label
        kills.append(hit)
    if final is None and (not kills or kills[-1].get("t_s") is not None):
        final = run.server("restart", mode="auto", archive_dir=archive, toml=toml).start()
    served = False
    if final is not None:
        served = _serve_and_check(final, ctx.reference, ctx.deadline())
        final.stop()
    # Each kill's restart: the next target, or the final server.
    order = [s for s in run.servers]
    for k in kills:
        idx = next((j for j, s in enumerate(order) if s.label == k["server"]), None)
        nxt = order[idx + 1] if idx is not None and idx + 1 < len(order) else None
        k["restart"] = nxt.label if nxt else None
        k["restart_mode"] = nxt.rec.get("mode_logged") if nxt else None
        k["restart_ok"] = restart_ok(k, k["restart_mode"]) if k.get("t_s") is not None else None
    state = archive_state(archive, ctx.engine)
    run.rec["details"].update(kills=kills, state_after_restart=state)
    checks = run.rec["checks"]
    for k in kills:
        # A kill that landed past its point (the SAVE outran the 5 ms polling) is no fault of Foundry's.
        checks[f"kill_{k['point']}_reached"] = (
            True if k.get("reached") else (None if k.get("late") else False)
        )
        checks[f"restart_after_{k['point']}_saves_or_loads_only_complete"] = k.get("restart_ok")
        if k.get("state_after"):
            checks[f"no_loadable_partial_after_{k['point']}"] = not k["state_after"].get("loadable_partial")
    checks["restart_served"] = served
    checks["restart_outputs_equal_reference"] = requests_equal(final.rec) if final else None
    checks["archive_complete_and_consistent_after_restart"] = bool(state.get("consistent"))
    merge_earlier_kills(run.rec, ctx.earlier_cases.get("kill_during_save"))


def merge_earlier_kills(rec: dict[str, Any], earlier: dict[str, Any] | None) -> None:
    """--resume with other kill points: keep the earlier call's kills at points this call did not
    run, with their checks, so that one call per point covers the chain where one call cannot hold
    it (SGLang's SAVE starts take 110-175 s). A check both calls made is false if either was false."""
    if not earlier or earlier.get("verdict") not in ("pass", "fail", "inconclusive"):
        return
    details = rec["details"]
    now = [k.get("point") for k in details.get("kills", []) if k.get("point") is not None]
    kept = [k for k in (earlier.get("details") or {}).get("kills", []) if k.get("point") not in now]
    if not kept:
        return
    details["kills"] = [{**k, "call": "earlier"} for k in kept] + details.get("kills", [])
    labels = {k.get("server") for k in kept}
    for label, server in (earlier.get("servers") or {}).items():
        if label in labels:
            rec["servers"][f"earlier-{label}"] = server
    details["kill_points_by_call"] = {
        "earlier": [k.get("point") for k in kept],
        "last": now,
    }
    checks = rec["checks"]
    for key, value in (earlier.get("checks") or {}).items():
        if key not in checks:
            checks[key] = value
        elif value is False or (value is None and checks[key] is True):
            checks[key] = value


def _disk_full_dirs(ctx: Ctx, run: CaseRun) -> dict[str, Any]:
    """Two size-limited archive directories (auto, save) and how they are limited."""
    size = ctx.opts.disk_full_size
    graph_bytes = ((ctx.base_state or {}).get("graph") or {}).get("bytes")
    if graph_bytes:  # never larger than half the archive a SAVE writes, so it cannot fit
        size = str(min(parse_size(size), max(64 << 10, graph_bytes // 2)))
    dirs = {label: run.dir / label / "archive" for label in ("auto", "save")}
    how: dict[str, Any] = {"method": None, "dirs": {k: str(d) for k, d in dirs.items()}, "mount": {}}
    for d in dirs.values():
        d.mkdir(parents=True)
    for label, d in dirs.items():
        ok, detail = ctx.mount(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "faults-disk-full", str(d)], d
        )
        how["mount"][label] = detail or "ok"
        if not ok:  # both or neither: undo the one that worked
            for m in [m for m in list(ctx.mounts) if m in dirs.values()]:
                ctx.umount(m)
            break
    else:
        how.update(method="tmpfs", size=size)
        return how
    limit, why = rlimit_threshold(
        ctx.sizes.get("archive_max_member"), ctx.sizes.get("other_max_file", {}).get("bytes")
    )
    how.update(method="rlimit" if limit else None, rlimit=limit, rlimit_why=why)
    return how


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def case_disk_full(ctx: Ctx, run: CaseRun) -> None:
    how = _disk_full_dirs(ctx, run)
    run.rec["details"]["limit"] = how
    if how["method"] is None:
        run.rec["verdict_override"] = "skipped"
        run.rec["reason"] = f"no way to fill a disk here: {how.get('rlimit_why')}"
        return
    pre = how["rlimit"] if how["method"] == "rlimit" else None
    auto = run.server(
        "auto",
        mode="auto",
        archive_dir=Path(how["dirs"]["auto"]),
        toml=run.dir / "auto.toml",
        fsize_limit=pre,
    )
    save = run.server(
        "save",
        mode="save",
        archive_dir=Path(how["dirs"]["save"]),
        toml=run.dir / "save.toml",
        fsize_limit=pre,
    )

    served, outcome = _auto_beside_save(ctx, auto, save, "no_space")
    sa, ss = (archive_state(Path(how["dirs"][k]), ctx.engine) for k in ("auto", "save"))
    run.rec["details"].update(save_outcome=outcome, state_auto=sa, state_save=ss)
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    checks = run.rec["checks"]
    checks.update(
        auto_saved_then_failed=auto.rec.get("mode_logged") == "save" and "save_failed" in lines,
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
        auto_left_no_archive=not sa.get("any_archive"),
    )
    refusal = refused_cleanly(save.rec, "no_space")
    checks.update({f"save_{k}": v for k, v in refusal.items()})
    checks["save_left_no_archive"] = not ss.get("any_archive")
    run.rec["details"]["save_tracebacks"] = (
        (save.rec.get("facts") or {}).get("counts", {}).get("traceback", 0)
    )


def _read_only_dir(ctx: Ctx, path: Path) -> tuple[Path | None, str, list[str]]:
    """A directory nobody here can write into, and how it was made so."""
    notes: list[str] = []
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o555)
    if not writable(path):
        return path, "chmod 0555", notes
    notes.append("chmod 0555 changes nothing for root (it ignores permission bits)")
    os.chmod(path, 0o755)
    ok, detail = ctx.mount(["mount", "--bind", str(path), str(path)], path)
    if ok:
        ok, detail = _run(["mount", "-o", "remount,bind,ro", str(path)])
        if ok and not writable(path):
            return path, "read-only bind mount", notes
        notes.append(f"read-only remount failed: {detail}")
        ctx.umount(path)
    else:
        notes.append(f"bind mount not possible: {detail}")
    for m in read_only_mounts():
        if m.is_dir() and not writable(m):
            return m, f"existing read-only mount {m}", notes
    proc = Path("/proc/foundry-faults-archive")
    if not writable(proc):
        return proc, "a path under /proc (cannot be created)", notes
    return None, "none found", notes


def case_read_only_dir(ctx: Ctx, run: CaseRun) -> None:
    dirs: dict[str, Any] = {}
    for label in ("auto", "save"):
        d, method, notes = _read_only_dir(ctx, run.dir / label / "archive")
        dirs[label] = {"dir": str(d) if d else None, "method": method, "notes": notes}
    run.rec["details"]["dirs"] = dirs
    if not all(v["dir"] for v in dirs.values()):
        run.rec["verdict_override"] = "skipped"
        run.rec["reason"] = "no read-only location found"
        return
    auto = run.server("auto", mode="auto", archive_dir=Path(dirs["auto"]["dir"]), toml=run.dir / "auto.toml")
    save = run.server("save", mode="save", archive_dir=Path(dirs["save"]["dir"]), toml=run.dir / "save.toml")

    served, outcome = _auto_beside_save(ctx, auto, save, "save_refused")
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    checks = run.rec["checks"]
    checks.update(
        auto_warned=any(k in lines for k in ("not_writable", "save_failed")),
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
    )
    checks.update({f"save_{k}": v for k, v in refused_cleanly(save.rec, "save_refused").items()})
    for label in ("auto", "save"):
        path = Path(dirs[label]["dir"])
        if dirs[label]["method"] in ("chmod 0555", "read-only bind mount"):
            checks[f"{label}_wrote_nothing"] = not any(path.iterdir()) if path.is_dir() else True
    run.rec["details"].update(
        save_outcome=outcome,
        save_refusal_s=save.rec.get("exited_s"),
        auto_mode=auto.rec.get("mode_logged"),
        save_tracebacks=(save.rec.get("facts") or {}).get("counts", {}).get("traceback", 0),
    )


def _published(srv: Server) -> bool | None:
    """Whether this server's SAVE finished (its record written): its report says saved."""
    report = srv.rec.get("report") or {}
    if "saved" in report:
        return report["saved"] is True
    lines = (srv.rec.get("facts") or {}).get("lines") or {}
    if srv.ctx.engine == "sglang" and "published" in lines:
        return True
    return None if srv.rec.get("mode_logged") == "save" else False


def cli_verify(path: Path) -> dict[str, Any]:
    """``python -m foundry_core.cli verify``: integrity and this machine's fingerprint (GPU)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "foundry_core.cli", "verify", str(path)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    except (OSError, subprocess.SubprocessError) as e:
        return {"ok": None, "error": str(e)}
    return {
        "ok": done.returncode == 0,
        "rc": done.returncode,
        "output": (done.stdout + done.stderr).strip()[-800:],
    }


def case_two_replicas(ctx: Ctx, run: CaseRun) -> None:
    archive = run.dir / "archive"
    archive.mkdir()
    toml = run.dir / "foundry.toml"
    write_toml(toml, archive, "auto", ctx.opts.region_size)
    a = run.server("replica-a", mode="auto", archive_dir=archive, toml=toml)
    b = run.server("replica-b", mode="auto", archive_dir=archive, toml=toml)
    a.start(write=False)
    b.start(write=False)
    run.rec["details"]["spawn_skew_s"] = round(b.t0 - a.t0, 3)
    deadline = ctx.deadline()
    ready = _together(lambda: a.wait_ready(deadline), lambda: b.wait_ready(deadline))
    for srv, ok in zip((a, b), ready):
        if ok:
            srv.check(ctx.reference)
    a.stop()
    b.stop()
    ctx.gpu_settle()
    state = archive_state(archive, ctx.engine)
    verify = cli_verify(archive / f"rank{RANK}") if state["graph"].get("present") else {"ok": False}
    published = {s.label: _published(s) for s in (a, b)}
    timeline = {}
    for s in (a, b):
        lines = (s.rec.get("facts") or {}).get("lines") or {}
        timeline[s.label] = {
            k: round(lines[k]["t_s"] + s.rec["spawn_offset_s"], 3)
            for k in ("published", "caches_saved", "save_failed", "lock_held")
            if k in lines
        }
    run.rec["details"].update(state=state, cli_verify=verify, published=published, timeline_s=timeline)
    checks = run.rec["checks"]
    checks.update(
        both_ready=all(ready),
        both_outputs_equal_reference=all(requests_equal(s.rec) for s in (a, b)) if all(ready) else False,
        exactly_one_published=sum(1 for v in published.values() if v) == 1
        if None not in published.values()
        else None,
        archive_consistent=bool(state.get("consistent")),
        cli_verify_ok=verify.get("ok"),
    )


def _stage(ctx: Ctx, run: CaseRun) -> Path:
    """Put a fresh copy of the base archive back at the base's own path (see Ctx.base_cache_root)."""
    stage_archive(ctx.pristine, ctx.base_dir)
    run.rec["details"]["archive_dir"] = str(ctx.base_dir)
    return ctx.base_dir


def _start_staged(run: CaseRun, archive: Path, label: str, mode: str) -> Server:
    """A server on the staged base archive, started in ``mode``. Its settings go into the base's
    own TOML path (the path is part of vLLM's fingerprint), rewritten for this start."""
    ctx = run.ctx
    srv = run.server(
        label, mode=mode, archive_dir=ctx.base_dir, toml=ctx.base_toml, cache_root=ctx.base_cache_root
    )
    write_toml(ctx.base_toml, archive, mode, ctx.opts.region_size)
    srv.start(write=False)
    return srv


def case_archive_replaced(ctx: Ctx, run: CaseRun) -> None:
    archive = _stage(ctx, run)
    before = archive_state(archive, ctx.engine)
    load = _start_staged(run, archive, "load", "auto")
    checks = run.rec["checks"]
    if not load.wait_ready(ctx.deadline()):
        checks["load_served"] = False
        return
    load.check(ctx.reference, "before the new SAVE")
    save = _start_staged(run, archive, "save", "save")
    deadline = ctx.deadline()
    probes = 0
    save_ready = save.pump.watch(ENGINE_PATTERNS[ctx.engine]["ready"])
    while time.monotonic() < deadline and save.alive() and not save_ready.event.wait(5.0):
        load.check(ctx.reference, f"while the new SAVE starts ({save.elapsed():.0f} s)")
        probes += 1
    saved = save.wait_ready(deadline)
    if saved:
        save.check(ctx.reference)
    load.check(ctx.reference, "after the new archive was published")
    save.stop()
    after = archive_state(archive, ctx.engine)
    nxt = _start_staged(run, archive, "next", "auto")
    if nxt.wait_ready(ctx.deadline()):
        nxt.check(ctx.reference)
        ctx.times["load"] = nxt.rec["ready_s"]
    load.check(ctx.reference, "after the next start")
    nxt.stop()
    load.stop()
    digest = lambda s, k: (s.get(k) or {}).get("digest")  # noqa: E731
    next_caches = ((nxt.rec.get("report") or {}).get("caches") or {}).get("digest")
    run.rec["details"].update(
        probes_while_saving=probes, state_before=before, state_after=after, next_caches_digest=next_caches
    )
    checks.update(
        load_loaded=load.rec.get("mode_logged") == "load",
        load_outputs_equal_reference_throughout=requests_equal(load.rec),
        save_served=saved,
        save_published=_published(save),
        graph_digest_changed=None
        if not after["graph"].get("ok")
        else digest(after, "graph") != digest(before, "graph"),
        next_loaded=nxt.rec.get("mode_logged") == "load",
        next_outputs_equal_reference=requests_equal(nxt.rec),
        next_report_caches_digest_is_the_new_one=None
        if next_caches is None
        else next_caches == digest(after, "caches") and next_caches != digest(before, "caches"),
    )


def case_damaged_cache(ctx: Ctx, run: CaseRun) -> None:
    archive = _stage(ctx, run)
    run.rec["details"]["flipped"] = flip_byte(archive / f"rank{RANK}.caches")
    run.rec["details"]["state"] = archive_state(archive, ctx.engine)
    auto = _start_staged(run, archive, "auto", "auto")
    served = _serve_and_check(auto, ctx.reference, ctx.deadline())
    auto.stop()
    ctx.gpu_settle()
    load = _start_staged(run, archive, "load", "load")
    outcome = load.wait_exit_or_ready(ctx.deadline(), "caches_refused_load")
    load.stop()
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    reason = (lines.get("caches_refused_auto") or {}).get("reason") or ""
    report_caches = (auto.rec.get("report") or {}).get("caches") or {}
    compiled = (report_caches.get("new_files") or {}).get("total")
    run.rec["details"].update(
        load_outcome=outcome,
        auto_refusal_reason=reason,
        auto_compiled_files=compiled,
        load_tracebacks=(load.rec.get("facts") or {}).get("counts", {}).get("traceback", 0),
    )
    checks = run.rec["checks"]
    checks.update(
        auto_warned_naming_the_damage="sha256" in reason or "damaged" in reason,
        auto_loaded_graphs=auto.rec.get("mode_logged") == "load",
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
        auto_compiled_as_usual=None if compiled is None else compiled > 0,
    )
    checks.update({f"load_{k}": v for k, v in refused_cleanly(load.rec, "caches_refused_load").items()})


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry))
    return pids


def gpu_memory_of(pgid: int) -> dict[str, Any]:
    """Device memory (MiB) used by a server's processes where nvidia-smi names them, and the device's."""
    pids = set(_group_pids(pgid))
    mine = None
    rows = cs._nvidia_smi("compute-apps=pid,used_memory")
    with contextlib.suppress(ValueError):
        used = [int(r.split(",")[1]) for r in rows if int(r.split(",")[0]) in pids]
        mine = sum(used) if used else None
    return {"server_mib": mine, "device_mib": cs.gpu_memory_used_mib()}


def run_schedule(srv: Server, requests: list[list[list[int]]]) -> list[dict[str, Any]]:
    """One pass of the sustained schedule; each entry the request's outputs or its error."""
    out = []
    for prompts in requests:
        try:
            out.append(srv.complete(prompts))
        except (RuntimeError, OSError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def memory_growth(samples: list[dict[str, Any]], key: str) -> float | None:
    """Largest rise over the first sample taken after the first pass (None without two samples)."""
    values = [s[key] for s in samples if isinstance(s.get(key), int | float)]
    return None if len(values) < 2 else float(max(values) - values[0])


def _stock_answers(ctx: Ctx, stock: Server, requests: list[list[list[int]]], into: dict[str, Any]) -> None:
    """The stock server's answers to two passes of the schedule (``into["passes"]``), then its stop."""
    try:
        if stock.wait_ready(ctx.deadline()):
            into["passes"] = [run_schedule(stock, requests) for _ in range(2)]
    finally:
        stock.stop()


def compare_passes(
    got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]] | None
) -> dict[str, Any]:
    """Pass by pass, request by request: how many answers differ (an error counts as differing),
    and the first difference."""
    if not want or not got:
        return {"compared": 0, "mismatches": None, "first_mismatch": None}
    compared = mismatches = 0
    first = None
    for p, (g_pass, w_pass) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_pass, w_pass)):
            compared += 1
            cmp = compare_outputs(g, w) if "error" not in g and "error" not in w else {"equal": False}
            if cmp["equal"] is not True:
                mismatches += 1
                first = first or {"pass": p, "request": i, **cmp}
    return {"compared": compared, "mismatches": mismatches, "first_mismatch": first}


ANSWER_FIELDS = ("tokens", "token_logprobs", "top_logprobs")  # what compare_outputs compares
_NEGATIVE_ZERO = re.compile(r"-0\.0(?=[,\]}])")
_NAN_MARKS = itertools.count()


def _canonical(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return ["NaN", next(_NAN_MARKS)]  # unequal to everything under ==, so to every digest
        return x + 0.0  # -0.0 becomes 0.0: they are equal under ==
    if isinstance(x, list | tuple):
        return [_canonical(v) for v in x]
    if isinstance(x, dict):
        return {k: _canonical(v) for k, v in x.items()}
    return x


def answer_digest(answer: dict[str, Any]) -> str | None:
    """sha256 of the fields compare_outputs compares: two answers read from JSON have the same
    digest exactly when compare_outputs finds them equal (unless one server writes a number as 1
    and the other as 1.0). None for an error (or empty) answer, which equals nothing."""
    if not answer or "error" in answer:
        return None
    fields = [answer.get(k) for k in ANSWER_FIELDS]
    try:
        text = json.dumps(fields, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except ValueError:  # NaN or an infinity
        text = None
    if text is None or _NEGATIVE_ZERO.search(text):  # rare: the slower walk makes == and digests agree
        text = json.dumps(_canonical(fields), separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def compare_with_stock(
    kept: list[list[dict[str, Any]]],
    digests: list[list[str | None]],
    stock_passes: list[list[dict[str, Any]]] | None,
) -> dict[str, Any]:
    """Every LOAD pass p (``digests[p]``, one per request) against the stock server's pass
    min(p, 1), request by request, as the base reference is used. The passes in ``kept`` (the
    first ones, whole) are compared with compare_outputs, later ones by digest. An error on
    either side counts as a mismatch; without stock passes or LOAD passes nothing is compared."""
    if not stock_passes or not digests:
        return {"compared": 0, "mismatches": None, "first_mismatch": None}
    stock_digests = [[answer_digest(w) for w in w_pass] for w_pass in stock_passes]
    compared = mismatches = 0
    first = None
    for p, d_pass in enumerate(digests):
        s = min(p, len(stock_passes) - 1)
        for i, (d, w) in enumerate(zip(d_pass, stock_digests[s])):
            compared += 1
            if p < len(kept):  # both answers at hand: the full comparison
                g, want = kept[p][i], stock_passes[s][i]
                if "error" in g or "error" in want:
                    cmp = {"equal": False, "error": g.get("error") or want.get("error")}
                else:
                    cmp = compare_outputs(g, want)
            elif d is not None and d == w:
                continue
            else:
                cmp = {
                    "equal": False,
                    "digests_differ": True,
                    "load_error": d is None,
                    "stock_error": w is None,
                }
            if cmp["equal"] is not True:
                mismatches += 1
                first = first or {"pass": p, "request": i, **cmp}
    return {"compared": compared, "mismatches": mismatches, "first_mismatch": first}


def sustained_output_checks(
    base_reference: bool,
    mismatches: int | None,
    stock_answered: bool,
    vs_load: dict[str, Any],
    vs_reference: dict[str, Any],
) -> dict[str, bool | None]:
    """sustained_load's two output checks. ``mismatches``: the LOAD's passes against the base
    reference where there is one, else against stock's passes (None: nothing compared)."""
    if not base_reference:  # stock is the reference: its verdict on every LOAD pass is both checks
        equal = None if mismatches is None else mismatches == 0
        return {"outputs_equal_reference": equal, "outputs_equal_stock": equal}
    # Every LOAD pass equals the base SAVE's answers, and stock's two passes equal both the base's
    # and the LOAD's first two: so every LOAD answer equals stock's answer to the same request.
    stock_equal = None
    if stock_answered and vs_load["compared"] and vs_reference["compared"]:
        stock_equal = vs_load["mismatches"] == 0 and vs_reference["mismatches"] == 0 and mismatches == 0
    return {"outputs_equal_reference": mismatches == 0, "outputs_equal_stock": stock_equal}


def case_sustained_load(ctx: Ctx, run: CaseRun) -> None:
    archive = _stage(ctx, run)
    srv = _start_staged(run, archive, "load", "auto")
    requests = sustained_requests(ctx.opts.max_bs)
    # A stock server (no --enable-foundry) starts beside it and answers two passes of the same
    # schedule while the load runs: the LOAD's answers are compared with stock's, not only with the
    # base SAVE's (itself a Foundry server).
    stock = run.server(
        "stock", mode="stock", archive_dir=run.dir / "stock", toml=run.dir / "stock.toml", stock=True
    ).start(write=False)
    stock_out: dict[str, Any] = {}
    asking = threading.Thread(target=_stock_answers, args=(ctx, stock, requests, stock_out), daemon=True)
    asking.start()
    checks = run.rec["checks"]
    if not srv.wait_ready(ctx.deadline()):
        checks["served"] = False
        return
    refs = ctx.sustained_reference
    load_first: list[list[dict[str, Any]]] = []  # the LOAD's answers of its first two passes
    # Without a base reference, stock's passes are the reference, and they come late (stock may be
    # ready long after the LOAD): every LOAD pass is kept as one digest per answer, made on another
    # thread so that the request loop's timing stays as it is.
    digests: list[concurrent.futures.Future] = []
    duration = max(0.0, min(ctx.opts.sustain, ctx.left() - MARGIN_S - 15))
    t_end = time.monotonic() + duration
    samples: list[dict[str, Any]] = []
    passes = mismatches = errors = tokens = 0
    first_mismatch = None
    next_sample = 0.0
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as digesting:
        # At least two passes, however short --sustain: stock's two passes are compared with the
        # LOAD's first two.
        while (passes < 2 or time.monotonic() < t_end) and srv.alive():
            got = run_schedule(srv, requests)
            if len(load_first) < 2:
                load_first.append(got)
            if not refs:
                digests.append(digesting.submit(lambda got=got: [answer_digest(g) for g in got]))
            want = refs[min(passes, len(refs) - 1)] if refs else None
            for i, g in enumerate(got):
                if "error" in g:
                    errors += 1
                    continue
                tokens += sum(len(t) for t in g["tokens"])
                cmp = compare_outputs(g, want[i] if want else None)
                if cmp["equal"] is False:
                    mismatches += 1
                    first_mismatch = first_mismatch or {"pass": passes, "request": i, **cmp}
            passes += 1
            if passes == 1 or time.monotonic() >= next_sample:
                samples.append(
                    {"t_s": round(time.monotonic() - t0, 1), "pass": passes, **gpu_memory_of(srv.proc.pid)}
                )
                next_sample = time.monotonic() + ctx.opts.sample_every
        wall = time.monotonic() - t0
    srv.stop()
    asking.join(max(0.0, ctx.deadline() - time.monotonic()))  # deadline() is on the monotonic clock
    stock.stop()  # also when it was not ready by the deadline
    stock_passes = stock_out.get("passes")
    vs_load = compare_passes(load_first, stock_passes)
    vs_reference = compare_passes(refs[:2] if refs else [], stock_passes)
    reference = "base SAVE server" if refs else None
    if not refs:
        vs_stock = compare_with_stock(load_first, [f.result() for f in digests], stock_passes)
        mismatches, first_mismatch = vs_stock["mismatches"], vs_stock["first_mismatch"]
        reference = "stock server" if stock_passes else None
    key = "server_mib" if any(s.get("server_mib") for s in samples) else "device_mib"
    growth = memory_growth(samples, key)
    run.rec["details"].update(
        seconds=round(wall, 1),
        passes=passes,
        requests=passes * len(requests),
        errors=errors,
        batch_sizes=[len(r) for r in requests],
        tokens=tokens,
        tokens_per_s=round(tokens / wall, 1) if wall else None,
        mismatches=mismatches,
        first_mismatch=first_mismatch,
        reference=reference,
        memory_samples=samples[:200],
        memory_key=key,
        memory_growth_mib=growth,
        stock={
            "ready_s": stock.rec.get("ready_s"),
            "passes": len(stock_passes or []),
            "vs_load": vs_load,
            "vs_reference": vs_reference,
        },
    )
    checks.update(
        loaded=srv.rec.get("mode_logged") == "load",
        no_request_errors=errors == 0,
        **sustained_output_checks(bool(refs), mismatches, bool(stock_passes), vs_load, vs_reference),
        memory_growth_under_256_mib=None if growth is None else growth <= 256,
    )


CASE_FUNCS: dict[str, Callable[[Ctx, CaseRun], None]] = {
    "kill_during_save": case_kill_during_save,
    "disk_full": case_disk_full,
    "read_only_dir": case_read_only_dir,
    "two_replicas": case_two_replicas,
    "archive_replaced": case_archive_replaced,
    "damaged_cache": case_damaged_cache,
    "sustained_load": case_sustained_load,
}


def estimate_s(case: str, opts: argparse.Namespace, times: dict[str, float]) -> float:
    """Seconds a case needs, from the measured (or default) SAVE, LOAD and refusal times."""
    s, load, refuse = times["save"], times["load"], times["refuse"]
    return {
        "kill_during_save": s * (len(opts.kill_points) + 1),
        "disk_full": 1.2 * s,
        "read_only_dir": 1.2 * s,
        "two_replicas": 1.3 * s + 20,
        "archive_replaced": 2 * load + 1.2 * s,
        "damaged_cache": s + refuse,
        "sustained_load": load + opts.sustain + 10,
    }[case] + MARGIN_S


def skip_reason(case: str, ctx: Ctx, base_ok: bool) -> str | None:
    if not base_ok:
        return "skipped: the base SAVE did not give a reference and a complete archive"
    need = estimate_s(case, ctx.opts, ctx.times)
    left = ctx.left()
    if left < need:
        return f"skipped: needs about {need:.0f} s, {left:.0f} s of the budget left"
    return None


def run_case(ctx: Ctx, name: str, base_ok: bool, cases: dict[str, Any], flush: Callable[[], Any]) -> None:
    reason = skip_reason(name, ctx, base_ok)
    if reason:
        cases[name] = {"name": name, "verdict": "skipped", "reason": reason}
        flush()
        return
    t0 = time.monotonic()
    print(
        f"[engine_faults] {ctx.engine} {name}: starting ({ctx.left():.0f} s of the budget left)", flush=True
    )
    run = CaseRun(ctx, name)
    run.rec.update(
        started_s=round(t0 - ctx.started, 1), estimate_s=round(estimate_s(name, ctx.opts, ctx.times))
    )
    cases[name] = run.rec
    flush()  # a call killed from outside still shows which case was running
    lock = ctx.staged_lock if name in STAGED else contextlib.nullcontext()
    try:
        with lock:
            CASE_FUNCS[name](ctx, run)
    except BaseException as e:  # the case's record keeps what it got; the benchmark goes on
        run.rec["error"] = f"{type(e).__name__}: {e}"
        run.rec["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
    finally:
        run.close()
        for m in list(ctx.mounts):
            if str(m).startswith(str(run.dir)):
                ctx.umount(m)
        run.rec["seconds"] = round(time.monotonic() - t0, 1)
        override = run.rec.pop("verdict_override", None)
        run.rec["verdict"] = "error" if run.rec.get("error") else override or verdict(run.rec["checks"])
        failed = [k for k, v in run.rec["checks"].items() if v is not True]
        run.rec["not_passed_checks"] = failed
        print(
            f"[engine_faults] {name}: {run.rec['verdict']} in {run.rec['seconds']} s "
            f"{('(' + ', '.join(failed) + ')') if failed else ''} {run.rec.get('error') or ''}",
            flush=True,
        )
        flush()
        ctx.gpu_settle()


# --- the base SAVE ------------------------------------------------------------------------------------------------


def run_base(ctx: Ctx) -> dict[str, Any]:
    """The reference: a SAVE in auto mode into an empty directory, its outputs and its archive."""
    _clean(ctx.workdir / "base", ctx)
    shutil.rmtree(ctx.base_cache_root, ignore_errors=True)
    ctx.base_dir.mkdir(parents=True)
    srv = Server(
        ctx,
        "base",
        "save",
        mode="auto",
        archive_dir=ctx.base_dir,
        toml=ctx.base_toml,
        cache_root=ctx.base_cache_root,
    )
    rec: dict[str, Any] = {"server": srv.rec}
    srv.start()
    try:
        if srv.wait_ready(ctx.deadline()):
            first = srv.complete()
            second = srv.complete()
            rec["outputs"] = first
            rec["self_consistent"] = compare_outputs(second, first)
            rec["outputs_differ_between_prompts"] = cs.outputs_differ(first)
            if "sustained_load" in ctx.opts.cases:
                requests = sustained_requests(ctx.opts.max_bs)
                ref = [run_schedule(srv, requests) for _ in range(2)]
                path = ctx.workdir / "base" / "sustained-reference.json"  # large: kept out of the result
                path.write_text(json.dumps(ref))
                rec["sustained_reference"] = {"path": str(path), "requests": len(requests), "passes": 2}
    except (RuntimeError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        srv.stop()
    ctx.gpu_settle()
    state = archive_state(ctx.base_dir, ctx.engine)
    rec["state"] = state
    stage_archive(ctx.base_dir, ctx.pristine)
    graph = state.get("graph") or {}
    other = largest_file([ctx.base_cache_root, ctx.home, ctx.tmp, *map(Path, _glob("/tmp/torchinductor_*"))])
    rec["sizes"] = {
        "archive_max_member": (graph.get("max_member") or {}).get("bytes"),
        "other_max_file": other,
    }
    rec["ok"] = bool(
        rec.get("outputs")
        and state.get("complete")
        and srv.rec.get("mode_logged") == "save"
        and (rec.get("self_consistent") or {}).get("equal")
    )
    return rec


def _glob(pattern: str) -> list[str]:
    import glob

    return sorted(glob.glob(pattern))


def adopt_base(ctx: Ctx, base: dict[str, Any]) -> None:
    ctx.reference = base.get("outputs")
    ref = base.get("sustained_reference") or {}
    with contextlib.suppress(OSError, ValueError, TypeError):
        ctx.sustained_reference = json.loads(Path(ref["path"]).read_text()) if ref.get("path") else None
    ctx.sizes = base.get("sizes") or {}
    ctx.base_state = base.get("state")
    ready = (base.get("server") or {}).get("ready_s")
    if isinstance(ready, int | float):
        ctx.times["save"] = float(ready) + 10.0


# --- the result ----------------------------------------------------------------------------------------------------


def assemble(meta: dict[str, Any], base: dict[str, Any] | None, cases: dict[str, Any]) -> dict[str, Any]:
    out = dict(meta)
    out["base"] = base
    ordered = {c: cases[c] for c in CASES if c in cases}
    out["cases"] = ordered
    out["summary"] = {v: [c for c, r in ordered.items() if r.get("verdict") == v] for v in VERDICTS}
    out["verdicts"] = {c: r.get("verdict") for c, r in ordered.items()}
    requested = meta.get("cases_requested") or list(ordered)
    out["all_passed"] = bool(requested) and all(
        (ordered.get(c) or {}).get("verdict") == "pass" for c in requested
    )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"engine_faults {result.get('engine')} {result.get('engine_version')} on {result.get('machine')} "
        f"(commit {result.get('commit')})",
        f"  base SAVE: {'ok' if (result.get('base') or {}).get('ok') else 'NOT OK'}",
    ]
    for name, rec in (result.get("cases") or {}).items():
        extra = rec.get("reason") or rec.get("error") or ", ".join(rec.get("not_passed_checks") or [])
        lines.append(f"  {name}: {rec.get('verdict')} ({rec.get('seconds', 0)} s) {extra}".rstrip())
    return lines


def resumed(out_path: Path, meta: dict[str, Any], opts: argparse.Namespace) -> tuple[dict | None, dict, dict]:
    """The earlier call's base, its cases this call does not run, and those it runs again."""
    try:
        earlier = json.loads(out_path.read_text())
    except FileNotFoundError:
        return None, {}, {}
    same = {k: earlier.get(k) == meta[k] for k in ("engine", "commit")}
    same["workdir"] = opts.workdir is not None and earlier.get("workdir") == str(Path(opts.workdir).resolve())
    if not all(same.values()):
        raise SystemExit(f"--resume: {out_path} is another benchmark's result ({same})")
    kept = {c: r for c, r in (earlier.get("cases") or {}).items() if c not in opts.cases}
    meta["resumed_from"] = {k: earlier.get(k) for k in ("date", "command", "elapsed_s")}
    again = {c: r for c, r in (earlier.get("cases") or {}).items() if c in opts.cases}
    return earlier.get("base"), kept, again


def write_result(path: Path, data: dict[str, Any]) -> None:
    """Atomic, and tolerant of a case thread changing a record while it is serialised (--parallel)."""
    for _ in range(20):
        try:
            text = cs.results_text(data)
            break
        except RuntimeError:  # "dictionary changed size during iteration"
            time.sleep(0.05)
    else:
        return  # the next flush writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def setup_namespace(opts: argparse.Namespace) -> argparse.Namespace:
    """The options engine_run.setup reads."""
    return argparse.Namespace(
        workdir=opts.workdir,
        logs=opts.logs,
        model_config=opts.model_config,
        weights=opts.weights,
        seed=opts.seed,
        region_size=opts.region_size,
        engine=opts.engine,
        out=opts.out,
        keep_global_caches=True,
        profile=False,
        max_tokens=opts.max_tokens,
        sampling=False,
    )


# --- the table across engines (issue 19) ----------------------------------------------------------------------
#
# ``python benchmarks/engine_faults.py table --out TABLE.json RESULT.json [RESULT.json ...]`` reads the
# results of earlier calls (one or more per engine) and writes one row per case and engine: the case's
# verdict and three answers derived from its checks. Nothing is measured here, and nothing is filled in:
# a case or an engine without a result is a row "not run" with its fields null.
#
# Several results of one engine (calls on different machines, each running some of the cases) are
# combined per case: the row comes from the newest result (by its ``date``) in which the case ran (a
# verdict of RUN_VERDICTS), whatever that verdict is, so a newer fail replaces an older pass. A result
# that only mentions the case (skipped for the budget, requested but not reached) never hides an older
# one that ran it; without any run, the row comes from the newest result that mentions the case, else
# from the newest result of the engine (``not run``, with its reason).

TABLE_OUTCOMES = (*VERDICTS, "not run")
#: The verdicts of a case that ran: a row takes the newest of these over any skip.
RUN_VERDICTS = ("pass", "fail", "inconclusive", "error")
#: The cases whose strict start (mode save or load) must refuse: its check prefix.
STRICT_PREFIX = {"disk_full": "save_", "read_only_dir": "save_", "damaged_cache": "load_"}


def _all3(values: Any) -> bool | None:
    """Three-valued AND: False if any is False; True if all are True; None otherwise (or if empty)."""
    vals = list(values)
    if not vals or any(v is False for v in vals):
        return False if vals else None
    return True if all(v is True for v in vals) else None


def _any3(values: Any) -> bool | None:
    """Three-valued OR of booleans: True if any is True, False if all are False, None if none is known."""
    known = [v for v in values if isinstance(v, bool)]
    if any(known):
        return True
    return False if known else None


def _served(rec: dict[str, Any] | None) -> bool | None:
    """A server record: ready and every request answered (None: ready but never asked)."""
    if not rec:
        return None
    if rec.get("ready_s") is None:
        return False
    requests = rec.get("requests") or []
    return all("error" not in r for r in requests) if requests else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def derive_row(case: str, rec: dict[str, Any]) -> dict[str, Any]:
    """From one case's record (a verdict other than skipped): ``partial_archive_loadable`` (a record
    offered beside an archive that does not verify, or a restart that LOADed an incomplete one),
    ``served_after`` (the servers that a stock engine would have kept serving did serve),
    ``outputs_identical`` (their answers equal the base SAVE's), ``strict_mode_refused`` (the start in
    mode save / load refused as it must) and notes where a field does not apply."""
    checks = rec.get("checks") or {}
    details = rec.get("details") or {}
    servers = rec.get("servers") or {}
    notes: list[str] = []
    partial = served = identical = None
    if case == "kill_during_save":
        flags = [
            not v
            for k, v in checks.items()
            if k.startswith("no_loadable_partial_after_") and _bool(v) is not None
        ]
        for kill in details.get("kills") or []:
            state = kill.get("state_after")
            if kill.get("restart_mode") == "load" and isinstance(state, dict) and not state.get("complete"):
                flags.append(True)  # a restart LOADed what was not complete when the kill came
                notes.append(
                    f"the restart after the kill at {kill.get('point')} LOADed an incomplete archive"
                )
        if not flags:
            notes.append("no archive state after a kill (no kill reached its point)")
        flags.append(_bool((details.get("state_after_restart") or {}).get("loadable_partial")))
        partial = _any3(flags)
        served = _bool(checks.get("restart_served"))
        identical = _bool(checks.get("restart_outputs_equal_reference"))
        points = [
            str(k.get("point")) + (" (earlier call)" if k.get("call") == "earlier" else "")
            for k in details.get("kills") or []
        ]
        notes.append(f"kill points: {', '.join(points) or 'none'}")
    elif case in ("disk_full", "read_only_dir"):
        if case == "disk_full":
            left_none = [checks.get("auto_left_no_archive"), checks.get("save_left_no_archive")]
            if all(v is True for v in left_none):
                partial = False
            else:
                states = [details.get("state_auto"), details.get("state_save")]
                partial = _any3(s.get("loadable_partial") for s in states if isinstance(s, dict))
                if any(v is False for v in left_none):
                    notes.append("something of an archive was left: partial_archive_loadable from its state")
        else:
            wrote = [checks.get(f"{label}_wrote_nothing") for label in ("auto", "save")]
            if all(v is True for v in wrote):
                partial = False
            elif any(v is False for v in wrote):
                notes.append(
                    "something was written into the read-only directory; whether it loads was not checked"
                )
            else:
                methods = {k: v.get("method") for k, v in (details.get("dirs") or {}).items()}
                notes.append(f"no check of what the directory holds afterwards (made read-only by {methods})")
        served = _bool(checks.get("auto_served"))
        identical = _bool(checks.get("auto_outputs_equal_reference"))
        notes.append("served_after, outputs_identical: the auto server; the save-mode server must refuse")
    elif case == "two_replicas":
        if checks.get("archive_consistent") is True:
            partial = False
        else:
            partial = _bool((details.get("state") or {}).get("loadable_partial"))
        served = _bool(checks.get("both_ready"))
        identical = _bool(checks.get("both_outputs_equal_reference"))
    elif case == "archive_replaced":
        partial = _any3(
            (details.get(k) or {}).get("loadable_partial") for k in ("state_before", "state_after")
        )
        served = _all3(_served(servers.get(label)) for label in ("load", "save", "next"))
        identical = _all3(
            [
                _bool(checks.get("load_outputs_equal_reference_throughout")),
                requests_equal(servers.get("save") or {}),
                _bool(checks.get("next_outputs_equal_reference")),
            ]
        )
        notes.append(
            "served_after, outputs_identical: the LOAD server held throughout, the SAVE that replaced its "
            "archive and the next start (the SAVE's answers are not one of the case's checks)"
        )
    elif case == "damaged_cache":
        notes.append(
            "partial_archive_loadable: does not apply (a complete archive with one byte of its carried "
            "caches flipped; strict_mode_refused says whether load mode refused it)"
        )
        served = _bool(checks.get("auto_served"))
        identical = _bool(checks.get("auto_outputs_equal_reference"))
    elif case == "sustained_load":
        notes.append("partial_archive_loadable: does not apply (no fault on the archive)")
        served = False if checks.get("served") is False else _bool(checks.get("no_request_errors"))
        identical = _bool(checks.get("outputs_equal_reference"))
        if "outputs_equal_stock" in checks:  # results from before the stock server have no such check
            identical = _all3([identical, checks["outputs_equal_stock"]])
        else:
            notes.append("outputs_identical: against the base SAVE server's answers (no stock server then)")
        if details.get("reference") == "stock server":
            notes.append("outputs_identical: every LOAD pass against the stock server's (no base reference)")
    strict = None
    if case in STRICT_PREFIX:
        prefix = STRICT_PREFIX[case]
        strict = _all3(checks.get(f"{prefix}{k}") for k in ("never_ready", "exited_nonzero", "line"))
    return {
        "partial_archive_loadable": partial,
        "served_after": served,
        "outputs_identical": identical,
        "strict_mode_refused": strict,
        "notes": notes,
    }


def _sustained_fields(rec: dict[str, Any] | None) -> dict[str, Any]:
    """sustained_load's numbers (null where the case has none)."""
    d = (rec or {}).get("details") or {}
    return {
        "requests": d.get("requests"),
        "duration_s": d.get("seconds"),
        "mismatches": d.get("mismatches"),
        "stock_mismatches": ((d.get("stock") or {}).get("vs_load") or {}).get("mismatches"),
        "request_errors": d.get("errors"),
        "device_memory_growth_mib": d.get("memory_growth_mib"),
        "device_memory_measure": {
            "server_mib": "the server's processes (nvidia-smi)",
            "device_mib": "the whole device",
        }.get(d.get("memory_key"), d.get("memory_key")),
        "memory_growth_under_256_mib": ((rec or {}).get("checks") or {}).get("memory_growth_under_256_mib"),
    }


def table_row(case: str, engine: str, result: dict[str, Any] | None, source: str | None) -> dict[str, Any]:
    """One (case, engine) row of the table from one result of that engine (None: no result); ``commit``
    and ``date`` are that result's."""
    row: dict[str, Any] = {
        "case": case,
        "engine": engine,
        "outcome": "not run",
        "reason": None,
        "partial_archive_loadable": None,
        "served_after": None,
        "outputs_identical": None,
        "strict_mode_refused": None,
        "seconds": None,
        "checks_not_passed": None,
        "notes": [],
        "source": source,
        "commit": (result or {}).get("commit"),
        "date": (result or {}).get("date"),
        "call": None,
    }
    rec = ((result or {}).get("cases") or {}).get(case)
    if result is None:
        row["reason"] = f"no result for {engine}"
    elif rec is None:
        requested = result.get("cases_requested") or []
        if case in requested:
            row["reason"] = "requested, but the call ended before the case started"
        elif case not in DEFAULT_CASES:
            row["reason"] = f"not requested ({case} runs only when --cases names it)"
        else:
            row["reason"] = "not requested"
    elif rec.get("verdict") not in VERDICTS:
        row["reason"] = "started, but the call ended before the case did (no verdict)"
    else:
        row["outcome"] = rec["verdict"]
        row["seconds"] = rec.get("seconds")
        ran = (result.get("options") or {}).get("cases")
        if result.get("resumed_from") and isinstance(ran, list):
            row["call"] = "last" if case in ran else "earlier"  # resumed_from names the earlier call
        elif result.get("command"):
            row["call"] = "last"
        if rec["verdict"] == "skipped":
            row["reason"] = rec.get("reason")
        else:
            if rec["verdict"] == "error":
                row["reason"] = rec.get("error")
            row.update(derive_row(case, rec))
            row["checks_not_passed"] = rec.get("not_passed_checks")
    if case == "sustained_load":
        row.update(_sustained_fields(rec if row["outcome"] not in ("not run", "skipped") else None))
    row["notes"] = "; ".join(row["notes"]) or None
    return row


def _one(values: list[tuple[str, Any]]) -> Any:
    """One value if every source's (``(engine, value)`` pairs) is the same, else "engine: value; ..."
    in their order, each pair once (None without any)."""
    known = list(dict.fromkeys((e, v) for e, v in values if v is not None))
    if not known:
        return None
    if len({str(v) for _, v in known}) == 1:
        return known[0][1]
    return "; ".join(f"{e}: {v}" for e, v in known)


def _source_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def _date_key(result: dict[str, Any]) -> datetime.datetime:
    """A result's ``date`` for ordering (an unreadable or missing one sorts first, as the oldest)."""
    oldest = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    try:
        when = datetime.datetime.fromisoformat(str(result.get("date")))
    except ValueError:
        return oldest
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def newest_first(results: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """One engine's ``(file, result)`` pairs, newest ``date`` first (equal dates: the later given first)."""
    order = sorted(range(len(results)), key=lambda i: (_date_key(results[i][1]), i), reverse=True)
    return [results[i] for i in order]


def _mentions(result: dict[str, Any], case: str) -> bool:
    return case in (result.get("cases") or {}) or case in (result.get("cases_requested") or [])


def row_source(case: str, results: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]] | None:
    """Of one engine's results (newest first), the one a case's row comes from: the newest in which the
    case ran (a verdict of RUN_VERDICTS, whatever it is), else the newest that mentions it (skipped,
    requested, started), else the newest (None without any)."""
    for path, r in results:
        if ((r.get("cases") or {}).get(case) or {}).get("verdict") in RUN_VERDICTS:
            return path, r
    for path, r in results:
        if _mentions(r, case):
            return path, r
    return results[0] if results else None


def source_entry(path: str, r: dict[str, Any]) -> dict[str, Any]:
    """What the table keeps of one result (``sources``)."""
    earlier = r.get("resumed_from") or None
    return {
        "file": path,
        "date": r.get("date"),
        "commit": r.get("commit"),
        "machine": r.get("machine"),
        "engine_version": r.get("engine_version"),
        "command": r.get("command"),
        "resumed_from": earlier,
        "commands": [c for c in [(earlier or {}).get("command"), r.get("command")] if c],
        "cases_requested": r.get("cases_requested"),
        "base_ok": (r.get("base") or {}).get("ok"),
        "all_passed": r.get("all_passed"),
        "error": (r.get("error") or "").split("\n")[0] or None,
    }


def build_table(results: dict[str, list[tuple[str, dict[str, Any]]]], command: str) -> dict[str, Any]:
    """The table from ``{engine: [(file, result), ...]}``: every case of CASES for every engine of
    ENGINES, each row from the result ``row_source`` picks among its engine's; ``sources`` lists each
    engine's results, oldest first."""
    ordered = {e: newest_first(list(results.get(e) or [])) for e in ENGINES}
    sources = {e: [source_entry(path, r) for path, r in reversed(ordered[e])] for e in ENGINES}
    rows = []
    for case in CASES:
        for engine in ENGINES:
            path, r = row_source(case, ordered[engine]) or (None, None)
            rows.append(table_row(case, engine, r, path))
    counts = {o: sum(1 for r in rows if r["outcome"] == o) for o in TABLE_OUTCOMES}
    every = [(e, s) for e in ENGINES for s in sources[e]]
    return {
        "date": _one([(e, s["date"]) for e, s in every]),
        "commit": _one([(e, s["commit"]) for e, s in every]),
        "machine": _one([(e, s["machine"]) for e, s in every]),
        "command": command,
        "about": (
            "date, commit, machine: of the GPU calls behind the rows (per engine and result in sources, "
            "per row its source's commit and date: of several results of one engine, a row comes from the "
            "newest in which its case ran); command and built: this table's build, which reads those "
            "results and measures nothing"
        ),
        "built": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": cs.commit(),
        },
        "sources": sources,
        "cases": list(CASES),
        "engines": list(ENGINES),
        "rows": rows,
        "counts": counts,
        "not_passed": [f"{r['engine']}/{r['case']}: {r['outcome']}" for r in rows if r["outcome"] != "pass"],
        "partial_archive_loadable_anywhere": any(r["partial_archive_loadable"] is True for r in rows),
        "all_required_rows_passed": all(r["outcome"] == "pass" for r in rows),
    }


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "-"}[value]
    return str(value)


def table_markdown(table: dict[str, Any]) -> list[str]:
    lines = [
        "| case | engine | outcome | partial archive loadable | served after | outputs identical | s | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        fields = ("partial_archive_loadable", "served_after", "outputs_identical", "seconds", "commit")
        lines.append(
            f"| {r['case']} | {r['engine']} | {r['outcome']} | "
            + " | ".join(_cell(r[f]) for f in fields)
            + " |"
        )
    return lines


def table_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="engine_faults.py table",
        description="One row per case and engine from engine_faults results (one or more per engine; per "
        "case the newest result that ran it); measures nothing.",
    )
    p.add_argument("--out", required=True, help="the table's JSON")
    p.add_argument(
        "results",
        nargs="+",
        help="engine_faults results (--out of earlier calls), one or more per engine (the table itself, "
        "if a glob matches it, is left out)",
    )
    opts = p.parse_args(argv)
    results: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    out_path = Path(opts.out).resolve()
    for name in opts.results:
        path = Path(name)
        if path.resolve() == out_path:
            continue  # a glob that also matched the table itself
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            p.error(f"{name}: {e}")
        if (
            not isinstance(data, dict)
            or data.get("engine") not in ENGINES
            or not isinstance(data.get("cases"), dict)
        ):
            p.error(f"{name} is not an engine_faults result (no engine of {ENGINES} and cases)")
        engine = data["engine"]
        for first, r in results.get(engine, []):
            if (r.get("date"), r.get("commit")) == (data.get("date"), data.get("commit")):
                p.error(
                    f"{name}: the same {engine} result as {first} (date {data.get('date')}, commit "
                    f"{data.get('commit')}): a file given twice?"
                )
        results.setdefault(engine, []).append((_source_path(path), data))
    command = shlex.join(["benchmarks/engine_faults.py", "table", *argv])
    table = build_table(results, command)
    write_result(out_path, table)
    print("\n".join(table_markdown(table)))
    n = sum(map(len, results.values()))
    print(
        f"{len(table['rows'])} rows from {n} result{'s' * (n != 1)}, "
        f"{table['counts']['pass']} passed; all required rows passed: "
        f"{table['all_required_rows_passed']}; written to {opts.out}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["table"]:
        return table_main(args[1:])
    opts = parse_args(argv)
    started = time.monotonic()
    out_path = Path(opts.out).resolve()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": cs.commit(),
        "machine": cs.machine(),
        "command": " ".join(sys.argv if argv is None else [sys.argv[0], *argv]),
        "engine": opts.engine,
        "engine_version": cs.engine_version(opts.engine),
        "python": sys.version.split()[0],
        "root": os.geteuid() == 0,
        "cases_requested": opts.cases,
        "options": {k: v for k, v in vars(opts).items() if k not in ("out", "logs")},
        "prompts": cs.PROMPTS,
        "max_tokens": opts.max_tokens,
    }
    base: dict[str, Any] | None = None
    cases: dict[str, Any] = {}
    again: dict[str, Any] = {}
    if opts.resume:
        base, cases, again = resumed(out_path, meta, opts)
        meta["cases_requested"] = [c for c in CASES if c in opts.cases or c in cases]
    write_lock = threading.Lock()

    def flush() -> dict[str, Any]:
        with write_lock:
            meta["elapsed_s"] = round(time.monotonic() - started, 1)
            result = assemble(meta, base, cases)
            write_result(out_path, result)
            return result

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    ctx: Ctx | None = None
    try:
        bench = cs.setup(setup_namespace(opts), meta)
        workdir = bench.workdir
        config = json.loads((bench.model_dir / "config.json").read_text())
        kv_tokens, kv_bytes = kv_sizes(config, opts.kv_cache_gib)
        ctx = Ctx(
            opts=opts,
            bench=bench,
            engine=opts.engine,
            logs=bench.logs,
            workdir=workdir,
            home=workdir / "home",
            tmp=workdir / "tmp",
            started=started,
            base_toml=workdir / "base" / "foundry.toml",
            kv_tokens=kv_tokens,
            kv_bytes=kv_bytes,
            earlier_cases=again,
        )
        for d in (ctx.home, ctx.tmp):
            d.mkdir(parents=True, exist_ok=True)
        meta["kv_cache"] = {"sglang_max_total_tokens": kv_tokens, "vllm_kv_cache_memory_bytes": kv_bytes}
        flush()
        need = ctx.times["save"] + MARGIN_S
        if base and base.get("ok") and archive_state(ctx.pristine, ctx.engine).get("complete"):
            base["reused"] = True
        elif ctx.left() < need:
            base = {
                "ok": False,
                "skipped": f"needs about {need:.0f} s, {ctx.left():.0f} s of the budget left",
            }
        else:
            print(f"[engine_faults] {opts.engine} base SAVE: starting", flush=True)
            base = run_base(ctx)
        adopt_base(ctx, base)
        if base.get("ok") and "sustained_load" in opts.cases and not ctx.sustained_reference:
            why = "the reused base's call did not list it" if base.get("reused") else "none kept by the base"
            print(
                f"[engine_faults] {opts.engine} sustained_load: no base answers to its schedule ({why}): "
                "the stock server's answers are the reference",
                flush=True,
            )
        flush()
        base_ok = bool(base.get("ok"))
        serial = [c for c in opts.cases if c in STAGED or opts.parallel == 1]
        others = [c for c in opts.cases if c not in serial]
        if others:
            with concurrent.futures.ThreadPoolExecutor(max_workers=opts.parallel) as pool:
                futures = [pool.submit(run_case, ctx, c, base_ok, cases, flush) for c in others]
                if serial:
                    futures.append(
                        pool.submit(lambda: [run_case(ctx, c, base_ok, cases, flush) for c in serial])
                    )
                pending = set(futures)
                try:
                    while pending:  # short waits: the main thread must see SIGTERM
                        _done, pending = concurrent.futures.wait(pending, timeout=1.0)
                except BaseException:
                    ctx.shutdown()  # before the pool waits for its threads, which wait for servers
                    raise
                for f in futures:
                    f.result()
        else:
            for c in serial:
                run_case(ctx, c, base_ok, cases, flush)
    except BaseException as e:  # the result is written whatever happens
        meta["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        if ctx is not None:
            ctx.shutdown()
    result = flush()
    print("\n".join(summary_lines(result)), flush=True)
    return 0 if result["all_passed"] and "error" not in meta else 1


if __name__ == "__main__":
    sys.exit(main())
