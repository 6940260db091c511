"""``foundry soak``: the pure parts on the CPU (schedule, comparisons, growth, record, criteria, counting),
and the whole command end to end on a GPU."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from foundry_core import cli
from foundry_tools import soak, soak_cpu_suite, soak_gpu

MIB = 1 << 20


def test_schedule_is_round_robin_over_all_sizes():
    assert soak_gpu.soak_schedule([1, 8, 4], 7) == [1, 8, 4, 1, 8, 4, 1]
    sched = soak_gpu.soak_schedule(range(1, 23), 10_000)
    assert len(sched) == 10_000 and set(sched) == set(range(1, 23))
    with pytest.raises(ValueError):
        soak_gpu.soak_schedule([], 3)


def test_growth_is_measured_from_the_end_of_the_warmup():
    curve = [100, 140, 140, 150]  # after cycles 1..4
    assert soak.growth(curve, warmup=1) == 50  # 150 - 100
    assert soak.growth(curve, warmup=2) == 10  # 150 - 140
    assert soak.growth(curve, warmup=0) == 50
    assert soak.growth([5, 3], warmup=1) == -2
    assert soak.growth([5], warmup=1) is None  # nothing past the warm-up
    assert soak.growth([5, 6], warmup=2) is None
    assert soak.growth([], warmup=1) is None


def test_memory_growth_of_every_curve():
    pt = lambda d, r: {"device_used": d, "torch_allocated": 0, "torch_reserved": 2, "host_rss": r}  # noqa: E731
    curves = {"loaded": [pt(10, 1), pt(12, 2), pt(12, 9)], "unloaded": [pt(4, 1), pt(4, 1), pt(4, 3)]}
    g = soak.memory_growth(curves, warmup=1)
    assert g["loaded.device_used"] == 2 and g["unloaded.device_used"] == 0
    assert g["unloaded.host_rss"] == 2 and g["unloaded.torch_reserved"] == 0


STATS_NEW = """tests/x.py::test_a:

  - during reuse phase (0.00 seconds):
    - Typical runtimes: < 1ms, of which < 1ms in data generation
    - 2 passing, 0 failing, and 0 invalid test cases

  - during generate phase (1.20 seconds):
    - Typical runtimes: ~ 1ms, of which < 1ms in data generation
    - 698 passing, 0 failing, and 5 invalid test cases

  - during shrink phase (0.30 seconds):
    - Typical runtimes: ~ 1ms, of which < 1ms in data generation
    - 40 passing, 3 failing, and 0 invalid test cases
    - Tried 43 shrinks of which 2 were successful
"""

STATS_OLD = """  - during generate phase (0.50 seconds):
    - Typical runtimes: ~ 1ms, of which ~ 1ms in data generation
    - 300 passing examples, 0 failing examples, 1 invalid examples
