"""benchmarks/engine_steps.py without an engine: the step timer with stand-in graphs and CUDA events,
the import hook that installs it, the plugin's files, the cutting of step records into repetitions,
and the spread and result fields both engine benchmarks report. The timer on a real GPU:
``test_timer_on_a_gpu`` (pytest -m gpu)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap
from importlib.metadata import distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "engine_steps.py"


@pytest.fixture(scope="module")
def steps():
    spec = importlib.util.spec_from_file_location("engine_steps_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- spread and summaries --------------------------------------------------------------------------


def test_spread_is_range_over_median(steps):
    assert steps.spread([100.0, 103.0, 97.0]) == pytest.approx(0.06)
    assert steps.spread([100, 101, 102, 103, 200]) == pytest.approx(1.0 / 1.02, abs=1e-4)
    assert steps.spread([5.0, 5.0, 5.0]) == 0.0
    # A 3 % difference is visible: spreads far below it, and a shifted run's median differs by 3 %.
    quiet = [1000.0, 1004.0, 998.0, 1001.0, 1003.0]
    assert steps.spread(quiet) < 0.01
    shifted = steps.summarize([v * 1.03 for v in quiet])
    assert shifted["median"] / steps.summarize(quiet)["median"] == pytest.approx(1.03)


def test_spread_needs_two_numbers_and_a_median(steps):
    assert steps.spread([]) is None and steps.spread([3.0]) is None
    assert steps.spread([None, 4.0]) is None  # None entries are dropped
    assert steps.spread([0.0, 0.0]) is None
    assert steps.spread([-1.0, 0.0, 1.0]) is None  # median 0


def test_summarize(steps):
    s = steps.summarize([10.0, 12.0, None, 11.0])
    assert s == {"median": 11.0, "spread": round(2 / 11, 4), "min": 10.0, "max": 12.0, "n": 3}
    assert steps.summarize([]) == {"median": None, "spread": None, "min": None, "max": None, "n": 0}
    assert steps.summarize([None])["n"] == 0


# --- step records ----------------------------------------------------------------------------------


def _write_steps(directory: Path, pid: int, rows) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"steps-{pid}.tsv", "a") as f:
        for t, name, host, dev in rows:
            f.write(f"{t:.6f}\t{name}\t{host:.2f}\t{dev:.2f}\n")


def test_read_steps_merges_processes_and_skips_torn_lines(steps, tmp_path):
    _write_steps(tmp_path, 2, [(2.0, "gb", 1.0, 2.0)])
    _write_steps(tmp_path, 1, [(1.0, "ga", 3.0, 4.0), (3.0, "ga", 5.0, 6.0)])
    with open(tmp_path / "steps-1.tsv", "a") as f:
        f.write("4.0\tga\t5.0")  # a line the engine had not finished writing
    (tmp_path / "other.txt").write_text("1\t2\t3\t4\n")
    assert steps.read_steps(tmp_path) == [(1.0, "ga", 3.0, 4.0), (2.0, "gb", 1.0, 2.0), (3.0, "ga", 5.0, 6.0)]
    assert steps.read_steps(tmp_path / "missing") == [] and steps.read_steps(None) == []


def test_window_takes_the_graph_most_replayed(steps):
    records = [(0.5, "g64", 10.0, 1000.0)]  # before the window
    records += [(1.0 + i / 100, "g64", 20.0 + i % 3, 4000.0 + i) for i in range(50)]
    records += [(1.6, "g1", 99.0, 99.0), (1.7, "g1", 99.0, 99.0)]  # a few steps of another batch
    records += [(2.0, "g64", 1.0, 1.0)]  # at the window's end: outside
    w = steps.window_stats(records, 1.0, 2.0)
    assert (w["steps"], w["graph"], w["graph_steps"], w["graphs"]) == (52, "g64", 50, 2)
    assert w["host_us"] == 21.0 and w["device_us"] == 4024.5
    assert w["device_us_p90"] >= w["device_us"]
    assert steps.window_stats(records, 5.0, 6.0) == {
        "steps": 0,
        "graph": None,
        "graphs": 0,
        "host_us": None,
        "device_us": None,
    }


def test_decode_prompts_are_fixed_and_inside_the_vocabulary(steps):
    prompts = steps.decode_prompts(64, vocab=1000)
    assert prompts == steps.decode_prompts(64, vocab=1000) and len(prompts) == 64
    assert all(8 <= len(p) <= 39 for p in prompts) and len({len(p) for p in prompts}) > 1
    assert all(0 < t < 1000 for p in prompts for t in p)
    small = steps.decode_prompts(64, vocab=100)  # ids wrap inside a small vocabulary
    assert small != prompts and all(0 < t < 100 for p in small for t in p)


# --- measure_decode with a stand-in engine ---------------------------------------------------------


class FakeEngine:
    """Generates on a fake clock: ``prefill_s`` per call, then ``step_s[i]`` per decode step of the
    i-th call, and writes each decode step's replay to a step file as the engine plugin would."""

    def __init__(self, steps_dir: Path | None, step_s, prefill_s=0.05, device_us=None):
        self.now = 100.0
        self.steps_dir, self.step_s, self.prefill_s = steps_dir, list(step_s), prefill_s
        self.device_us = device_us or (lambda call: 1000.0 * self.step_s[call])
        self.calls = 0
        self.wall = 1_000.0

    def clock(self):
        return self.now

    def wall_clock(self):
        return self.wall + self.now

    def generate(self, prompts, n):
        call = min(self.calls, len(self.step_s) - 1)
        self.calls += 1
        self.now += self.prefill_s
        rows = []
        for _ in range(n - 1):  # the first token comes from the prefill
            rows.append((self.now, f"g{len(prompts)}", 20.0 + call, self.device_us(call)))
            self.now += self.step_s[call]
        if self.steps_dir is not None:
            _write_steps(self.steps_dir, 7, rows)
        return [[1] * n for _ in prompts]

    def sleep(self, s):
        self.now += s


