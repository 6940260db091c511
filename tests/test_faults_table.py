"""The table mode of benchmarks/engine_faults.py (issue 19): one row per case and engine, derived from
the per-engine results without a GPU. Synthetic results here mirror the keys the case functions
write; the real vLLM result from the H200 is read as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_faults  # noqa: E402  (benchmarks/ is no package)
from faults_catalog import CASES, ENGINES  # noqa: E402
from faults_result import assemble  # noqa: E402
from faults_table import _one, build_table, table_row  # noqa: E402
from faults_verdicts import restart_ok, verdict  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REAL_VLLM = RESULTS / "faults-vllm-h200-8d3f0b9.json"
REAL_VLLM_FILE = "benchmarks/results/faults-vllm-h200-8d3f0b9.json"
TABLE = RESULTS / "faults-h200.json"


# --- synthetic results, shaped as the case functions write them ----------------------------------------------


def _state(*, complete: bool = False, loadable_partial: bool = False, any_archive: bool = False) -> dict:
    return {
        "complete": complete,
        "consistent": complete,
        "loadable_partial": loadable_partial,
        "any_archive": any_archive or complete or loadable_partial,
    }


def _server(ready: bool = True, equal: list[bool] | None = None, error: bool = False) -> dict:
    rec: dict = {"ready_s": 12.5 if ready else None}
    requests = [{"what": "request", "equal": e} for e in (equal or [])]
    if error:
        requests.append({"what": "request", "error": "OSError: refused", "equal": False})
    if requests:
        rec["requests"] = requests
    return rec


def _case(name: str, checks: dict, details: dict | None = None, servers: dict | None = None, **extra) -> dict:
    rec = {
        "name": name,
        "checks": checks,
        "details": details or {},
        "servers": servers or {},
        "seconds": 42.0,
        "verdict": verdict(checks),
        "not_passed_checks": [k for k, v in checks.items() if v is not True],
    }
    rec.update(extra)
    return rec


def kill_case(*, partial: bool = False, restart_mode: str = "save", complete_at_kill: bool = False) -> dict:
    state = _state(complete=complete_at_kill, loadable_partial=partial, any_archive=True)
    kills = [
        {
            "point": "persisting",
            "reached": True,
            "t_s": 60.0,
            "state_after": state,
            "server": "target0-persisting",
            "restart": "restart",
            "restart_mode": restart_mode,
            "restart_ok": restart_ok({"state_after": state}, restart_mode),
        }
    ]
    checks = {
        "kill_persisting_reached": True,
        "restart_after_persisting_saves_or_loads_only_complete": kills[0]["restart_ok"],
        "no_loadable_partial_after_persisting": not partial,
        "restart_served": True,
        "restart_outputs_equal_reference": True,
        "archive_complete_and_consistent_after_restart": True,
    }
    details = {"kills": kills, "state_after_restart": _state(complete=True)}
    return _case("kill_during_save", checks, details, {"restart": _server(equal=[True])})


def disk_full_case(*, auto_left: bool = False, auto_partial: bool = False) -> dict:
    checks = {
        "auto_saved_then_failed": True,
        "auto_served": True,
        "auto_outputs_equal_reference": True,
        "auto_left_no_archive": not auto_left,
        "save_never_ready": True,
        "save_exited_nonzero": True,
        "save_line": True,
        "save_left_no_archive": True,
    }
    details = {
        "state_auto": _state(any_archive=auto_left, loadable_partial=auto_partial),
        "state_save": _state(),
    }
    return _case("disk_full", checks, details)


def read_only_case(*, wrote_checks: bool = True, save_served: bool = False) -> dict:
    checks = {
        "auto_warned": True,
        "auto_served": True,
        "auto_outputs_equal_reference": True,
        "save_never_ready": not save_served,
        "save_exited_nonzero": not save_served,
        "save_line": not save_served,
    }
    method = "read-only bind mount" if wrote_checks else "a path under /proc (cannot be created)"
    if wrote_checks:
        checks.update(auto_wrote_nothing=True, save_wrote_nothing=True)
    details = {"dirs": {k: {"dir": f"/x/{k}", "method": method, "notes": []} for k in ("auto", "save")}}
    return _case("read_only_dir", checks, details)


def two_replicas_case() -> dict:
    checks = {
        "both_ready": True,
        "both_outputs_equal_reference": True,
        "exactly_one_published": True,
        "archive_consistent": True,
        "cli_verify_ok": True,
    }
    return _case("two_replicas", checks, {"state": _state(complete=True)})


def archive_replaced_case(*, save_equal: bool = True) -> dict:
    checks = {
        "load_loaded": True,
        "load_outputs_equal_reference_throughout": True,
        "save_served": True,
        "save_published": True,
        "graph_digest_changed": True,
        "next_loaded": True,
        "next_outputs_equal_reference": True,
        "next_report_caches_digest_is_the_new_one": True,
    }
    servers = {
        "load": _server(equal=[True, True, True]),
        "save": _server(equal=[save_equal]),
        "next": _server(equal=[True]),
    }
    details = {"state_before": _state(complete=True), "state_after": _state(complete=True)}
    return _case("archive_replaced", checks, details, servers)


def damaged_cache_case(*, load_served: bool = False) -> dict:
    checks = {
        "auto_warned_naming_the_damage": True,
        "auto_loaded_graphs": True,
        "auto_served": True,
        "auto_outputs_equal_reference": True,
        "auto_compiled_as_usual": True,
        "load_never_ready": not load_served,
        "load_exited_nonzero": not load_served,
        "load_line": not load_served,
    }
    return _case("damaged_cache", checks, {"flipped": {"member": "x", "offset": 3}})


def sustained_case(*, mismatches: int = 0, growth: float | None = 0.0) -> dict:
    checks = {
        "loaded": True,
        "no_request_errors": True,
        "outputs_equal_reference": mismatches == 0,
        "memory_growth_under_256_mib": None if growth is None else growth <= 256,
    }
    details = {
        "seconds": 120.3,
        "passes": 50,
        "requests": 300,
        "errors": 0,
        "mismatches": mismatches,
        "memory_key": "server_mib",
        "memory_growth_mib": growth,
    }
    return _case("sustained_load", checks, details)


def result(engine: str, cases: dict, **meta) -> dict:
    out = {
        "date": "2026-12-04T10:00:00+00:00",
        "commit": "abc1234",
        "machine": "1x NVIDIA H200, driver 580.159.04; host vm",
        "command": f"benchmarks/engine_faults.py --engine {engine} --out x.json --logs l",
        "engine": engine,
        "engine_version": "9.9.9",
        "cases_requested": [c for c in CASES if c in cases],
        "options": {"cases": [c for c in CASES if c in cases]},
        "base": {"ok": True},
    }
    out.update(meta)
    return assemble(out, out.pop("base"), cases)


def rows_by(table: dict) -> dict[tuple[str, str], dict]:
    return {(r["case"], r["engine"]): r for r in table["rows"]}


def all_good() -> dict:
    return {
        "kill_during_save": kill_case(),
        "disk_full": disk_full_case(),
        "read_only_dir": read_only_case(),
        "two_replicas": two_replicas_case(),
        "archive_replaced": archive_replaced_case(),
        "damaged_cache": damaged_cache_case(),
        "sustained_load": sustained_case(),
    }


# --- rows ---------------------------------------------------------------------------------------------------------


def test_every_case_passing_on_both_engines_passes_the_table():
    table = build_table(
        {e: [(f"faults-{e}.json", result(e, all_good()))] for e in ENGINES},
        "benchmarks/engine_faults.py table",
    )
    assert [(r["case"], r["engine"]) for r in table["rows"]] == [(c, e) for c in CASES for e in ENGINES]
    assert table["all_required_rows_passed"] is True and table["not_passed"] == []
    assert table["counts"]["pass"] == len(CASES) * len(ENGINES)
    assert table["partial_archive_loadable_anywhere"] is False
    rows = rows_by(table)
    for engine in ENGINES:
        for case in ("kill_during_save", "disk_full", "read_only_dir", "two_replicas", "archive_replaced"):
            r = rows[(case, engine)]
            assert (r["partial_archive_loadable"], r["served_after"], r["outputs_identical"]) == (
                False,
                True,
                True,
            )
        for case in ("damaged_cache", "sustained_load"):  # no partial archive in these cases
            r = rows[(case, engine)]
            assert r["partial_archive_loadable"] is None and "does not apply" in r["notes"]
            assert (r["served_after"], r["outputs_identical"]) == (True, True)
        assert rows[("disk_full", engine)]["strict_mode_refused"] is True
        assert rows[("damaged_cache", engine)]["strict_mode_refused"] is True
        assert rows[("kill_during_save", engine)]["strict_mode_refused"] is None
        s = rows[("sustained_load", engine)]
        assert (s["requests"], s["duration_s"], s["mismatches"], s["device_memory_growth_mib"]) == (
            300,
            120.3,
            0,
            0.0,
        )
        assert s["request_errors"] == 0 and "processes" in s["device_memory_measure"]
    # Common metadata: one value; it would name each engine's if they differed.
    assert table["commit"] == "abc1234" and table["machine"].startswith("1x NVIDIA H200")


def test_an_engine_without_a_result_keeps_the_table_from_passing():
    table = build_table({"vllm": [("v.json", result("vllm", all_good()))]}, "t")
    assert table["all_required_rows_passed"] is False and table["counts"]["pass"] == len(CASES)
    assert table["not_passed"] == [f"sglang/{c}: not run" for c in CASES]


def test_a_loadable_partial_archive_is_reported_true_and_the_case_does_not_pass():
    cases = {"kill_during_save": kill_case(partial=True)}
    r = rows_by(build_table({"vllm": [("v.json", result("vllm", cases))]}, "t"))[("kill_during_save", "vllm")]
    assert r["partial_archive_loadable"] is True and r["outcome"] == "fail"
    assert "no_loadable_partial_after_persisting" in r["checks_not_passed"]
    # A restart that LOADed what was incomplete at the kill counts too (its own check fails).
    cases = {"kill_during_save": kill_case(restart_mode="load", complete_at_kill=False)}
    table = build_table({"vllm": [("v.json", result("vllm", cases))]}, "t")
    r = rows_by(table)[("kill_during_save", "vllm")]
    assert r["partial_archive_loadable"] is True and r["outcome"] == "fail"
    assert "LOADed an incomplete archive" in r["notes"] and table["partial_archive_loadable_anywhere"] is True
    # ... while a restart that LOADed a complete archive (kill after the record) is no partial.
    cases = {"kill_during_save": kill_case(restart_mode="load", complete_at_kill=True)}
    r = rows_by(build_table({"vllm": [("v.json", result("vllm", cases))]}, "t"))[("kill_during_save", "vllm")]
    assert r["partial_archive_loadable"] is False and r["outcome"] == "pass"


def test_derived_fields_follow_the_checks():
    cases = {
        "disk_full": disk_full_case(auto_left=True, auto_partial=False),
        "read_only_dir": read_only_case(wrote_checks=False, save_served=True),
        "archive_replaced": archive_replaced_case(save_equal=False),
        "damaged_cache": damaged_cache_case(load_served=True),
        "sustained_load": sustained_case(mismatches=2, growth=None),
    }
    rows = rows_by(build_table({"sglang": [("s.json", result("sglang", cases))]}, "t"))
    r = rows[("disk_full", "sglang")]  # something was left, but it does not load: fails, not partial
    assert r["outcome"] == "fail" and r["partial_archive_loadable"] is False and "left" in r["notes"]
    r = rows[("read_only_dir", "sglang")]  # no write check with this method: unknown, said so
    assert r["partial_archive_loadable"] is None and "/proc" in r["notes"]
    assert r["strict_mode_refused"] is False and r["served_after"] is True and r["outcome"] == "fail"
    r = rows[("archive_replaced", "sglang")]  # the SAVE's answer differed: not a check, but not identical
    assert r["outcome"] == "pass" and r["outputs_identical"] is False and r["served_after"] is True
    r = rows[("damaged_cache", "sglang")]
    assert r["strict_mode_refused"] is False and r["outcome"] == "fail"
    s = rows[("sustained_load", "sglang")]
    assert s["mismatches"] == 2 and s["outputs_identical"] is False and s["outcome"] == "fail"
    assert s["device_memory_growth_mib"] is None and s["memory_growth_under_256_mib"] is None


def test_sustained_load_judged_against_stock_says_so():
    rec = sustained_case()
    rec["checks"]["outputs_equal_stock"] = True
    rec["details"]["reference"] = "stock server"
    row = table_row("sustained_load", "sglang", result("sglang", {"sustained_load": rec}), "s.json")
    assert row["outcome"] == "pass" and row["outputs_identical"] is True and row["mismatches"] == 0
    assert "against the stock server's (no base reference)" in row["notes"]
    rec["details"]["reference"] = "base SAVE server"
    row = table_row("sustained_load", "sglang", result("sglang", {"sustained_load": rec}), "s.json")
    assert "stock server" not in row["notes"]


def test_servers_that_did_not_serve():
    rec = archive_replaced_case()
    rec["servers"]["load"]["requests"].append({"what": "while", "error": "OSError: reset", "equal": False})
    rec["checks"]["load_outputs_equal_reference_throughout"] = False
    rec["verdict"] = verdict(rec["checks"])
    row = table_row("archive_replaced", "vllm", result("vllm", {"archive_replaced": rec}), "v.json")
    assert row["served_after"] is False and row["outputs_identical"] is False and row["outcome"] == "fail"
    # A LOAD server that never became ready: the case stops there with one check.
    rec = _case("archive_replaced", {"load_served": False}, servers={"load": _server(ready=False)})
    row = table_row("archive_replaced", "vllm", result("vllm", {"archive_replaced": rec}), "v.json")
    assert row["served_after"] is False and row["outputs_identical"] is None
    rec = _case("sustained_load", {"served": False})
    row = table_row("sustained_load", "vllm", result("vllm", {"sustained_load": rec}), "v.json")
    assert row["served_after"] is False and row["mismatches"] is None and row["requests"] is None


def test_missing_engines_cases_and_unfinished_cases_are_null_rows():
    cases = {
        "kill_during_save": kill_case(),
        "two_replicas": {
            "name": "two_replicas",
            "verdict": "skipped",
            "reason": "skipped: needs about 163 s",
        },
        "archive_replaced": {"name": "archive_replaced", "checks": {}, "details": {}, "started_s": 3.0},
        "damaged_cache": {**damaged_cache_case(), "verdict": "error", "error": "RuntimeError: boom"},
    }
    r = result("vllm", cases, cases_requested=[*cases, "disk_full"])
    table = build_table({"vllm": [("v.json", r)]}, "t")
    rows = rows_by(table)
    null_fields = ("partial_archive_loadable", "served_after", "outputs_identical", "seconds")
    for case in CASES:
        s = rows[(case, "sglang")]
        assert s["outcome"] == "not run" and s["reason"] == "no result for sglang"
        assert all(s[f] is None for f in null_fields) and s["source"] is None
        assert s["commit"] is None and s["date"] is None
    assert table["sources"]["sglang"] == [] and [x["file"] for x in table["sources"]["vllm"]] == ["v.json"]
    skipped = rows[("two_replicas", "vllm")]
    assert skipped["outcome"] == "skipped" and skipped["reason"].startswith("skipped: needs about")
    assert all(skipped[f] is None for f in null_fields)
    assert rows[("archive_replaced", "vllm")]["outcome"] == "not run"
    assert "no verdict" in rows[("archive_replaced", "vllm")]["reason"]
    assert "before the case started" in rows[("disk_full", "vllm")]["reason"]
    assert rows[("read_only_dir", "vllm")]["reason"] == "not requested"
    sustained = rows[("sustained_load", "vllm")]
    assert (
        "--cases" in sustained["reason"] and sustained["requests"] is None and sustained["mismatches"] is None
    )
    err = rows[("damaged_cache", "vllm")]
    assert err["outcome"] == "error" and err["reason"] == "RuntimeError: boom" and err["served_after"] is True
    assert table["all_required_rows_passed"] is False
    assert table["counts"]["not run"] == len(CASES) + 4 and table["counts"]["pass"] == 1
    assert "sglang/kill_during_save: not run" in table["not_passed"]


def test_metadata_from_both_engines_and_a_resumed_call():
    s = result("sglang", {"disk_full": disk_full_case()}, commit="def5678")
    v = result(
        "vllm",
        {"kill_during_save": kill_case(), "read_only_dir": read_only_case()},
        options={"cases": ["read_only_dir"]},
        command="second --resume",
        resumed_from={"date": "d0", "command": "first", "elapsed_s": 10.0},
    )
    table = build_table({"sglang": [("s.json", s)], "vllm": [("v.json", v)]}, "the command")
    assert table["commit"] == "sglang: def5678; vllm: abc1234" and table["command"] == "the command"
    assert table["date"] == "2026-12-04T10:00:00+00:00" and table["built"]["date"]
    assert table["sources"]["vllm"][0]["commands"] == ["first", "second --resume"]
    assert table["sources"]["sglang"][0]["commands"] == [s["command"]]
    rows = rows_by(table)
    assert rows[("kill_during_save", "vllm")]["call"] == "earlier"
    assert (
        rows[("read_only_dir", "vllm")]["call"] == "last" and rows[("disk_full", "sglang")]["call"] == "last"
    )


# --- several results of one engine --------------------------------------------------------------------------------


def skipped(name: str, reason: str = "skipped: needs about 163 s, 130 s of the budget left") -> dict:
    return {"name": name, "verdict": "skipped", "reason": reason}


def first_vllm_call() -> dict:
    """Shaped as the H200 call at 8d3f0b9: three cases passed, three skipped for the budget."""
    cases = {
        "kill_during_save": kill_case(),
        "disk_full": disk_full_case(),
        "read_only_dir": read_only_case(),
        **{c: skipped(c) for c in ("two_replicas", "archive_replaced", "damaged_cache")},
    }
    return result("vllm", cases, date="2026-12-03T16:02:55+00:00", commit="8d3f0b9")


def test_a_newer_result_fills_in_the_cases_an_older_one_skipped():
    old = first_vllm_call()
    new = result(
        "vllm",
        {
            "two_replicas": two_replicas_case(),
            "archive_replaced": archive_replaced_case(),
            "damaged_cache": damaged_cache_case(),
        },
        date="2026-12-05T09:00:00+00:00",
        commit="1234567",
    )
    # Given newest first: the order of the files does not matter, their dates do.
    table = build_table({"vllm": [("new.json", new), ("old.json", old)]}, "t")
    rows = rows_by(table)
    for case in ("kill_during_save", "disk_full", "read_only_dir"):
        r = rows[(case, "vllm")]
        assert r["outcome"] == "pass" and r["partial_archive_loadable"] is False
        assert (r["source"], r["commit"], r["date"]) == ("old.json", "8d3f0b9", old["date"])
    for case in ("two_replicas", "archive_replaced", "damaged_cache"):
        r = rows[(case, "vllm")]
        assert r["outcome"] == "pass" and r["served_after"] is True and r["reason"] is None
        assert (r["source"], r["commit"], r["date"]) == ("new.json", "1234567", new["date"])
    # Ran by neither: the newest result's reason.
    r = rows[("sustained_load", "vllm")]
    assert r["outcome"] == "not run" and r["source"] == "new.json" and "--cases" in r["reason"]
    assert table["counts"]["pass"] == 6 and table["not_passed"][-1] == "vllm/sustained_load: not run"
    # sources: per engine a list, oldest first; the top level lists what differs.
    assert [s["file"] for s in table["sources"]["vllm"]] == ["old.json", "new.json"]
    assert [s["commit"] for s in table["sources"]["vllm"]] == ["8d3f0b9", "1234567"]
    assert table["sources"]["sglang"] == []
    assert table["commit"] == "vllm: 8d3f0b9; vllm: 1234567"
    assert table["date"] == f"vllm: {old['date']}; vllm: {new['date']}"
    assert table["machine"] == old["machine"] == new["machine"]


@pytest.mark.parametrize(
    ("older", "newer"),
    [("pass", "fail"), ("fail", "pass"), ("pass", "error"), ("pass", "inconclusive")],
)
def test_the_newest_run_verdict_wins_whatever_it_is(older, newer):
    def run(verdict: str) -> dict:
        if verdict == "fail":
            return kill_case(partial=True)
        rec = kill_case()
        if verdict == "error":
            rec.update(verdict="error", error="RuntimeError: the engine died")
        elif verdict == "inconclusive":
            rec.update(verdict="inconclusive")
        return rec

    # The newer date is the earlier instant in UTC text order only: dates are compared as times.
    old = result("vllm", {"kill_during_save": run(older)}, date="2026-12-05T01:00:00+02:00", commit="aaa")
    new = result("vllm", {"kill_during_save": run(newer)}, date="2026-12-04T23:30:00+00:00", commit="bbb")
    for given in ([("o.json", old), ("n.json", new)], [("n.json", new), ("o.json", old)]):
        r = rows_by(build_table({"vllm": given}, "t"))[("kill_during_save", "vllm")]
        assert (r["outcome"], r["source"], r["commit"]) == (newer, "n.json", "bbb")
        assert r["partial_archive_loadable"] is (newer == "fail")


def test_a_case_a_newer_result_did_not_run_keeps_the_older_run_verdict():
    """Skipped (for the budget), started but not finished, requested but not reached, or not requested
    in the newer result: the row keeps the older result's run verdict (a pass here, and a fail)."""
    old = result(
        "vllm",
        {
            "two_replicas": two_replicas_case(),
            "archive_replaced": archive_replaced_case(),
            "disk_full": disk_full_case(),
            "read_only_dir": read_only_case(save_served=True),  # a fail
            "damaged_cache": skipped("damaged_cache", "skipped: the older one"),
        },
        date="2026-12-03T10:00:00+00:00",
        commit="aaa",
    )
    new = result(
        "vllm",
        {
            "two_replicas": skipped("two_replicas"),
            "archive_replaced": {"name": "archive_replaced", "checks": {}, "details": {}, "started_s": 3.0},
            "read_only_dir": skipped("read_only_dir"),
            "damaged_cache": skipped("damaged_cache", "skipped: the newer one"),
            "kill_during_save": skipped(
                "kill_during_save", "skipped: the base SAVE did not give a reference"
            ),
        },
        date="2026-12-04T10:00:00+00:00",
        commit="bbb",
        cases_requested=[
            "two_replicas",
            "archive_replaced",
            "read_only_dir",
            "damaged_cache",
            "kill_during_save",
            "disk_full",
        ],
    )
    rows = rows_by(build_table({"vllm": [("o.json", old), ("n.json", new)]}, "t"))
    for case, outcome in [
        ("two_replicas", "pass"),
        ("archive_replaced", "pass"),
        ("disk_full", "pass"),
        ("read_only_dir", "fail"),
    ]:
        r = rows[(case, "vllm")]
        assert (r["outcome"], r["source"], r["commit"]) == (outcome, "o.json", "aaa"), case
        assert r["served_after"] is True and r["seconds"] == 42.0
    # Ran by neither: the newest that mentions it, with its reason.
    r = rows[("damaged_cache", "vllm")]
    assert (r["outcome"], r["reason"], r["commit"]) == ("skipped", "skipped: the newer one", "bbb")
    r = rows[("kill_during_save", "vllm")]
    assert r["outcome"] == "skipped" and "base SAVE" in r["reason"] and r["source"] == "n.json"
    # An older skip is still named when the newer result does not mention the case at all.
    newest = result("vllm", {"sustained_load": sustained_case()}, date="2026-12-06T10:00:00+00:00")
    rows = rows_by(build_table({"vllm": [("o.json", old), ("n.json", new), ("s.json", newest)]}, "t"))
    r = rows[("damaged_cache", "vllm")]
    assert (r["outcome"], r["reason"], r["source"]) == ("skipped", "skipped: the newer one", "n.json")
    assert rows[("two_replicas", "vllm")]["source"] == "o.json"
    assert rows[("sustained_load", "vllm")]["outcome"] == "pass"
    assert rows[("sustained_load", "vllm")]["source"] == "s.json"


