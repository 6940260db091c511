"""engine_faults' result JSON: assembled from the cases, summed up in lines, resumed, written atomically."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import engine_run as cs
from faults_catalog import CASES, VERDICTS


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