def test_decode_tokens_per_second_and_replay_times_per_repetition(steps, tmp_path):
    # calls: warm-up, 3 short (1 token: no decode step), 5 timed reps, then the flush generate
    per_step = [0.004, 0.004, 0.004, 0.004, 0.0040, 0.0041, 0.0039, 0.0040, 0.0042, 0.004]
    eng = FakeEngine(tmp_path, per_step)
    prompts = steps.decode_prompts(64)
    got = steps.measure_decode(
        eng.generate, prompts, 512, 5, steps_dir=tmp_path, clock=eng.clock, mono=eng.clock, sleep=eng.sleep
    )
    assert got["decode_tokens"] == 64 * 512 and got["reps_done"] == 5 and not got["reps_cut"]
    expected = [64 / s for s in per_step[4:9]]  # one decode step = one token per prompt
    assert got["decode_tok_s_reps"] == pytest.approx(expected, rel=1e-3)
    stats = got["decode_stats"]
    assert stats["tok_s"]["median"] == pytest.approx(64 / 0.004, rel=1e-3)
    assert stats["tok_s"]["spread"] == pytest.approx((64 / 0.0039 - 64 / 0.0042) / (64 / 0.004), rel=1e-2)
    assert stats["replay_device_us"]["median"] == pytest.approx(4.0)
    assert stats["replay_device_us"]["spread"] == pytest.approx(0.3 / 4.0, rel=1e-3)
    assert stats["replay_host_us"]["median"] == 26.0 and stats["replay_host_us"]["n"] == 5
    assert [w["steps"] for w in got["replay_windows"]] == [512] * 5
    assert all(w["graph"] == "g64" for w in got["replay_windows"])
    assert got["warmup_steps"] == 512 and got["replay_steps_total"] == 6 * 512 + 3
    json.dumps(got)


def test_decode_without_step_records_still_gives_tokens_per_second(steps):
    eng = FakeEngine(None, [0.002])
    got = steps.measure_decode(eng.generate, [[1, 2, 3]] * 8, 128, 3, clock=eng.clock, mono=eng.clock)
    assert got["decode_tok_s"] == pytest.approx(8 / 0.002, rel=1e-6)
    assert got["decode_stats"]["tok_s"]["spread"] == 0.0
    assert got["decode_stats"]["replay_host_us"] == steps.summarize([])
    assert "replay_windows" not in got


def test_repetitions_stop_before_the_deadline(steps):
    eng = FakeEngine(None, [0.01])  # 1.28 s per long generate
    start = eng.wall_clock()
    got = steps.measure_decode(
        eng.generate,
        [[1, 2]] * 4,
        128,
        10,
        deadline=start + 6.0,
        clock=eng.clock,
        mono=eng.clock,
        wall=eng.wall_clock,
    )
    assert got["reps_cut"] and 2 <= got["reps_done"] < 10
    assert eng.wall_clock() <= start + 6.0
    # never fewer than two repetitions, whatever the deadline says
    eng = FakeEngine(None, [0.01])
    got = steps.measure_decode(
        eng.generate, [[1, 2]] * 4, 128, 5, deadline=0.0, clock=eng.clock, mono=eng.clock, wall=eng.wall_clock
    )
    assert got["reps_done"] == 2 and got["reps_cut"]


# --- paired runs: two engines' repetitions alternating ----------------------------------------------


def _paired_child(steps, directory, name, eng, reps, log, lock):
    """A child's decode under a gate; every generate of a timed repetition is logged in order."""

    def generate(prompts, n):
        out = eng.generate(prompts, n)
        if n > 2:
            with lock:
                log.append(name)
        return out

    gate = steps.PairGate(directory, name, timeout_s=30)
    return steps.measure_decode(generate, [[1, 2]] * 4, 16, reps, clock=eng.clock, mono=eng.clock, gate=gate)