def test_the_top_level_metadata_lists_every_source_once():
    s = result("sglang", {"disk_full": disk_full_case()}, commit="fff")
    v1 = result("vllm", {"disk_full": disk_full_case()}, commit="aaa", date="2026-12-01T00:00:00+00:00")
    v2 = result("vllm", {"read_only_dir": read_only_case()}, commit="aaa", date="2026-12-02T00:00:00+00:00")
    table = build_table({"vllm": [("v2.json", v2), ("v1.json", v1)], "sglang": [("s.json", s)]}, "t")
    assert table["commit"] == "sglang: fff; vllm: aaa"
    assert table["date"] == (
        f"sglang: {s['date']}; vllm: 2026-12-01T00:00:00+00:00; vllm: 2026-12-02T00:00:00+00:00"
    )
    assert table["machine"] == s["machine"]
    assert _one([]) is None and _one([("vllm", None)]) is None
    assert _one([("sglang", "x"), ("vllm", "x"), ("vllm", None)]) == "x"


# --- the real vLLM result of the H200 ----------------------------------------------------------------------------


def test_the_real_vllm_result():
    real = json.loads(REAL_VLLM.read_text())
    table = build_table({"vllm": [(REAL_VLLM_FILE, real)]}, "t")
    rows = rows_by(table)
    assert (table["commit"], table["date"][:10]) == ("8d3f0b9", "2026-12-03")
    [source] = table["sources"]["vllm"]
    assert "H200" in table["machine"] and source["engine_version"] == "0.26.0"
    assert len(source["commands"]) == 2 and "--resume" in source["command"]
    assert {(r["source"], r["commit"], r["date"]) for r in rows.values() if r["engine"] == "vllm"} == {
        (REAL_VLLM_FILE, "8d3f0b9", real["date"])
    }
    for case in ("kill_during_save", "disk_full", "read_only_dir"):
        r = rows[(case, "vllm")]
        assert r["outcome"] == "pass" == real["cases"][case]["verdict"]
        assert (r["partial_archive_loadable"], r["served_after"], r["outputs_identical"]) == (
            False,
            True,
            True,
        )
        assert r["seconds"] == real["cases"][case]["seconds"] and r["checks_not_passed"] == []
    checks = real["cases"]["kill_during_save"]["checks"]
    assert rows[("kill_during_save", "vllm")]["served_after"] is checks["restart_served"]
    assert rows[("disk_full", "vllm")]["strict_mode_refused"] is True
    assert [rows[(c, "vllm")]["call"] for c in ("kill_during_save", "disk_full", "read_only_dir")] == [
        "earlier",
        "earlier",
        "last",
    ]
    for case in ("two_replicas", "archive_replaced", "damaged_cache"):
        r = rows[(case, "vllm")]
        assert r["outcome"] == "skipped" and "budget" in r["reason"] and r["served_after"] is None
    assert rows[("sustained_load", "vllm")]["outcome"] == "not run"
    assert rows[("sustained_load", "vllm")]["mismatches"] is None
    assert all(rows[(c, "sglang")]["outcome"] == "not run" for c in CASES)
    assert table["counts"] == {
        "pass": 3,
        "fail": 0,
        "inconclusive": 0,
        "skipped": 3,
        "error": 0,
        "not run": 8,
    }
    assert table["all_required_rows_passed"] is False and table["partial_archive_loadable_anywhere"] is False


