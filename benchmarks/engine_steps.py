"""Decode steps of a real engine, timed the same way in stock, SAVE and LOAD runs (SGLang and vLLM).

Two halves, one file (standard library only at import):

* In the engine's processes (a general plugin, ``foundry_bench_steps``, that the benchmarks put on the
  runs' ``PYTHONPATH`` with an entry point for ``sglang.srt.plugins`` and ``vllm.general_plugins``):
  every decode-graph replay is timed where the graph itself is replayed, ``torch.cuda.CUDAGraph.replay``
  (what stock and SAVE replay) and ``foundry_core.api.RestoredGraph.replay`` (what LOAD replays).
  Host time: the replay call on the CPU (``time.monotonic``). Device time: between CUDA events
  recorded on the current stream just before and just after it (it includes any wait of an idle GPU
  for the launch). Events are read back without waiting; each finished step is appended to
  ``$FOUNDRY_BENCH_STEPS_DIR/steps-<pid>.tsv`` as ``start<TAB>graph<TAB>host_us<TAB>device_us``
  (``start``: ``time.monotonic()``, one clock for every process of the machine), the file being
  flushed at most every :data:`FLUSH_S` seconds, from the replay path. With the variable unset the
  plugin does nothing. The patch is installed when the module is imported (``torch.cuda.graphs`` is,
  ``foundry_core.api`` only in Foundry runs), so a stock run imports nothing of Foundry.
* In the benchmark's run process: :func:`measure_decode` times repeated long generates and cuts each
  engine's step records into the same repetitions (by their start times); :func:`summarize` gives a
  median and the relative spread ``(max - min) / median`` of any per-repetition measure.

``python benchmarks/engine_steps.py --selftest`` exercises the engine half on whatever GPU there is.
"""

from __future__ import annotations

import collections
import functools
import importlib.abc
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ENV_DIR = "FOUNDRY_BENCH_STEPS_DIR"
#: The plugin's name (entry point) and module name in the engine processes.
PLUGIN_NAME = "foundry_bench_steps"
MODULE_NAME = "foundry_bench_steps"
DIST = "foundry_bench_steps-0.0.0"
GROUPS = ("sglang.srt.plugins", "vllm.general_plugins")
FLUSH_S = 0.2  # the engine's step file is flushed at most this often (from a replay)
MAX_STEPS = 2_000_000  # per process; after that replays run untimed
#: Graph classes timed, by the module that defines them: (class, how a graph is named).
TARGETS = {
    "torch.cuda.graphs": ("CUDAGraph", "id"),
    "foundry_core.api": ("RestoredGraph", "name"),
}


def foundry_toml(archive_dir: str | os.PathLike, region_size: str, check_structure: bool = False) -> str:
    """The engine benchmarks' Foundry configuration; ``check_structure``: LOAD reads its graphs back
    and compares them with the archive ([load] check_structure; its time counts in LOAD's ready
    time)."""
    load = "\n[load]\ncheck_structure = true\n" if check_structure else ""
    return f'mode = "auto"\narchive_dir = "{archive_dir}"\n\n[region]\nsize = "{region_size}"\n{load}'