def test_paired_repetitions_alternate_and_stop_when_told(steps, tmp_path):
    import threading

    log, lock, results = [], threading.Lock(), {}
    children = {
        name: threading.Thread(
            target=lambda n=name: results.__setitem__(
                n, _paired_child(steps, tmp_path, n, FakeEngine(None, [0.001]), 10, log, lock)
            )
        )
        for name in ("stock", "load")
    }
    for t in children.values():
        t.start()
    import time as _time

    pairs = steps.run_pairs(
        tmp_path, ("stock", "load"), 3, _time.time() + 60, lambda n: children[n].is_alive()
    )
    for t in children.values():
        t.join(30)
    assert pairs["rounds"] == 3 and pairs["stopped"] == "all rounds run"
    assert pairs["order"] == [["stock", "load"], ["load", "stock"], ["stock", "load"]]
    # warm-up generates (not gated) first, then exactly the opened repetitions, one at a time, in order
    timed = log[2:]
    assert timed == ["stock", "load", "load", "stock", "stock", "load"]
    for name in ("stock", "load"):
        assert results[name]["reps_done"] == 3 and results[name]["reps_cut"]  # the stop ended rep 4
    assert (tmp_path / "stop").exists()


def test_rounds_are_separated_by_the_pause_and_only_rounds(steps, tmp_path):
    """Stand-in children that finish each repetition at once: the opening times of the repetitions
    (their go files) show the pause between rounds, and none inside a round."""
    import threading
    import time as _time

    names = ("stock", "load")

    def child(n: str) -> None:
        gate = steps.PairGate(tmp_path, n, timeout_s=10, poll_s=0.001)
        i = 0
        while gate.wait(i):
            gate.done(i)
            i += 1

    threads = [threading.Thread(target=child, args=(n,)) for n in names]
    for t in threads:
        t.start()
    got = steps.run_pairs(tmp_path, names, 3, _time.time() + 60, lambda n: True, poll_s=0.001, pause_s=1.0)
    for t in threads:
        t.join(10)
    assert got["rounds"] == 3 and got["round_pause_s"] == 1.0
    opened = {(n, i): (tmp_path / f"go-{n}-{i}").stat().st_mtime for n in names for i in range(3)}
    for i in range(3):
        first, second = sorted(opened[n, i] for n in names)
        assert second - first < 0.5  # no pause inside a round
    starts = [min(opened[n, i] for n in names) for i in range(3)]
    assert all(b - a >= 0.9 for a, b in zip(starts, starts[1:]))  # mtimes are coarser than 1 ms
    (tmp_path / "none").mkdir()
    assert "round_pause_s" not in steps.run_pairs(tmp_path / "none", names, 0, 0.0, lambda n: False)


def test_pairs_stop_when_a_child_is_gone_or_the_budget_ends(steps, tmp_path):
    (tmp_path / "wait-stock-0").touch()
    got = steps.run_pairs(tmp_path, ("stock", "load"), 5, 1e12, lambda n: n == "stock", poll_s=0.001)
    assert got["rounds"] == 0 and got["stopped"] == "load ended before wait-load-0"
    assert (tmp_path / "stop").exists()
    d = tmp_path / "late"
    d.mkdir()
    for n in ("stock", "load"):
        (d / f"wait-{n}-0").touch()
    got = steps.run_pairs(d, ("stock", "load"), 5, 0.0, lambda n: True, poll_s=0.001)
    assert got["rounds"] == 0 and got["stopped"].startswith("deadline passed")
    # a gate that is never opened gives up after its timeout, and at once on stop
    gate = steps.PairGate(d, "load", timeout_s=0.05)
    assert gate.wait(7) is False and (d / "wait-load-7").exists()
    # a child stopped before its first repetition still reports (no numbers)
    eng = FakeEngine(None, [0.001])
    got = steps.measure_decode(eng.generate, [[1, 2]] * 2, 8, 3, clock=eng.clock, mono=eng.clock, gate=gate)
    assert got["reps_done"] == 0 and got["reps_cut"] and got["decode_tok_s"] is None
    assert got["decode_tokens"] is None


def test_paired_stats_compare_round_by_round(steps):
    stock = {
        "decode_tok_s_reps": [20000.0, 16000.0, 21000.0],
        "replay_windows": [
            {"host_us": 16.5, "device_us": 2660.0},
            {"host_us": 22.0, "device_us": 2670.0},
            {"host_us": 16.0, "device_us": 2665.0},
        ],
    }
    load = {
        "decode_tok_s_reps": [19800.0, 16160.0, 21000.0, 5.0],  # a fourth repetition has no partner
        "replay_windows": [
            {"host_us": 17.5, "device_us": 2640.0},
            {"host_us": 23.5, "device_us": 2670.0},
            {"host_us": 16.5, "device_us": 2680.0},
        ],
    }
    got = steps.paired_stats(stock, load, 3)
    assert got["tok_s_ratio"]["values"] == [0.99, 1.01, 1.0]
    assert got["tok_s_ratio"]["median"] == 1.0 and got["tok_s_ratio"]["spread"] == pytest.approx(0.02)
    assert (
        got["replay_host_diff_us"]["values"] == [1.0, 1.5, 0.5]
        and got["replay_host_diff_us"]["median"] == 1.0
    )
    assert got["replay_host_diff_us"]["spread"] is None  # differences have no relative spread
    assert got["replay_device_ratio"]["n"] == 3
    assert got["tok_s_ratio"]["ci95"] is None  # three rounds cannot give a 95 % interval
    assert steps.paired_stats(stock, None, 3)["tok_s_ratio"]["median"] is None