"""


def test_hypothesis_statistics_are_counted_without_the_shrink_phase():
    assert soak_cpu_suite.parse_hypothesis_statistics(STATS_NEW) == {
        "passing": 700,
        "failing": 0,
        "invalid": 5,
    }
    assert soak_cpu_suite.parse_hypothesis_statistics(STATS_OLD) == {
        "passing": 300,
        "failing": 0,
        "invalid": 1,
    }
    assert soak_cpu_suite.parse_hypothesis_statistics("") == {"passing": 0, "failing": 0, "invalid": 0}


def test_token_mismatches_are_attributed_to_their_replay():
    schedule = [2, 1, 3]
    expected = torch.tensor([1, 2, 3, 4, 5, 6])
    assert soak_gpu.token_mismatches(schedule, expected, expected.clone()) == [False, False, False]
    got = expected.clone()
    got[2] = 9  # replay 1
    got[5] = 9  # replay 2
    assert soak_gpu.token_mismatches(schedule, expected, got) == [False, True, True]
    assert soak_gpu.token_mismatches(schedule, expected, expected[:5]) == [True, True, True]


def test_combine_counts_a_replay_once_whatever_differs():
    schedule = [1, 2, 1, 2]
    r = soak_gpu.combine_mismatches(
        schedule,
        logit_bad=[False, False, True, False],
        token_bad=[False, False, True, True],
        first_bad={2: True},  # bs 2's first logits differ from SAVE's digest (replay 1)
    )
    assert r["soak_replays"] == 4
    assert r["soak_mismatches"] == 3  # replays 1, 2, 3
    assert r["logit_mismatches"] == 2 and r["token_mismatches"] == 2
    assert r["first_mismatches"] == [[1, 2], [2, 1], [3, 2]]
    assert r["mismatches_per_batch_size"] == {"2": 2, "1": 1}
    clean = soak_gpu.combine_mismatches(schedule, [False] * 4, [False] * 4, {1: False, 2: False})
    assert clean["soak_mismatches"] == 0


class FakeGraphs:
    """Stands in for restored graphs on the CPU: fixed logits per size, tokens from a counter."""

    def __init__(self, corrupt_at=None):
        self.n, self.corrupt_at = 0, corrupt_at

    def step(self, bs):
        logits = torch.arange(bs * 5, dtype=torch.float32).reshape(bs, 5) / (bs + 1)
        if self.n == self.corrupt_at:
            logits = logits.clone()
            logits[0, 0] = -0.0 if logits[0, 0] == 0 else logits[0, 0]  # one bit: +0.0 -> -0.0
        tokens = torch.arange(bs) + self.n
        self.n += 1
        return logits, tokens


def test_sequence_compares_bit_patterns_and_records_tokens():
    schedule = soak_gpu.soak_schedule([1, 3], 6)
    first, tokens, bad = soak_gpu.run_sequence(FakeGraphs().step, schedule, "cpu")
    assert sorted(first) == [1, 3] and bad == [False] * 6
    assert tokens.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7][: sum(schedule)]
    # -0.0 == +0.0 numerically; the soak compares bits, so it is a mismatch.
    _, _, bad = soak_gpu.run_sequence(FakeGraphs(corrupt_at=4).step, schedule, "cpu")
    assert bad == [False, False, False, False, True, False]
    assert soak_gpu.logits_digest(first[1]) == soak_gpu.logits_digest(first[1].clone())
    assert soak_gpu.logits_digest(first[1]) != soak_gpu.logits_digest(-first[1])


def _cpu(**counts):
    base = {
        "tamper_cases": 43,
        "tamper_refused": 43,
        "fuzz_cases": 3060,
        "kill_points": 31,
        "kill_loadable_partial": 0,
    }
    return {"exit_status": 0, "counts": {**base, **counts}}


def _load(device=(1000, 1000, 1000), rss=(50 * MIB, 60 * MIB, 61 * MIB), cycles=3, mismatches=0):
    pts = [
        {"cycle": i + 1, "device_used": d, "torch_allocated": 0, "torch_reserved": 0, "host_rss": r}
        for i, (d, r) in enumerate(zip(device, rss))
    ]
    return {
        "machine": "NVIDIA H200, driver 580.159.04 (CUDA driver API 13.0), torch 2.11.0+cu130",
        "soak": {"soak_replays": 100, "soak_mismatches": mismatches},
        "curves": {"loaded": pts, "unloaded": pts},
        "cycles_completed": cycles,
        "cycle_error": None,
        "cycle_mismatches": 0,
    }


def _record(save=None, load=None, cpu=None, errors=(), cycles=3):
    return soak.assemble(
        args_command="foundry soak",
        commit="abc123",
        save={"native_logit_mismatches": 0} if save is None else save,
        load=_load() if load is None else load,
        cpu=_cpu() if cpu is None else cpu,
        cycles=cycles,
        warmup=1,
        host_limit_bytes=64 * MIB,
        errors=list(errors),
        date="2026-12-01",
    )


REQUIRED = (
    "date commit machine command tamper_cases tamper_refused fuzz_cases kill_points kill_loadable_partial "
    "soak_replays soak_mismatches cycles device_mem_growth_bytes host_rss_growth_bytes memory_curves "
    "cpu_suite criteria pass"
).split()


def test_record_has_the_issue_fields_and_passes_when_all_hold():
    r = _record()
    assert all(k in r for k in REQUIRED), [k for k in REQUIRED if k not in r]
    assert r["pass"], r["criteria"]
    assert r["device_mem_growth_bytes"] == 0 and r["host_rss_growth_bytes"] == 11 * MIB
    assert (r["tamper_cases"], r["fuzz_cases"], r["kill_points"]) == (43, 3060, 31)
    assert r["commit"] == "abc123" and r["machine"].startswith("NVIDIA H200")
    json.dumps(r)  # serializable as is


@pytest.mark.parametrize(
    "change,criterion",
    [
        (dict(load=_load(mismatches=1)), "soak_mismatches == 0"),
        (dict(save={"native_logit_mismatches": 2}), "native_logit_mismatches == 0"),
        (dict(load=_load(device=(1000, 1000, 1000 + 2 * MIB))), "device_mem_growth_bytes == 0"),
        (dict(load=_load(rss=(0, 10 * MIB, 80 * MIB))), "host_rss_growth_bytes < limit"),
        (dict(load=_load(cycles=2)), "all cycles completed"),
        (dict(cpu=_cpu(kill_loadable_partial=1)), "kill_loadable_partial == 0"),
        (dict(cpu=_cpu(kill_points=0)), "kill_loadable_partial == 0"),
        (dict(cpu=_cpu(tamper_refused=42)), "tamper_refused == tamper_cases"),
        (dict(cpu={**_cpu(), "exit_status": 1}), "cpu suite passed"),
    ],
)
def test_each_criterion_fails_the_run(change, criterion):
    r = _record(**change)
    assert not r["criteria"][criterion]
    assert [k for k, ok in r["criteria"].items() if not ok] == [criterion]
    assert not r["pass"]


def test_a_failed_process_fails_the_run_and_leaves_fields_empty():
    r = _record(load={}, errors=["the load process failed (exit 1)"])
    assert not r["pass"]
    assert r["soak_replays"] is None and r["device_mem_growth_bytes"] is None
    assert not r["criteria"]["soak_mismatches == 0"]


def test_a_load_that_fails_in_a_later_cycle_is_recorded():
    load = _load(cycles=1)
    load["cycle_error"] = "cycle 2: load failed: PlacementError: ..."
    load["curves"] = {k: v[:1] for k, v in load["curves"].items()}
    r = _record(load=load, cycles=20)
    assert not r["criteria"]["all cycles completed"]
    assert r["device_mem_growth_bytes"] is None  # one point: no growth to speak of, and no pass
    assert not r["criteria"]["device_mem_growth_bytes == 0"]


def test_without_the_cpu_suite_its_criteria_are_absent_not_passed():
    r = _record(cpu={"exit_status": None, "counts": {}, "notes": ["not run (--no-cpu-suite)"]})
    assert "cpu suite passed" not in r["criteria"] and r["tamper_cases"] is None
    assert r["pass"]


def _report(nodeid, when, outcome):
    return SimpleNamespace(
        nodeid=nodeid,
        when=when,
        failed=outcome == "failed",
        skipped=outcome == "skipped",
        passed=outcome == "passed",
    )


def test_suite_counter_counts_what_ran():
    c = soak_cpu_suite.SuiteCounter()
    t = soak_cpu_suite.TAMPER_FILE
    for i, outcome in enumerate(["passed", "passed", "failed"]):
        for when in ("setup", "call", "teardown"):
            c.pytest_runtest_logreport(_report(f"{t}::test_tamper_matrix[row {i}]", when, outcome))
    c.pytest_runtest_logreport(_report(f"{t}::test_docs_mirror_the_matrix", "call", "passed"))
    c.pytest_runtest_logreport(_report(f"{t}::test_docs_mirror_the_matrix", "teardown", "failed"))
    item = SimpleNamespace(nodeid=f"{soak_cpu_suite.FUZZ_FILE}::test_x", hypothesis_statistics=STATS_OLD)
    c.note_statistics(item, "call")
    c.kills += ["writing", "commit", "commit"]
    c.after_kill["complete"] = 3
    counts = c.counts()
    assert counts["tamper_cases"] == 3 and counts["tamper_refused"] == 2
    assert counts["tamper_file_tests"] == 4 and counts["tamper_file_passed"] == 2  # teardown failure
    assert counts["fuzz_cases"] == 300 and counts["fuzz_tests"] == {"test_x": 300}
    assert counts["kill_points"] == 3 and counts["kill_phases"] == {"commit": 2, "writing": 1}
    assert counts["kill_loadable_partial"] == 0
    assert soak_cpu_suite.SuiteCounter().counts()["fuzz_cases"] is None  # no Hypothesis run: null, not 0


def test_crash_wrappers_classify_what_each_kill_left():
    from foundry_core.archive import ArchiveError, ArchiveNotFound

    c = soak_cpu_suite.SuiteCounter()
    results = iter(["ok", ArchiveNotFound("gone"), ArchiveError("damaged"), AssertionError("partial")])

    def check_complete(path, allowed):
        r = next(results)
        if isinstance(r, BaseException):
            raise r
        return r

    module = SimpleNamespace(kill_at=lambda *a: ("commit", {}), check_complete=check_complete)
    undo = c._wrap_crash(module)
    module.check_complete("p", set())  # not after a kill (the calibration run): not counted
    for exc in (ArchiveNotFound, ArchiveError, AssertionError):
        module.kill_at("p", "t", "entered", 0.1)
        with pytest.raises(exc):
            module.check_complete("p", set())
    undo()
    assert module.kill_at("p") == ("commit", {})  # restored
    assert c.after_kill == {"complete": 0, "absent": 1, "refused": 1, "loadable_partial": 1}
    assert c.counts()["kill_points"] == 3 and c.counts()["kill_loadable_partial"] == 1


def test_cli_soak_without_a_gpu_says_so(monkeypatch, capsys, tmp_path):
    from tool_commands import register_tool_commands

    register_tool_commands(monkeypatch, tmp_path)  # soak, through foundry_graphs.commands
    monkeypatch.setattr("foundry_tools.demo.gpu_available", lambda: False)
    assert cli.main(["soak", "--replays", "10", "--cycles", "2"]) == 2
    assert "no NVIDIA GPU" in capsys.readouterr().out


def test_cli_soak_defaults():
    import argparse

    from foundry_tools.options import DEFAULT_BATCH_SIZES, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    soak.add_soak_arguments(p)
    args = p.parse_args([])
    assert args.replays == 10_000 and args.cycles == 20 and args.warmup_cycles == 1
    assert tuple(args.batch_sizes) == DEFAULT_BATCH_SIZES


@pytest.mark.gpu
def test_soak_end_to_end(tmp_path, monkeypatch):
    """SAVE, LOAD + soak + cycles in fresh processes, on the tiny preset (the CPU suite is left out)."""
    from tool_commands import register_tool_commands

    register_tool_commands(monkeypatch, tmp_path / "entry_points")  # soak, through foundry_graphs.commands
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        "-m",
        "foundry_core.cli",
        "soak",
        "--preset",
        "tiny",
        "--batch-sizes",
        "1",
        "2",
        "8",
        "--replays",
        "300",
        "--cycles",
        "4",
        "--no-cpu-suite",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"no record\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["soak_replays"] == 300 and r["soak_mismatches"] == 0, r["soak"]
    assert r["native_logit_mismatches"] == 0
    assert r["cycles_completed"] == 4, r["cycle_error"]
    assert r["cycle_mismatches"] == 0
    assert r["device_mem_growth_bytes"] == 0, r["memory_curves"]
    assert r["pass"], r["criteria"]
    assert proc.returncode == 0


def test_orchestrate_assembles_and_prints_with_stub_workers(monkeypatch, tmp_path, capsys):
    """The parent's flow without a GPU: the two workers stubbed, the CPU suite left out."""
    import argparse

    from foundry_tools.options import add_arguments

    calls = []

    def fake_worker(cmd, errors):
        calls.append(cmd[3])
        return {"native_logit_mismatches": 0, "soak_s": 1.0} if cmd[3] == "save" else _load()

    monkeypatch.setattr(soak, "_run_worker", fake_worker)
    p = argparse.ArgumentParser()
    add_arguments(p)
    soak.add_soak_arguments(p)
    args = p.parse_args(["--cycles", "3", "--no-cpu-suite", "--workdir", str(tmp_path)])
    record, status = soak.orchestrate(args, commit="c0ffee", command="foundry soak --cycles 3")
    assert calls == ["save", "load"] and status == 0 and record["pass"]
    assert record["cpu_suite"]["notes"] == ["not run (--no-cpu-suite)"]
    json.dumps(record)
    soak.print_summary(record)
    assert "result: PASS" in capsys.readouterr().out