def test_the_committed_table_is_what_the_table_mode_makes_of_its_sources():
    table = json.loads(TABLE.read_text())
    results = {
        e: [(s["file"], json.loads((ROOT / s["file"]).read_text())) for s in sources]
        for e, sources in table["sources"].items()
    }
    # Every committed per-engine result is one of the table's sources (the glob of its command).
    committed = sorted(f"benchmarks/results/{f.name}" for f in RESULTS.glob("faults-*-h200*.json"))
    assert REAL_VLLM_FILE in committed and TABLE.name not in {Path(f).name for f in committed}
    assert sorted(s["file"] for sources in table["sources"].values() for s in sources) == committed
    again = build_table(results, table["command"])
    for key in ("date", "commit", "machine", "sources", "rows", "counts", "all_required_rows_passed"):
        assert again[key] == table[key], key
    assert table["command"].startswith(
        "benchmarks/engine_faults.py table --out benchmarks/results/faults-h200.json"
    )


# --- the command line ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine_faults.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_the_table_command_writes_the_file(tmp_path):
    sglang = tmp_path / "faults-sglang-h200.json"
    sglang.write_text(json.dumps(result("sglang", all_good())))
    out = tmp_path / "table" / "faults-h200.json"
    done = _cli("table", "--out", str(out), str(sglang), str(REAL_VLLM), str(out))  # itself: left out
    assert done.returncode == 0, done.stderr
    assert "| kill_during_save | vllm | pass | no | yes | yes | 149.1 |" in done.stdout
    table = json.loads(out.read_text())
    assert len(table["rows"]) == len(CASES) * len(ENGINES)
    assert [s["file"] for s in table["sources"]["vllm"]] == [REAL_VLLM_FILE]
    assert [s["file"] for s in table["sources"]["sglang"]] == [str(sglang)]
    assert table["command"].startswith("benchmarks/engine_faults.py table --out ")
    assert table["commit"] == "sglang: abc1234; vllm: 8d3f0b9"
    assert rows_by(table)[("sustained_load", "sglang")]["outcome"] == "pass"
    assert table["all_required_rows_passed"] is False  # vLLM's skipped and missing cases