def test_the_median_interval_takes_order_statistics_by_the_binomial(steps):
    from math import comb

    assert steps.median_ci95([1.0] * 5) is None and steps.median_ci95([]) is None
    six = [0.9, 1.3, 1.0, 1.1, 0.95, 1.05]  # 6: the extremes, 1 - 2/64 = 96.9 %
    assert steps.median_ci95(six) == [0.9, 1.3]
    ten = [1.2592, 0.8238, 1.0279, 0.9483, 1.0074, 1.0359, 1.0372, 1.1588, 0.9049, 0.9824, None]
    assert steps.median_ci95(ten) == [0.9049, 1.1588]  # vLLM at 87eda11: 2nd of 10 from each end
    for n in range(6, 60):
        lo, hi = steps.median_ci95(range(n))
        k = int(lo) + 1
        assert hi == n - k
        tail = sum(comb(n, i) for i in range(k)) / 2**n  # P(B <= k - 1)
        assert tail <= 0.025 < tail + comb(n, k) / 2**n  # k is the largest such rank
    # A few rounds in a slow period move the interval far less than the range.
    rounds = [1.0 + 0.002 * (i % 5) for i in range(30)] + [0.75, 1.26]
    lo, hi = steps.median_ci95(rounds)
    assert 0.99 < lo and hi < 1.01


def test_paired_lines_give_the_interval_where_there_is_one(steps):
    stock = {"decode_tok_s_reps": [100.0] * 8, "timed_long_s": [2.0] * 8}
    load = {
        "decode_tok_s_reps": [97.0, 98.0, 99.0, 100.0, 101.0, 102.0, 98.5, 99.5],
        "timed_long_s": [2.0] * 8,
    }
    line = steps.paired_lines(
        {"rounds": 8, "stopped": "all rounds run", **steps.paired_stats(stock, load, 8)}
    )[0]
    assert "LOAD/stock tok/s end to end 1.0 (95% CI 1.0..1.0, range 1.0..1.0, spread 0.0%)" in line
    assert "decode 0.9925 (95% CI 0.97..1.02, range 0.97..1.02, spread 5.0%)" in line


def test_end_to_end_ratio_takes_no_per_run_baseline(steps):
    """The 87eda11 SGLang rounds: stock's baseline (median of its 1-token generates) was 85 ms, LOAD's
    37 ms; the decode ratio, which subtracts each run's own, put LOAD 3 % below stock, the whole
    generates' times did not."""
    stock = {
        "timed_short_s": [0.0846, 0.0656, 0.412],
        "timed_long_s": [1.5717, 1.535, 1.5299, 1.5567, 1.5915, 1.5389, 1.5385, 1.553],
    }
    load = {
        "timed_short_s": [0.0604, 0.0366, 0.0354],
        "timed_long_s": [1.5265, 1.9751, 1.5309, 1.5401, 1.583, 1.5762, 1.5965, 1.5374],
    }
    tokens = 64 * 513
    for run in (stock, load):
        base = sorted(run["timed_short_s"])[1]
        run["decode_tok_s_reps"] = [(tokens - 64) / (t - base) for t in run["timed_long_s"]]
    got = steps.paired_stats(stock, load, 8)
    assert got["tok_s_ratio"]["median"] == pytest.approx(0.971, abs=0.002)
    assert got["e2e_tok_s_ratio"]["median"] == pytest.approx(1.0024, abs=0.001)
    assert got["e2e_tok_s_ratio"]["values"][1] == round(1.535 / 1.9751, 4)  # stock's time over LOAD's
    assert got["e2e_tok_s_ratio"]["spread"] is not None


# --- the timer in an engine process, with stand-in graphs and events -------------------------------


class FakeEvent:
    clock = [0.0]

    def __init__(self):
        self.t = None
        self.done = True

    def record(self):
        self.t = FakeEvent.clock[0]

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, end):
        return end.t - self.t  # milliseconds


def _fake_replay(self):
    self.replays += 1
    FakeEvent.clock[0] += 2.5  # 2.5 ms on the "device"
    return "out"


