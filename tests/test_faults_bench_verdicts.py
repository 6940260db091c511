"""benchmarks/engine_faults.py without an engine or a GPU: verdicts, the budget's estimates and skips, the
assembled result."""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import faults_context  # noqa: E402
import faults_result  # noqa: E402
import faults_runner  # noqa: E402
import faults_verdicts  # noqa: E402


def test_verdict_and_kill_rules():
    assert faults_verdicts.verdict({"a": True, "b": True}) == "pass"
    assert faults_verdicts.verdict({"a": True, "b": None}) == "inconclusive"
    assert faults_verdicts.verdict({"a": None, "b": False}) == "fail"
    assert faults_verdicts.verdict({}) == "inconclusive"
    complete = {"state_after": {"complete": True}}
    partial = {"state_after": {"complete": False}}
    assert (
        faults_verdicts.restart_ok(partial, "save") is True
        and faults_verdicts.restart_ok(complete, "save") is True
    )
    assert faults_verdicts.restart_ok(partial, "load") is False  # a LOAD of what a killed SAVE left
    assert (
        faults_verdicts.restart_ok(complete, "load") is True
        and faults_verdicts.restart_ok(partial, None) is None
    )
    assert faults_verdicts.requests_equal({}) is None
    assert faults_verdicts.requests_equal({"requests": [{"equal": True}, {"equal": False}]}) is False
    rec = {
        "ready_s": None,
        "exited_by_itself": True,
        "exit_code": 1,
        "facts": {"lines": {"save_refused": {}}},
    }
    assert faults_verdicts.refused_cleanly(rec, "save_refused") == {
        "never_ready": True,
        "exited_nonzero": True,
        "line": True,
    }
    served = {"ready_s": 3.0, "exited_by_itself": False, "exit_code": -15, "facts": {"lines": {}}}
    assert faults_verdicts.refused_cleanly(served, "save_refused") == {
        "never_ready": False,
        "exited_nonzero": False,
        "line": False,
    }


def test_estimates_and_skipping():
    opts = types.SimpleNamespace(kill_points=["persisting", "published"], sustain=100.0)
    times = {"save": 100.0, "load": 50.0, "refuse": 30.0}
    assert faults_runner.estimate_s("kill_during_save", opts, times) == 300 + faults_context.MARGIN_S
    assert faults_runner.estimate_s("sustained_load", opts, times) == 160 + faults_context.MARGIN_S
    ctx = types.SimpleNamespace(opts=opts, times=times, left=lambda: 200.0)
    assert (
        faults_runner.skip_reason("archive_replaced", ctx, True)
        == "skipped: needs about 245 s, 200 s of the budget left"
    )
    assert faults_runner.skip_reason("damaged_cache", ctx, True) is None
    assert "base SAVE" in faults_runner.skip_reason("damaged_cache", ctx, False)


def test_assemble_and_summary():
    meta = {"engine": "sglang", "cases_requested": ["disk_full", "two_replicas"]}
    cases = {
        "two_replicas": {"verdict": "fail", "not_passed_checks": ["exactly_one_published"], "seconds": 3},
        "disk_full": {"verdict": "pass", "seconds": 2},
    }
    out = faults_result.assemble(meta, {"ok": True}, cases)
    assert list(out["cases"]) == ["disk_full", "two_replicas"] and out["all_passed"] is False
    assert out["summary"]["fail"] == ["two_replicas"] and out["verdicts"]["disk_full"] == "pass"
    lines = faults_result.summary_lines(out)
    assert "two_replicas: fail (3 s) exactly_one_published" in lines[-1]
    cases["two_replicas"]["verdict"] = "pass"
    assert faults_result.assemble(meta, None, cases)["all_passed"] is True
    assert (
        faults_result.assemble({**meta, "cases_requested": ["damaged_cache"]}, None, cases)["all_passed"]
        is False
    )