def test_the_table_command_combines_results_of_one_engine(tmp_path):
    newer = tmp_path / "faults-vllm-h200-1234567.json"
    cases = {"two_replicas": two_replicas_case(), "disk_full": disk_full_case(auto_left=True)}  # a fail
    newer.write_text(json.dumps(result("vllm", cases, date="2026-12-05T09:00:00+00:00", commit="1234567")))
    out = tmp_path / "faults-h200.json"
    done = _cli("table", "--out", str(out), str(newer), str(REAL_VLLM))
    assert done.returncode == 0, done.stderr
    assert "| kill_during_save | vllm | pass | no | yes | yes | 149.1 | 8d3f0b9 |" in done.stdout
    assert "| two_replicas | vllm | pass | no | yes | yes | 42.0 | 1234567 |" in done.stdout
    assert "from 2 results" in done.stdout
    table = json.loads(out.read_text())
    assert [s["file"] for s in table["sources"]["vllm"]] == [REAL_VLLM_FILE, str(newer)]
    rows = rows_by(table)
    assert (rows[("disk_full", "vllm")]["outcome"], rows[("disk_full", "vllm")]["commit"]) == (
        "fail",
        "1234567",
    )
    assert rows[("archive_replaced", "vllm")]["outcome"] == "skipped"  # ran by neither: the older skip
    assert rows[("archive_replaced", "vllm")]["commit"] == "8d3f0b9"
    assert table["commit"] == "vllm: 8d3f0b9; vllm: 1234567"