def graph_class():
    """A new stand-in graph class (wrapping patches the class: one per test)."""

    class FakeGraph:
        def __init__(self, name="g"):
            self.name = name
            self.replays = 0

        replay = _fake_replay

    return FakeGraph


@pytest.fixture
def timer(steps, tmp_path, monkeypatch):
    monkeypatch.setattr(steps.StepTimer, "_new_pair", staticmethod(lambda: (FakeEvent(), FakeEvent())))
    return steps.StepTimer(tmp_path / "steps")


def test_timer_records_every_replay_of_a_wrapped_class(steps, timer, tmp_path):
    Graph = graph_class()

    class Kept(Graph):  # a subclass (as Foundry's KeptCUDAGraph) inherits the timed replay
        pass

    class Overriding(Graph):  # ... and one that overrides it calls it through super()
        def replay(self):
            return super().replay()

    assert steps.wrap_replay(Graph, timer, "id") is True
    assert steps.wrap_replay(Graph, timer, "id") is False  # once
    graphs = [Graph(), Kept(), Overriding()]
    for _ in range(4):
        for g in graphs:
            assert g.replay() == "out"
    assert [g.replays for g in graphs] == [4, 4, 4]
    timer.close()
    records = steps.read_steps(tmp_path / "steps")
    assert len(records) == 12 and len({r[1] for r in records}) == 3
    assert all(r[1].startswith("g") and r[3] == pytest.approx(2500.0) and r[2] >= 0 for r in records)
    assert Graph.replay.__wrapped__ is _fake_replay  # functools.wraps: the engine's own name and docs


def test_timer_names_restored_graphs_and_waits_for_pending_events(steps, timer, tmp_path, monkeypatch):
    Restored = graph_class()

    steps.wrap_replay(Restored, timer, "name")
    late = []

    def pair():
        b, e = FakeEvent(), FakeEvent()
        e.done = False  # the device has not got there yet
        late.append(e)
        return b, e

    monkeypatch.setattr(steps.StepTimer, "_new_pair", staticmethod(pair))
    g = Restored("decode/bs64")
    g.replay()
    g.replay()
    assert steps.read_steps(tmp_path / "steps") == []  # nothing finished, nothing written
    late[0].done = True
    g.replay()  # the first one is drained now, in order
    timer.flush()
    assert [r[1] for r in steps.read_steps(tmp_path / "steps")] == ["decode/bs64"]
    timer.close()  # waits for the rest
    assert len(steps.read_steps(tmp_path / "steps")) == 3