def cpu_list(text: str) -> set[int]:
    """``2-9`` or ``2,4,6-8``: the cores a benchmark pins its runs to (``--cpus``)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"no cores in {text!r}")
    return cpus


def pin(cpus: Iterable[int] | None) -> list[int] | None:
    """Pin this process, and every process it starts from now on (an engine's schedulers and
    workers inherit it), to ``cpus``; the cores it runs on after that, or None when not pinned.
    The decode loops measured here run on the host between replays: unpinned, the scheduler moves
    them between cores and their time per step varies between repetitions."""
    if not cpus:
        return None
    os.sched_setaffinity(0, set(cpus))
    return sorted(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------------------------
# Engine side


class StepTimer:
    """Host and device time of every timed replay, written to one file per process."""

    def __init__(self, directory: str | os.PathLike, limit: int = MAX_STEPS) -> None:
        self.directory = str(directory)
        self.limit = limit
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.count = 0
        self.disabled: str | None = None
        self._pending: collections.deque = collections.deque()
        self._free: list = []
        self._buf: list[str] = []  # lines not written yet (a forked child drops its parent's)
        self._fd: int | None = None
        self._last_flush = time.monotonic()

    def replay(
        self, orig: Callable, graph: Any, name: Callable[[Any], str], args: tuple, kwargs: dict
    ) -> Any:
        if self.pid != os.getpid():  # a forked child: nothing of the parent's events or file
            self._reset()
        if self.disabled is not None or self.count >= self.limit or _capturing():
            return orig(graph, *args, **kwargs)
        try:
            begin, end = self._free.pop() if self._free else self._new_pair()
            begin.record()
        except Exception as e:  # never let timing break serving
            self.disabled = f"{type(e).__name__}: {e}"
            return orig(graph, *args, **kwargs)
        t0 = time.monotonic()
        out = orig(graph, *args, **kwargs)
        host = time.monotonic() - t0
        end.record()
        self.count += 1
        self._pending.append((t0, name(graph), host, begin, end))
        self._drain(t0)
        return out

    @staticmethod
    def _new_pair() -> tuple[Any, Any]:
        import torch

        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _drain(self, now: float, wait: bool = False) -> None:
        pending = self._pending
        while pending:
            t0, name, host, begin, end = pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                break
            pending.popleft()
            self._buf.append(f"{t0:.6f}\t{name}\t{host * 1e6:.2f}\t{begin.elapsed_time(end) * 1e3:.2f}\n")
            self._free.append((begin, end))
        if self._buf and (wait or now - self._last_flush >= FLUSH_S):
            self.flush()
            self._last_flush = now

    def flush(self) -> None:
        """Append the finished steps to this process's file (complete lines only)."""
        if self._fd is None:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"steps-{self.pid}.tsv")
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        data = "".join(self._buf).encode()
        self._buf.clear()
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        """Wait for the events still pending and flush (at process exit)."""
        if self.pid != os.getpid():
            return
        try:
            self._drain(time.monotonic(), wait=True)
        except Exception:
            pass