def _soak_args(*argv):
    import argparse

    from foundry_tools.options import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    soak.add_soak_arguments(p)
    return p.parse_args(list(argv))


def _stub_workers(monkeypatch):
    def fake_worker(cmd, errors):
        return {"native_logit_mismatches": 0, "soak_s": 1.0} if cmd[3] == "save" else _load()

    monkeypatch.setattr(soak, "_run_worker", fake_worker)


def test_without_tests_the_cpu_suite_is_skipped_and_says_how_to_run_it(monkeypatch, tmp_path, capsys):
    """The installed package reads no repository tests/: without --tests that phase does not run."""
    _stub_workers(monkeypatch)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"started {a}"))
    record, status = soak.orchestrate(
        _soak_args("--cycles", "3", "--workdir", str(tmp_path)), commit="c0ffee", command="foundry soak"
    )
    out = capsys.readouterr().out
    assert "CPU suite skipped" in out and "--tests" in out and "python -m foundry_tools.soak cpu-suite" in out
    assert status == 0 and record["pass"]
    assert record["cpu_suite"]["exit_status"] is None and "--tests" in record["cpu_suite"]["notes"][0]
    assert "cpu suite passed" not in record["criteria"] and record["tamper_cases"] is None


def test_tests_must_name_a_folder(monkeypatch, tmp_path):
    _stub_workers(monkeypatch)
    args = _soak_args("--tests", str(tmp_path / "nowhere"), "--workdir", str(tmp_path))
    with pytest.raises(SystemExit, match="no such folder"):
        soak.orchestrate(args, commit="c0ffee", command="foundry soak")