def test_timer_flushes_at_most_every_flush_interval(steps, timer, tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(steps.time, "monotonic", lambda: now[0])
    timer._last_flush = now[0]
    FakeGraph = graph_class()
    steps.wrap_replay(FakeGraph, timer, "id")
    g = FakeGraph()
    g.replay()
    g.replay()
    assert steps.read_steps(tmp_path / "steps") == []  # buffered
    now[0] += steps.FLUSH_S
    g.replay()
    assert len(steps.read_steps(tmp_path / "steps")) == 3


def test_timer_steps_aside(steps, timer, tmp_path, monkeypatch):
    FakeGraph = graph_class()
    steps.wrap_replay(FakeGraph, timer, "id")
    g = FakeGraph()
    monkeypatch.setattr(steps, "_capturing", lambda: True)  # inside a stream capture: no events
    g.replay()
    monkeypatch.setattr(steps, "_capturing", lambda: False)

    def broken():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(steps.StepTimer, "_new_pair", staticmethod(broken))
    g.replay()  # timing fails: the replay still runs, and timing is off from then on
    assert g.replays == 2 and timer.count == 0 and timer.disabled == "RuntimeError: no CUDA"
    g.replay()
    assert g.replays == 3


def test_timer_starts_over_in_a_forked_child(steps, timer, tmp_path):
    FakeGraph = graph_class()
    steps.wrap_replay(FakeGraph, timer, "id")
    FakeGraph().replay()
    timer.pid = -1  # as seen from a child forked after that replay
    FakeGraph().replay()
    assert timer.count == 1 and timer.pid > 0
    timer.close()
    assert len(steps.read_steps(tmp_path / "steps")) == 1


def test_timer_stops_at_its_limit(steps, tmp_path, monkeypatch):
    monkeypatch.setattr(steps.StepTimer, "_new_pair", staticmethod(lambda: (FakeEvent(), FakeEvent())))
    timer = steps.StepTimer(tmp_path, limit=3)
    FakeGraph = graph_class()
    steps.wrap_replay(FakeGraph, timer, "id")
    g = FakeGraph()
    for _ in range(5):
        g.replay()
    timer.close()
    assert g.replays == 5 and len(steps.read_steps(tmp_path)) == 3


# --- installing it: the import hook and the plugin's files -------------------------------------------


def test_patch_applies_when_the_module_is_first_imported(steps, tmp_path, monkeypatch):
    (tmp_path / "fb_late_graphs.py").write_text(
        "class G:\n    def replay(self):\n        return 'replayed'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    steps.when_imported("fb_late_graphs", seen.append)
    try:
        assert seen == []
        import fb_late_graphs

        assert seen == [fb_late_graphs] and fb_late_graphs.G().replay() == "replayed"
        assert "def replay" in inspect.getsource(fb_late_graphs)  # the real loader still answers
        steps.when_imported("fb_late_graphs", seen.append)  # already imported: at once
        assert seen == [fb_late_graphs, fb_late_graphs]
    finally:
        sys.modules.pop("fb_late_graphs", None)
        steps._HOOK.patches.pop("fb_late_graphs", None)
        if steps._HOOK in sys.meta_path:
            sys.meta_path.remove(steps._HOOK)


def test_register_is_off_without_its_variable_and_times_the_targets_with_it(steps, tmp_path, monkeypatch):
    (tmp_path / "fb_target_graphs.py").write_text(
        "class Graph:\n    def replay(self):\n        return 1\n"
        "class Restored:\n    name = 'decode/bs8'\n    def replay(self):\n        return 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(steps, "TARGETS", {"fb_target_graphs": ("Graph", "id")})
    monkeypatch.setattr(steps, "_TIMER", [])
    monkeypatch.setattr(steps.StepTimer, "_new_pair", staticmethod(lambda: (FakeEvent(), FakeEvent())))
    monkeypatch.delenv(steps.ENV_DIR, raising=False)
    try:
        steps.register()
        assert steps._TIMER == []
        monkeypatch.setenv(steps.ENV_DIR, str(tmp_path / "out"))
        steps.register()
        steps.register()  # once per process
        import fb_target_graphs

        assert len(steps._TIMER) == 1
        assert fb_target_graphs.Graph().replay() == 1 and fb_target_graphs.Restored().replay() == 2
        steps._TIMER[0].close()
        assert len(steps.read_steps(tmp_path / "out")) == 1  # Graph only: Restored is not a target
    finally:
        sys.modules.pop("fb_target_graphs", None)
        steps._HOOK.patches.pop("fb_target_graphs", None)
        if steps._HOOK in sys.meta_path:
            sys.meta_path.remove(steps._HOOK)


def test_targets_are_the_classes_the_engines_replay(steps):
    """torch's graph class (stock and SAVE) and Foundry's restored graph (LOAD), each with a replay."""
    assert set(steps.TARGETS) == {"torch.cuda.graphs", "foundry_core.api"}
    sys.path.insert(0, str(ROOT / "src"))
    try:
        import foundry_core.api

        assert callable(foundry_core.api.RestoredGraph.replay)
    finally:
        sys.path.remove(str(ROOT / "src"))
    torch = pytest.importorskip("torch")
    assert "replay" in vars(torch.cuda.graphs.CUDAGraph)


def test_plugin_folder_has_the_module_and_both_entry_points(steps, tmp_path):
    root = steps.write_plugin(tmp_path / "plugin")
    (dist,) = distributions(path=[str(root)])
    assert dist.metadata["Name"] == "foundry_bench_steps"
    eps = sorted((ep.group, ep.name, ep.value) for ep in dist.entry_points)
    assert eps == [
        ("sglang.srt.plugins", "foundry_bench_steps", "foundry_bench_steps:register"),
        ("vllm.general_plugins", "foundry_bench_steps", "foundry_bench_steps:register"),
    ]
    assert (root / "foundry_bench_steps.py").read_text() == SCRIPT.read_text()
    # Importing it in an engine process with the variable unset changes nothing (no torch import).
    code = textwrap.dedent(
        """
        import sys, foundry_bench_steps
        foundry_bench_steps.register()
        print(int("torch" in sys.modules), len(foundry_bench_steps._TIMER))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.split() == ["0", "0"], out.stderr


# --- the fields both benchmarks report -------------------------------------------------------------


def _stats(tok, host, dev):
    return {
        "tok_s": {"median": tok, "spread": 0.01},
        "replay_host_us": {"median": host, "spread": 0.02},
        "replay_device_us": {"median": dev, "spread": 0.005},
    }


def test_decode_fields(steps):
    runs = {
        "stock": {"decode_stats": _stats(10000.0, 20.0, 4000.0)},
        "save": {"decode_stats": _stats(10100.0, 22.0, 4010.0)},
        "load": {"decode_stats": _stats(9900.0, 25.0, 4020.0)},
    }
    f = steps.decode_fields(runs)
    assert set(steps.REPLAY_FIELDS) <= set(f)
    assert f["replay_host_us_load"] == 25.0 and f["replay_device_us_save"] == 4010.0
    assert f["replay_host_us_stock"] == 20.0
    assert f["replay_device_ratio_load_vs_save"] == round(4020 / 4010, 4)
    assert f["replay_host_ratio_load_vs_stock"] == 1.25
    assert f["decode_spread"]["load"] == {"tok_s": 0.01, "replay_host_us": 0.02, "replay_device_us": 0.005}
    assert f["decode_stats"]["stock"]["tok_s"]["median"] == 10000.0

    missing = steps.decode_fields({"stock": {"error": "boom"}, "save": None})
    assert all(missing[k] is None for k in steps.REPLAY_FIELDS)
    assert missing["decode_spread"] == {"stock": None, "save": None, "load": None}


def test_summary_table_fits_a_screen(steps):
    result = {
        "ready_s_stock": 150.25,
        "ready_s_load": 60.0,
        "decode_stats": {"stock": _stats(10000.0, 20.0, 4000.0), "load": _stats(9900.0, 25.0, 4020.0)},
        "runs": {"stock": {"reps_done": 5, "replay_windows": [{"steps": 512}] * 5}},
    }
    lines = steps.summary_table(result)
    assert len(lines) == 4 and all(len(line) <= 110 for line in lines)
    assert "10000.0 (1.0%)" in lines[1] and "150.2" in lines[1] and "512" in lines[1]
    assert "n/a" in lines[2] and "9900.0" in lines[3]
    assert len(steps.foundry_lines(result)) == 2
    assert steps.summary_table({}) and steps.foundry_lines({})


def test_describe_model(steps):
    cs_spec = importlib.util.spec_from_file_location("cold_start", ROOT / "benchmarks" / "cold_start.py")
    cs = sys.modules.get("cold_start")
    if cs is None:
        cs = importlib.util.module_from_spec(cs_spec)
        sys.modules["cold_start"] = cs
        cs_spec.loader.exec_module(cs)
    text = steps.describe_model(cs.MODEL_CONFIG, "x")
    assert "28 layers, hidden 2048, intermediate 6144, heads 16/8 x 128, vocab 151936" in text
    assert "tied embeddings True" in text


@pytest.mark.gpu
def test_timer_on_a_gpu(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--selftest", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_benchmarks_pin_their_runs_to_the_cores_they_are_given(steps):
    """--cpus of benchmarks/sglang_h200.py and vllm_h200.py: a core list, and a pin that children
    inherit (checked in a child of this process, which keeps its own affinity)."""
    import os

    assert steps.cpu_list("2-5") == {2, 3, 4, 5} and steps.cpu_list("0,4,6-7") == {0, 4, 6, 7}
    with pytest.raises(ValueError):
        steps.cpu_list("two")
    assert steps.pin(None) is None
    core = min(os.sched_getaffinity(0))
    code = (
        "import importlib.util, os, subprocess, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"assert m.pin([{core}]) == [{core}]\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True, check=True)\n"
        "print(child.stdout.strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"[{core}]"


def test_a_graph_that_puts_its_own_replay_on_the_instance_stays_timed(steps, timer, tmp_path):
    # As foundry_core's RestoredGraph does at its first replay (a closure over its executable): the
    # class's timed method is never reached again, so the instance's own path must be timed too.
    class SelfReplacing:
        def __init__(self):
            self.name, self.fast = "decode/bs8", 0

        def replay(self):
            FakeEvent.clock[0] += 2.5

            def fast():
                self.fast += 1
                FakeEvent.clock[0] += 2.5
                return "out"

            self.replay = fast
            return "out"

    steps.wrap_replay(SelfReplacing, timer, "name")
    g = SelfReplacing()
    for _ in range(5):
        assert g.replay() == "out"
    assert g.fast == 4
    timer.close()
    records = steps.read_steps(tmp_path / "steps")
    assert len(records) == 5 and {r[1] for r in records} == {"decode/bs8"}
    assert all(r[3] == pytest.approx(2500.0) for r in records)


def test_restored_graphs_stay_timed_after_their_first_replay(steps, timer, tmp_path):
    api = pytest.importorskip("foundry_core.api")

    class Rebuilt:  # the executable's stand-in: launcher() is what the first replay installs
        launches = 0

        def launcher(self, current_stream, device):
            def launch():
                Rebuilt.launches += 1
                FakeEvent.clock[0] += 1.0

            return launch

    class Timed(api.RestoredGraph):  # a subclass, so that wrapping does not patch the real class
        pass

    steps.wrap_replay(Timed, timer, "name")
    g = Timed("decode/bs1", Rebuilt(), 0, None, 3)
    for _ in range(6):
        g.replay()
    assert Rebuilt.launches == 6
    timer.close()
    assert len(steps.read_steps(tmp_path / "steps")) == 6


def test_vllm_paired_run_starts_stock_once_load_waits_and_alternates(tmp_path):
    """benchmarks/vllm_h200.py --paired: LOAD alone until it waits at its first repetition (its KV
    cache is sized with the GPU to itself), then stock, then rounds alternating the two."""
    import threading
    import time as _time

    spec = importlib.util.spec_from_file_location(
        "vllm_h200_under_test", ROOT / "benchmarks" / "vllm_h200.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    steps = bench.steps
    events, lock = [], threading.Lock()

    class StandInChild:
        def __init__(self, name):
            self.name, self.proc, self.result = name, None, None

        def start(self):
            self.proc, self.t0 = True, _time.perf_counter()
            with lock:
                events.append(("start", self.name, (tmp_path / "wait-load-0").exists()))

            def run():
                eng = FakeEngine(None, [0.001])

                def generate(prompts, n):
                    if n > 2:
                        with lock:
                            events.append(("rep", self.name))
                    return eng.generate(prompts, n)

                _time.sleep(0.2)  # the engine's start
                gate = steps.PairGate(tmp_path, self.name, timeout_s=20)
                self.result = {
                    "name": self.name,
                    **steps.measure_decode(
                        generate, [[1, 2]] * 2, 8, 4, clock=eng.clock, mono=eng.clock, gate=gate
                    ),
                }

            self.thread = threading.Thread(target=run)
            self.thread.start()
            return self

        def alive(self):
            return self.thread.is_alive()

        def finish(self, timeout_s):
            self.thread.join(timeout_s)
            return self.result

    pairs, stock, load = bench.run_paired(
        StandInChild("load"),
        StandInChild("stock"),
        tmp_path,
        3,
        _time.time() + 120,
        poll_s=0.01,
        pause_s=0.05,
    )
    assert pairs["round_pause_s"] == 0.05  # --round-pause reaches the rounds
    assert events[0] == ("start", "load", False)
    assert ("start", "stock", True) in events  # stock started once LOAD waited at repetition 0
    timed = [e[1] for e in events if e[0] == "rep"][2:]  # after the two warm-up generates
    assert timed == ["stock", "load", "load", "stock", "stock", "load"]
    assert pairs["rounds"] == 3 and pairs["stock_started_after_load_s"] is not None
    assert stock["reps_done"] == 3 and load["reps_done"] == 3
    paired = steps.paired_stats(stock, load, pairs["rounds"])
    assert paired["tok_s_ratio"]["median"] == 1.0 and paired["tok_s_ratio"]["n"] == 3
    assert steps.paired_lines({**pairs, **paired})[0].startswith("  paired, 3 rounds (all rounds run)")
    assert bench.parse_args(["--out", "o", "--logs", "l", "--paired"]).paired is True
    assert bench.parse_args(["--out", "o", "--logs", "l", "--round-pause", "2"]).round_pause == 2.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--logs", "l", "--paired", "--order", "save,load"])
    # --save-reps: SAVE, alone before the rounds, runs fewer timed repetitions than the pair
    fewer = bench.parse_args(["--out", "o", "--logs", "l", "--paired", "--reps", "150", "--save-reps", "5"])
    assert [steps.reps_of(run, fewer) for run in ("save", "stock", "load")] == [5, 150, 150]
    alike = bench.parse_args(["--out", "o", "--logs", "l", "--reps", "7"])
    assert [steps.reps_of(run, alike) for run in ("save", "stock", "load")] == [7, 7, 7]
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--logs", "l", "--save-reps", "0"])


def test_paired_rounds_time_their_own_first_token_and_baseline(steps):
    """Under a gate each round also times a 1-token generate right before its long one: the round's
    baseline for the decode-only rate, and the first-token comparison of paired_stats."""

    class Gate:
        def __init__(self):
            self.opened = []

        def wait(self, i):
            self.opened.append(i)
            return i < 3

        def done(self, i):
            pass

    eng = FakeEngine(None, [0.001], prefill_s=0.05)
    # warm-up, three baselines, then per round a 1-token and a long generate
    prefills = iter([0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.06, 0.05, 0.05, 0.05])
    plain = eng.generate

    def generate(prompts, n):  # the second round's 1-token generate meets a slow host
        eng.prefill_s = next(prefills)
        return plain(prompts, n)

    got = steps.measure_decode(generate, [[1, 2]] * 4, 16, 10, clock=eng.clock, mono=eng.clock, gate=Gate())
    assert got["reps_done"] == 3 and got["reps_cut"]
    assert got["timed_round_short_s"] == [0.05, 0.06, 0.05]
    long_s = 0.05 + 16 * 0.001  # prefill, then 16 decode steps
    expected = [(4 * 17 - 4) / (long_s - b) for b in (0.05, 0.06, 0.05)]
    assert got["decode_tok_s_reps"] == pytest.approx(expected, rel=1e-3), "each round its own baseline"
    stock, load = {"timed_round_short_s": [0.05, 0.06, 0.05]}, {"timed_round_short_s": [0.07, 0.06, 0.05]}
    assert steps.paired_stats(stock, load, 3)["first_token_ratio"]["values"] == [0.7143, 1.0, 1.0]
    unpaired = steps.measure_decode(plain, [[1, 2]] * 4, 16, 2, clock=eng.clock, mono=eng.clock)
    assert unpaired["timed_round_short_s"] == [], "without a gate: the three baselines, as before"