def _capturing() -> bool:
    """Whether the current stream is capturing a graph (no events are recorded into a capture)."""
    torch = sys.modules.get("torch")
    check = getattr(getattr(torch, "_C", None), "_cuda_isCurrentStreamCapturing", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # no CUDA in this process
        return False


def _graph_name(how: str) -> Callable[[Any], str]:
    if how == "name":
        return lambda graph: str(getattr(graph, "name", None) or f"g{id(graph):x}")
    return lambda graph: f"g{id(graph):x}"


def wrap_replay(cls: type, timer: StepTimer, how: str) -> bool:
    """Time ``cls.replay`` (subclasses included: they inherit it or call it through ``super()``)."""
    orig = cls.__dict__.get("replay") or getattr(cls, "replay", None)
    if orig is None or getattr(orig, "_foundry_bench_steps", False):
        return False
    name = _graph_name(how)

    @functools.wraps(orig)
    def replay(self, *args, **kwargs):
        out = timer.replay(orig, self, name, args, kwargs)
        _time_own_path(self, timer, name)
        return out

    replay._foundry_bench_steps = True  # type: ignore[attr-defined]
    cls.replay = replay
    return True


def _time_own_path(graph: Any, timer: StepTimer, name: Callable[[Any], str]) -> None:
    """A graph that put a replay of its own on the instance, over the class's method (Foundry's
    restored graphs do at their first replay: a closure over their executable), would replay
    untimed from then on, the class's wrapper never reached again: time that path too. It costs one
    call frame more than the class's wrapper does."""
    own = getattr(graph, "__dict__", {}).get("replay")
    if own is None or getattr(own, "_foundry_bench_steps", False):
        return

    def call(_graph, *args, **kwargs):
        return own(*args, **kwargs)

    def replay(*args, **kwargs):
        return timer.replay(call, graph, name, args, kwargs)

    replay._foundry_bench_steps = True  # type: ignore[attr-defined]
    graph.__dict__["replay"] = replay


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_data, ... of the real loader
        return getattr(self._loader, name)


class _WhenImported(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.patches: dict[str, Callable[[Any], None]] = {}

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.pop(fullname, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_HOOK = _WhenImported()


def when_imported(module: str, patch: Callable[[Any], None]) -> None:
    """``patch(module)`` now if it is imported, else right after its first import."""
    if module in sys.modules:
        patch(sys.modules[module])
        return
    _HOOK.patches[module] = patch
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


_TIMER: list[StepTimer] = []


def install(directory: str | os.PathLike) -> StepTimer:
    """Time every replay of the classes in :data:`TARGETS` in this process (once)."""
    if _TIMER:
        return _TIMER[0]
    timer = StepTimer(directory)
    _TIMER.append(timer)
    print(f"[{PLUGIN_NAME}] pid {os.getpid()}: timing decode-graph replays into {directory}", file=sys.stderr)
    for module, (cls_name, how) in TARGETS.items():
        when_imported(module, lambda m, c=cls_name, h=how: wrap_replay(getattr(m, c), timer, h))
    import atexit

    atexit.register(timer.close)
    return timer


def register() -> None:
    """The entry point of both engines' general-plugin groups: on only when ``ENV_DIR`` is set."""
    directory = os.environ.get(ENV_DIR)
    if directory:
        install(directory)


# ---------------------------------------------------------------------------------------------------
# Benchmark side: the plugin's files, step records, repetitions


def write_plugin(root: Path) -> Path:
    """A folder for the runs' ``PYTHONPATH``: this file as module :data:`MODULE_NAME` and a minimal
    ``.dist-info`` whose entry points make SGLang and vLLM load it as a general plugin."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).resolve(), root / f"{MODULE_NAME}.py")
    info = root / f"{DIST}.dist-info"
    info.mkdir(exist_ok=True)
    name, version = DIST.rsplit("-", 1)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n{PLUGIN_NAME} = {MODULE_NAME}:register\n\n" for group in GROUPS)
    )
    return root


def read_steps(directory: str | os.PathLike | None) -> list[tuple[float, str, float, float]]:
    """Every complete record of every process's step file, by start time."""
    records = []
    root = Path(directory) if directory else None
    for path in sorted(root.glob("steps-*.tsv")) if root and root.is_dir() else []:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split("\t")
            if len(parts) != 4:
                continue
            try:
                records.append((float(parts[0]), parts[1], float(parts[2]), float(parts[3])))
            except ValueError:
                continue
    records.sort()
    return records


def window_stats(
    records: Iterable[tuple[float, str, float, float]], start: float, end: float
) -> dict[str, Any]:
    """The replays that started in ``[start, end)``: how many, which graph most of them replayed
    (the decode batch of the window), and that graph's median host and device time."""
    inside = [r for r in records if start <= r[0] < end]
    if not inside:
        return {"steps": 0, "graph": None, "graphs": 0, "host_us": None, "device_us": None}
    counts = collections.Counter(r[1] for r in inside)
    graph, n = counts.most_common(1)[0]
    mine = [r for r in inside if r[1] == graph]
    return {
        "steps": len(inside),
        "graph": graph,
        "graph_steps": n,
        "graphs": len(counts),
        "host_us": round(statistics.median(r[2] for r in mine), 2),
        "device_us": round(statistics.median(r[3] for r in mine), 2),
        "device_us_p90": round(_quantile([r[3] for r in mine], 0.9), 2),
    }


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def spread(values: Iterable[Any]) -> float | None:
    """``(max - min) / median`` of the numbers given (None entries are dropped); None for fewer
    than two numbers or a median of 0."""
    xs = [float(v) for v in values if v is not None]
    if len(xs) < 2:
        return None
    med = statistics.median(xs)
    return round((max(xs) - min(xs)) / med, 4) if med else None


def median_ci95(values: Iterable[Any]) -> list[float] | None:
    """A distribution-free 95 % confidence interval of the median: the ``k``-th smallest and ``k``-th
    largest value, ``k`` the largest rank with ``P(Binomial(n, 1/2) < k) <= 2.5 %``. None for fewer
    than 6 values (no pair of ranks reaches 95 % then). Rounds of a paired run are this kind of
    sample: a few rounds caught in a slow period of the host move the interval far less than they
    move the range."""
    xs = sorted(float(v) for v in values if v is not None)
    n = len(xs)
    k, below = 0, 0.0  # below: P(B <= k - 1), B ~ Binomial(n, 1/2)
    while True:
        nxt = below + math.comb(n, k) / 2**n
        if nxt > 0.025:
            break
        k, below = k + 1, nxt
    return [xs[k - 1], xs[n - k]] if k >= 1 else None


def summarize(values: Iterable[Any], digits: int = 2) -> dict[str, Any]:
    """Median, spread, min, max and count of per-repetition values (None entries are dropped)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "spread": None, "min": None, "max": None, "n": 0}
    return {
        "median": round(statistics.median(xs), digits),
        "spread": spread(xs),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
        "n": len(xs),
    }


def decode_prompts(n: int, vocab: int = 32000) -> list[list[int]]:
    """``n`` fixed token-id prompts of 8 to 39 tokens (ids below ``vocab``)."""
    top = max(8, vocab - 3)
    return [[3 + (7 * i + 13 * j) % top for j in range(8 + (5 * i) % 32)] for i in range(n)]


def measure_decode(
    generate: Callable[[list[list[int]], int], list[list[int]]],
    prompts: list[list[int]],
    tokens: int,
    reps: int,
    steps_dir: str | os.PathLike | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    mono: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    gate: PairGate | None = None,
) -> dict[str, Any]:
    """Decode tokens per second and per-step replay times over ``reps`` generates of ``tokens + 1``
    tokens for every prompt (greedy, no EOS stop), after one warm-up generate of that length.

    ``generate(prompts, n)`` returns the output token ids per prompt. A repetition's tokens per second:
    its decoded tokens (all but each prompt's first) over its time minus the median time of 1-token
    generates of the same prompts (prefill and request overhead). With ``steps_dir`` (the engine's
    :data:`ENV_DIR`), each repetition's replays are read back from the engine's step files by start
    time; the medians of the graph most replayed in it are that repetition's host and device time.
    Repetitions stop early (at least two are kept) when the next would end past ``deadline`` (epoch
    seconds). ``decode_stats`` holds median and spread across repetitions of each measure.

    ``gate`` (paired runs, :class:`PairGate`): each repetition waits for the gate to open it and
    reports back when done, so that a parent alternates this engine's repetitions with another's;
    the gate, not ``deadline``, then says when to stop."""

    def timed(n: int, batch: list[list[int]] = prompts) -> dict[str, Any]:
        m0, t0 = mono(), clock()
        outs = generate(batch, n)
        t1, m1 = clock(), mono()
        return {"s": t1 - t0, "tokens": sum(len(o) for o in outs), "window": (m0, m1)}

    warm = timed(tokens + 1)
    short = [timed(1) for _ in range(min(3, max(1, reps)))]
    t_short = statistics.median(s["s"] for s in short)
    n_short = statistics.median(s["tokens"] for s in short)
    longs: list[dict[str, Any]] = []
    # Paired runs: each round also times a 1-token generate just before its long one, in the same
    # host state: the round's own baseline, and a first-token comparison with an interval (the
    # three baselines above, taken once per process, made LOAD's decode-only rate 3 % high at
    # 9ae1f57 while the whole generates took the same time).
    firsts: list[dict[str, Any]] = []
    cut = False
    for i in range(reps):
        if gate is not None:
            if not gate.wait(i):
                cut = True
                break
            firsts.append(timed(1))
        elif (
            deadline is not None and len(longs) >= 2 and wall() + 1.3 * max(x["s"] for x in longs) > deadline
        ):
            cut = True
            break
        longs.append(timed(tokens + 1))
        if gate is not None:
            gate.done(i)
    bases = [f["s"] for f in firsts] if firsts else [t_short] * len(longs)
    tok_s = [(x["tokens"] - n_short) / (x["s"] - b) if x["s"] > b else None for x, b in zip(longs, bases)]
    out: dict[str, Any] = {
        "decode_prompts": len(prompts),
        "decode_tokens": statistics.median(x["tokens"] for x in longs) - n_short if longs else None,
        "warmup_s": round(warm["s"], 4),
        "timed_short_s": [round(s["s"], 4) for s in short],
        "timed_long_s": [round(x["s"], 4) for x in longs],
        "timed_round_short_s": [round(f["s"], 4) for f in firsts],
        "reps_done": len(longs),
        "reps_cut": cut,
        "decode_tok_s_reps": [round(v, 1) if v is not None else None for v in tok_s],
    }
    valid = [v for v in tok_s if v is not None]
    out["decode_tok_s"] = round(statistics.median(valid), 1) if valid else None
    windows: list[dict[str, Any]] = []
    if steps_dir is not None:
        # The engine flushes its step file from a replay at most every FLUSH_S: a pause, then a short
        # generate with a few decode steps, writes out everything up to the last repetition.
        sleep(2 * FLUSH_S)
        generate(prompts[:1], 4)
        sleep(FLUSH_S / 2)
        records = read_steps(steps_dir)
        windows = [window_stats(records, *x["window"]) for x in longs]
        out["replay_steps_total"] = len(records)
        out["replay_windows"] = windows
        out["warmup_steps"] = window_stats(records, *warm["window"])["steps"]
    out["decode_stats"] = {
        "tok_s": summarize(tok_s, 1),
        "replay_host_us": summarize(w["host_us"] for w in windows),
        "replay_device_us": summarize(w["device_us"] for w in windows),
    }
    return out


# ---------------------------------------------------------------------------------------------------
# Paired runs: stock's and LOAD's repetitions alternating in time
#
# Run one after the other, two engine runs meet the host in different states: on the H200 machine
# (2026-12-03) the host ran slower for periods of seconds, which took a run's decode from about
# 21,000 to about 16,000 tok/s and its replay call from about 16.5 to about 22 us, so the order of
# the runs decided their ratio. With both engines up, a parent opens one repetition at a time,
# alternating the order each round (stock, LOAD; LOAD, stock; ...), and compares each round's two.


class PairGate:
    """A child's side: ``wait(i)`` announces that repetition ``i`` is ready to run (``wait-<name>-<i>``)
    and blocks until the parent opens it (``go-<name>-<i>``: True) or says stop (``stop``, or
    ``timeout_s`` passed: False); ``done(i)`` reports it finished (``done-<name>-<i>``)."""

    def __init__(
        self, directory: str | os.PathLike, name: str, timeout_s: float = 600.0, poll_s: float = 0.01
    ):
        self.dir, self.name, self.timeout_s, self.poll_s = Path(directory), name, timeout_s, poll_s

    def _touch(self, what: str, i: int) -> None:
        (self.dir / f"{what}-{self.name}-{i}").touch()

    def wait(self, i: int) -> bool:
        self._touch("wait", i)
        go, stop = self.dir / f"go-{self.name}-{i}", self.dir / "stop"
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            if go.exists():
                return True
            if stop.exists():
                return False
            time.sleep(self.poll_s)
        return False

    def done(self, i: int) -> None:
        self._touch("done", i)


def run_pairs(
    directory: str | os.PathLike,
    names: tuple[str, str],
    rounds: int,
    deadline: float,
    alive: Callable[[str], bool],
    poll_s: float = 0.01,
    clock: Callable[[], float] = time.time,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """The parent's side of :class:`PairGate`: wait until both children wait at repetition 0, then
    open repetitions one at a time, ``names`` in order in even rounds and reversed in odd ones, each
    after the previous one reported done, with ``pause_s`` of idle between rounds; stop (the
    ``stop`` file) after ``rounds`` rounds, when a round would not end before ``deadline`` (epoch
    seconds; judged by the longest round so far), or when a child is gone. Returns the rounds run,
    each child's order, and why it stopped.

    Why a pause: on the H200 machine (87eda11) a decode loop ran its host side about 25 % slower
    after 14 s of uninterrupted decoding (vLLM's SAVE alone: 2.8 ms a step, then 3.9), and in a
    paired run both servers slowed at the same moment, 26 s into their alternating decode; idle
    time between rounds keeps the stretches of load short, so that the members of a round meet the
    host in one state."""
    d = Path(directory)
    out: dict[str, Any] = {"names": list(names), "rounds": 0, "order": [], "stopped": None}
    if pause_s:
        out["round_pause_s"] = pause_s

    def wait_for(path: Path, who: str) -> bool:
        while not path.exists():
            if not alive(who):
                out["stopped"] = f"{who} ended before {path.name}"
                return False
            if clock() > deadline:
                out["stopped"] = f"deadline passed waiting for {path.name}"
                return False
            time.sleep(poll_s)
        return True

    try:
        if not all(wait_for(d / f"wait-{n}-0", n) for n in names):
            return out
        longest = 0.0
        for i in range(rounds):
            if i and pause_s:
                time.sleep(pause_s)
            if i and clock() + 1.3 * longest > deadline:
                out["stopped"] = f"budget: a round takes up to {longest:.1f} s"
                return out
            t0 = clock()
            order = names if i % 2 == 0 else names[::-1]
            for n in order:
                if not wait_for(d / f"wait-{n}-{i}", n):
                    return out
                (d / f"go-{n}-{i}").touch()
                if not wait_for(d / f"done-{n}-{i}", n):
                    return out
            out["rounds"] = i + 1
            out["order"].append(list(order))
            longest = max(longest, clock() - t0)
        out["stopped"] = "all rounds run"
        return out
    finally:
        (d / "stop").touch()


def add_round_pause(parser: Any) -> None:
    """Both engine benchmarks' ``--round-pause`` (:func:`run_pairs`' ``pause_s``)."""
    parser.add_argument(
        "--round-pause",
        type=float,
        default=0.0,
        help="idle seconds between paired rounds (default 0): a decode loop's host side ran about 25 %% "
        "slower after 14 s of uninterrupted decoding on the H200 machine; pauses keep the "
        "stretches of load short",
    )


def add_save_reps(parser: Any) -> None:
    """Both engine benchmarks' ``--save-reps``: the SAVE run's timed repetitions (see :func:`reps_of`)."""
    parser.add_argument(
        "--save-reps",
        type=int,
        default=None,
        help="timed repetitions of the SAVE run (default: --reps); a paired run compares stock and "
        "LOAD over many rounds, and SAVE, which runs alone before them, needs few for its figures",
    )


def check_counts(parser: Any, opts: Any) -> None:
    """Both engine benchmarks' check of their counts (an unset one, None, is not checked)."""
    counts = (
        opts.new_tokens,
        opts.decode_tokens,
        opts.reps,
        opts.max_bs,
        opts.decode_prompts,
        opts.save_reps,
    )
    if min(c for c in counts if c is not None) < 1:
        parser.error(
            "--max-bs, --new-tokens, --decode-prompts, --decode-tokens, --reps and --save-reps must be at least 1"
        )


def reps_of(run: str, opts: Any) -> int:
    """The timed repetitions of run ``run``: ``--save-reps`` for SAVE where given, else ``--reps``."""
    save_reps = getattr(opts, "save_reps", None)
    return int(save_reps) if run == "save" and save_reps else int(opts.reps)


def run_paired(
    load: Any,
    stock: Any,
    pair_dir: Path,
    rounds: int,
    deadline: float,
    skipped: dict,
    poll_s: float = 0.2,
    pause_s: float = 0.0,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``--paired`` of both engine benchmarks: LOAD starts alone and stock only once LOAD waits at its
    first timed repetition (LOAD's engine sizes its KV cache with the GPU to itself, as SAVE's did, or
    the archive would not match); then their repetitions alternate (:func:`run_pairs`). ``load`` and
    ``stock`` are the benchmark's child handles (``start()``, ``alive()``, ``finish(timeout)``,
    ``proc``); ``skipped`` is stock's record when it never started. Returns the pairing record and
    stock's and LOAD's results. ``deadline``: epoch seconds for everything; ``pause_s``: idle
    seconds between rounds (:func:`run_pairs`)."""
    started = time.monotonic()
    load.start()
    first = pair_dir / "wait-load-0"
    while not first.exists() and load.alive() and time.time() < deadline - 60:
        time.sleep(poll_s)
    pairs: dict[str, Any] = {"stock_started_after_load_s": None}
    if first.exists():
        pairs["stock_started_after_load_s"] = round(time.monotonic() - started, 1)
        stock.start()
        # Repetitions end 30 s before the deadline: both engines must still shut down.
        pairs.update(
            run_pairs(
                pair_dir,
                ("stock", "load"),
                rounds,
                deadline - 30,
                lambda n: (stock if n == "stock" else load).alive(),
                pause_s=pause_s,
            )
        )
    else:
        (pair_dir / "stop").touch()
        pairs["stopped"] = "LOAD did not reach its first repetition"
    load_result = load.finish(max(1.0, deadline - time.time()))
    stock_result = stock.finish(max(1.0, deadline - time.time())) if stock.proc is not None else skipped
    return pairs, stock_result, load_result


def paired_stats(a: dict[str, Any] | None, b: dict[str, Any] | None, rounds: int) -> dict[str, Any]:
    """Round by round, ``b`` against ``a`` (two runs' :func:`measure_decode` results): tokens per second
    and device time per replay as ratios b / a, host time per replay as the difference b - a (us);
    each with median, its 95 % confidence interval (:func:`median_ci95`; None under 6 rounds), spread
    across rounds ((max - min) / median for the ratios) and the values.

    ``e2e_tok_s_ratio`` is the throughput ratio of the whole generates, ``a``'s wall time over
    ``b``'s (both decode the same prompts to the same length): unlike ``tok_s_ratio`` it subtracts
    no baseline. Before per-round baselines, each run's baseline was the median of three 1-token
    generates measured once, and at 87eda11 SGLang's stock had 85 ms where LOAD had 37 ms: that alone
    made LOAD 3 % slower in ``tok_s_ratio`` (0.971) while their whole generates took the same time
    (1.002). ``first_token_ratio`` compares the rounds' 1-token generates (prefill of every prompt
    and its first token) the same way as the whole generates: b's speed over a's."""

    def per_round(run: dict[str, Any] | None, key: str) -> list[Any]:
        run = run or {}
        if key == "tok_s":
            values = run.get("decode_tok_s_reps") or []
        elif key == "e2e_s":
            values = run.get("timed_long_s") or []
        elif key == "first_s":
            values = run.get("timed_round_short_s") or []
        else:
            values = [w.get(key) for w in run.get("replay_windows") or []]
        return list(values[:rounds])

    compare = {
        "ratio": lambda x, y: round(y / x, 4),
        "inverse": lambda x, y: round(x / y, 4),  # times: a's over b's is b's throughput over a's
        "diff": lambda x, y: round(y - x, 2),
    }
    out: dict[str, Any] = {"rounds": rounds}
    for key, name, how in (
        ("e2e_s", "e2e_tok_s_ratio", "inverse"),
        ("first_s", "first_token_ratio", "inverse"),
        ("tok_s", "tok_s_ratio", "ratio"),
        ("device_us", "replay_device_ratio", "ratio"),
        ("host_us", "replay_host_diff_us", "diff"),
    ):
        pairs = [(x, y) for x, y in zip(per_round(a, key), per_round(b, key)) if x and y]
        values = [compare[how](x, y) for x, y in pairs]
        out[name] = {"values": values, **round_stat(values, how != "diff")}
    return out


def round_stat(values: list[float], ratio: bool) -> dict[str, Any]:
    """Median of per-round values with its 95 % interval (:func:`median_ci95`), range and count;
    for ratios also the spread, (max - min) / median. Without values: count, None median and spread."""
    stat: dict[str, Any] = {"n": len(values), "median": None, "spread": None}
    if values:
        med = statistics.median(values)
        stat["median"] = round(med, 4)
        stat["ci95"] = median_ci95(values)
        stat["min"], stat["max"] = min(values), max(values)
        if ratio and med:
            stat["spread"] = round((max(values) - min(values)) / med, 4)
    return stat


def paired_lines(paired: dict[str, Any] | None) -> list[str]:
    """The summary's lines for a paired run (none without one)."""
    if not paired:
        return []

    def cell(stat: dict[str, Any] | None, unit: str = "") -> str:
        if not stat or stat.get("median") is None:
            return "n/a"
        ci = stat.get("ci95")
        ci_text = f"95% CI {ci[0]}..{ci[1]}{unit}, " if ci else ""
        rng = f"range {stat['min']}..{stat['max']}{unit}"
        sp = stat.get("spread")
        return (
            f"{stat['median']}{unit} ({ci_text}{rng}"
            + ("" if sp is None else f", spread {100 * sp:.1f}%")
            + ")"
        )

    return [
        f"  paired, {paired.get('rounds', 0)} rounds ({paired.get('stopped')}): LOAD/stock tok/s "
        f"end to end {cell(paired.get('e2e_tok_s_ratio'))}, decode {cell(paired.get('tok_s_ratio'))}, "
        f"1-token generate {cell(paired.get('first_token_ratio'))}, "
        f"device {cell(paired.get('replay_device_ratio'))}, "
        f"host LOAD-stock {cell(paired.get('replay_host_diff_us'), ' us')}"
    ]


# ---------------------------------------------------------------------------------------------------
# The result fields both benchmarks share (benchmarks/sglang_h200.py, benchmarks/vllm_h200.py)

RUN_NAMES = ("stock", "save", "load")
#: Per-repetition measures of :func:`measure_decode`'s ``decode_stats``.
MEASURES = ("tok_s", "replay_host_us", "replay_device_us")
#: Median per-step replay times of each run (microseconds; None where a run did not get that far).
REPLAY_FIELDS = tuple(f"replay_{m}_us_{run}" for m in ("host", "device") for run in RUN_NAMES)


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 4) if a and b else None


def decode_fields(runs: dict[str, Any], names: Iterable[str] = RUN_NAMES) -> dict[str, Any]:
    """``replay_{host,device}_us_<run>`` (medians across repetitions), ``decode_spread`` (per run:
    the spread of each measure), their LOAD ratios, and every run's ``decode_stats``."""
    names = tuple(names)
    stats = {k: (runs.get(k) or {}).get("decode_stats") or {} for k in names}
    out: dict[str, Any] = {}
    for m in ("host", "device"):
        for k in names:
            out[f"replay_{m}_us_{k}"] = (stats[k].get(f"replay_{m}_us") or {}).get("median")
        for other in ("save", "stock"):
            out[f"replay_{m}_ratio_load_vs_{other}"] = _ratio(
                out.get(f"replay_{m}_us_load"), out.get(f"replay_{m}_us_{other}")
            )
    out["decode_spread"] = {
        k: {m: (stats[k].get(m) or {}).get("spread") for m in MEASURES} if stats[k] else None for k in names
    }
    out["decode_stats"] = {k: stats[k] or None for k in names}
    return out


def replays_timed(result: dict[str, Any], names: Iterable[str] = RUN_NAMES) -> bool:
    """Whether every run has per-step replay times (the check of a run with the step timer on)."""
    stats = result.get("decode_stats") or {}
    return all(((stats.get(k) or {}).get("replay_device_us") or {}).get("median") is not None for k in names)


def describe_model(config: dict[str, Any], source: str) -> str:
    c = config
    return (
        f"{source}: {c.get('model_type')} {c.get('num_hidden_layers')} layers, hidden {c.get('hidden_size')}, "
        f"intermediate {c.get('intermediate_size')}, heads {c.get('num_attention_heads')}/"
        f"{c.get('num_key_value_heads')} x {c.get('head_dim')}, vocab {c.get('vocab_size')}, "
        f"tied embeddings {bool(c.get('tie_word_embeddings'))}"
    )


def _cell(stat: Any, digits: int) -> str:
    if not stat or stat.get("median") is None:
        return "n/a"
    sp = stat.get("spread")
    return f"{stat['median']:.{digits}f} ({'n/a' if sp is None else f'{100 * sp:.1f}%'})"


def summary_table(result: dict[str, Any], names: Iterable[str] = RUN_NAMES) -> list[str]:
    """One line per run: ready seconds, then median (spread across repetitions) of decode tokens per
    second and of the per-step host and device time of the decode-graph replay."""
    stats = result.get("decode_stats") or {}
    lines = [
        f"  {'run':<6}{'ready s':>9}  {'decode tok/s (spread)':>22}  {'replay host us':>17}  "
        f"{'replay device us':>19}  {'reps':>4}  {'steps/rep':>9}"
    ]
    for k in names:
        run = (result.get("runs") or {}).get(k) or {}
        s = stats.get(k) or {}
        windows = run.get("replay_windows") or []
        per_rep = sorted(w.get("steps", 0) for w in windows)
        ready = result.get(f"ready_s_{k}")
        lines.append(
            f"  {k:<6}{'n/a' if ready is None else f'{ready:.1f}':>9}  {_cell(s.get('tok_s'), 1):>22}  "
            f"{_cell(s.get('replay_host_us'), 2):>17}  {_cell(s.get('replay_device_us'), 2):>19}  "
            f"{run.get('reps_done', 'n/a')!s:>4}  {str(per_rep[len(per_rep) // 2]) if per_rep else 'n/a':>9}"
        )
    return lines


def foundry_lines(result: dict[str, Any]) -> list[str]:
    def f(key: str) -> str:
        v = result.get(key)
        return "n/a" if v is None else str(v)

    return [
        f"  graphs {f('graphs')}; capture {f('capture_s')} s (SAVE); restore {f('restore_s')} s, "
        f"restore_critical_s {f('restore_critical_s')} (LOAD); stream captures at LOAD {f('load_decode_captures')}",
        f"  LOAD/stock: tok/s {f('decode_ratio_load_vs_stock')}, replay host {f('replay_host_ratio_load_vs_stock')}, "
        f"device {f('replay_device_ratio_load_vs_stock')}; LOAD/SAVE: tok/s {f('decode_ratio_load_vs_save')}, "
        f"replay host {f('replay_host_ratio_load_vs_save')}, device {f('replay_device_ratio_load_vs_save')}",
    ]


# ---------------------------------------------------------------------------------------------------
# A check on a GPU: python benchmarks/engine_steps.py --selftest [DIR]


def _selftest(directory: str) -> int:
    import torch

    install(directory)
    x = torch.zeros(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(50):
            x.mul_(1.0001)
    t0 = time.monotonic()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    t1 = time.monotonic()
    _TIMER[0].close()
    stats = window_stats(read_steps(directory), t0, t1)
    print(stats)
    return 0 if stats["steps"] == 200 and stats["device_us"] and stats["device_us"] > 0 else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--selftest":
        import tempfile

        sys.exit(_selftest(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="engine-steps-")))
    print(__doc__)