@pytest.mark.parametrize("what", ["copy", "twice", "not_a_result", "missing"])
def test_the_table_command_refuses_bad_inputs(tmp_path, what):
    """Two results of one engine with the same date and commit are one result given twice (a copy, or
    the same file); a file that is not a result, or missing, is refused too."""
    other = tmp_path / "other.json"
    if what == "copy":
        other.write_text(REAL_VLLM.read_text())
    elif what == "twice":
        other = REAL_VLLM
    elif what == "not_a_result":
        other.write_text(json.dumps({"engine": "vllm", "rows": []}))
    out = tmp_path / "t.json"
    done = _cli("table", "--out", str(out), str(REAL_VLLM), str(other))
    assert done.returncode == 2 and not out.exists()
    assert len([line for line in done.stderr.splitlines() if "error:" in line]) == 1
    assert {
        "copy": f"the same vllm result as {REAL_VLLM_FILE} (date 2026-12-03T16:02:55+00:00, commit 8d3f0b9)",
        "twice": "the same vllm result as",
        "not_a_result": "not an engine_faults result",
    }.get(what, "No such file") in done.stderr


def test_the_run_command_line_is_unchanged():
    with pytest.raises(SystemExit):
        engine_faults.main(["--out", "x.json", "--logs", "l"])  # --engine is still required
    opts = engine_faults.parse_args(
        ["--engine", "vllm", "--out", "x.json", "--logs", "l", "--cases", "read_only_dir"]
    )
    assert opts.cases == ["read_only_dir"]
