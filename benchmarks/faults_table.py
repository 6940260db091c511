"""The table across engines (issue 19), ``engine_faults.py table``: one row per case and engine from
earlier results; measures nothing."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
from pathlib import Path
from typing import Any

import engine_run as cs
from faults_catalog import CASES, DEFAULT_CASES, ENGINES, REPO, VERDICTS
from faults_result import write_result
from faults_verdicts import requests_equal

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