FAKE_MATRIX = """
import pytest


@pytest.mark.parametrize("row", ["flip", "truncate", "swap"])
def test_tamper_matrix(row):
    assert row != "swap"  # one row not refused


def test_docs_mirror_the_matrix():
    pass
"""

FAKE_CRASH = """
def kill_at(*args):
    return "commit", {}


def check_complete(*args):
    return "complete"


def test_sigkill_during_save_never_leaves_a_partial_archive():
    kill_at()
    assert check_complete() == "complete"
"""


def test_cpu_suite_runs_the_tests_named_by_tests(monkeypatch, tmp_path):
    """--tests DIR: the suite runs that folder's files alongside (a real subprocess), counted, with the
    missing file noted; the stand-in matrix has a row that is not refused, so the run fails."""
    tests = tmp_path / "checkout" / "tests"
    tests.mkdir(parents=True)
    (tests / soak_cpu_suite.TAMPER_FILE).write_text(FAKE_MATRIX)
    (tests / soak_cpu_suite.CRASH_FILE).write_text(FAKE_CRASH)  # no fuzz file: noted, and the suite fails
    _stub_workers(monkeypatch)
    workdir = tmp_path / "work"
    args = _soak_args("--cycles", "3", "--tests", str(tests), "--workdir", str(workdir))
    record, status = soak.orchestrate(args, commit="c0ffee", command="foundry soak --tests ...")
    cpu = record["cpu_suite"]
    assert cpu["counts"]["tamper_cases"] == 3 and cpu["counts"]["tamper_refused"] == 2, cpu
    assert cpu["counts"]["tamper_file_tests"] == 4 and cpu["counts"]["crash_file_passed"] == 1
    assert cpu["counts"]["kill_points"] == 1 and cpu["counts"]["kill_outcomes"]["complete"] == 1
    assert any(soak_cpu_suite.FUZZ_FILE in note for note in cpu["notes"]), cpu["notes"]
    assert str(tests.parent) in cpu["command"]
    assert cpu["exit_status"] != 0 and status == 1 and not record["pass"]
    assert not record["criteria"]["tamper_refused == tamper_cases"]
    assert not record["criteria"]["cpu suite passed"]
    assert (workdir / "cpu-suite.json").exists()


def test_worker_commands_repeat_the_workload_options_exactly():
    # The SAVE and LOAD workers must rebuild the same model, sizes and region as the parent parsed.
    import argparse

    from foundry_tools import demo, options

    parent = argparse.ArgumentParser()
    options.add_arguments(parent)
    options.add_soak_arguments(parent)
    args = parent.parse_args(
        ["--preset", "tiny", "--seed", "7", "--region-base", "0x610000000000", "--batch-sizes", "1", "3", "8"]
    )
    keys = ("variant", "preset", "max_seq_len", "seed", "device", "region_base", "region_size", "batch_sizes")
    for cmd in (demo._worker_args(args, "save", "/a", "/r"), soak._worker_cmd(args, "load", "/a", "/b")):
        worker = argparse.ArgumentParser()
        options.add_arguments(worker)
        options.add_soak_arguments(worker)
        worker.add_argument("phase")
        worker.add_argument("--reference")
        worker.add_argument("--baseline")
        got = worker.parse_args(cmd[3:])
        assert {k: getattr(got, k) for k in keys} == {k: getattr(args, k) for k in keys}
        assert got.phase == cmd[3] and got.archive == "/a"
