"""One engine's model-family table (issue 15) from the cold-start runs of each family.

    python benchmarks/models.py --engine sglang --out benchmarks/results/models-sglang-h200.json \
        dense=benchmarks/results/models-sglang-dense-h200.json moe=... hybrid=...

Each input is the JSON ``benchmarks/cold_start.py`` wrote for one family (``--runs
save,load_cold,stock_cold --weights seeded --sampling``, run on the device by
``benchmarks/run_cold_h200.sh`` with ``NAME=models-<engine>-<family>-h200``). The output has one row
per family and decoding mode (greedy, seeded sampling): whether Foundry validated the family (LOAD
captured no decode graph and gave the same tokens and top-5 logprobs as SAVE and as stock), refused
it at startup (with the engine log's reason), or failed, with the graph count, capture and restore
times, ready times and how many of the prompts' outputs differ from each other. Nothing here runs an
engine; the verdicts are computed from what the runs recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import cold_start as cs  # noqa: E402  (beside this file)

FAMILIES = ("dense", "moe", "hybrid")
MODES = ("greedy", "sampling")
#: Where the run records keep each mode's outputs (cold_start.request_phase).
OUTPUTS = {"greedy": "outputs", "sampling": "outputs_sampled"}
#: A plugin's refusal at startup, as both plugins word it (foundry_core.engine.refusal).
REFUSAL = re.compile(r"Foundry cannot run this [^\n]*")


def _outputs(doc: dict[str, Any], run: str, mode: str) -> dict[str, Any] | None:
    return ((doc.get("runs") or {}).get(run) or {}).get(OUTPUTS[mode])


def _same(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a == b


def _self_consistent(doc: dict[str, Any], run: str, mode: str) -> bool | None:
    """Whether ``run``'s server answered the same request twice with the same tokens and logprobs
    (cold_start sends each request twice); ``None`` where the run did not record it."""
    rec = (doc.get("runs") or {}).get(run) or {}
    if mode == "sampling":
        return rec.get("self_consistent_sampled")
    got = rec.get("self_consistent")
    return None if got is None else all(got.values()) if isinstance(got, dict) else bool(got)


def _refusal(doc: dict[str, Any]) -> str | None:
    """The first refusal line a Foundry run's error or log tail holds, if any."""
    for run in ("save", "load_cold"):
        rec = (doc.get("runs") or {}).get(run) or {}
        for text in (rec.get("error"), rec.get("log_tail")):
            if isinstance(text, list):
                text = "\n".join(map(str, text))
            m = REFUSAL.search(text or "")
            if m:
                return m.group(0).strip()
    return None


def rows_for(family: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The family's rows, one per decoding mode."""
    common = {
        "family": family,
        "model_config": doc.get("model_config"),
        "commit": doc.get("commit"),
        "date": doc.get("date"),
        "graphs": doc.get("graphs"),
        "load_decode_captures": doc.get("load_decode_captures"),
        "capture_s": doc.get("capture_s"),
        "restore_s": doc.get("restore_s"),
        "ready_s_save": doc.get("ready_s_save"),
        "ready_s_load": doc.get("ready_s_load_cold"),
        "ready_s_stock": doc.get("ready_s_stock_cold"),
        "weights": doc.get("weights"),
        "max_tokens": doc.get("max_tokens"),
        "engine_args": cs.recorded_engine_args(doc),
        "engine_env": cs.recorded_engine_args(doc, "engine_env", "--engine-env"),
    }
    refusal = _refusal(doc)
    rows = []
    for mode in MODES:
        load, save, stock = (_outputs(doc, r, mode) for r in ("load_cold", "save", "stock_cold"))
        row = dict(common, mode=mode)
        for name, other in (("save", save), ("stock", stock)):
            row[f"tokens_identical_to_{name}"] = _same(
                (load or {}).get("tokens"), (other or {}).get("tokens")
            )
            lp = ("token_logprobs", "top_logprobs")
            row[f"logprobs_identical_to_{name}"] = (
                None
                if load is None or other is None
                else [load.get(k) for k in lp] == [other.get(k) for k in lp]
            )
        row["save_self_consistent"] = _self_consistent(doc, "save", mode)
        tokens = (load or {}).get("tokens")
        row["prompts"] = len(tokens) if tokens else None
        row["distinct_outputs"] = len({json.dumps(t) for t in tokens}) if tokens else None
        checks = [
            row["load_decode_captures"] == 0,
            row["tokens_identical_to_save"],
            row["tokens_identical_to_stock"],
            row["logprobs_identical_to_save"],
            row["logprobs_identical_to_stock"],
            (row["distinct_outputs"] or 0) > 1,
        ]
        errors = "; ".join(f"{k}: {v}" for k, v in (doc.get("errors") or {}).items())
        if refusal:
            row["outcome"], row["reason"] = "refused", refusal
        elif load is None:
            row["outcome"] = "failed" if doc.get("errors") else "not run"
            row["reason"] = errors[:500] or None
        elif any(c is False for c in checks):
            row["outcome"], row["reason"] = "mismatch", None
            against_save = (row["tokens_identical_to_save"], row["logprobs_identical_to_save"])
            if against_save == (True, True) and checks[0] and checks[-1]:
                # Only stock differs. Whether stock reproduces itself decides what that shows.
                again = doc.get("repeated_stocks_identical_to_stock")
                row["reason"] = (
                    "LOAD identical to SAVE; stock differs, and a second stock start differed from the "
                    "first too: the engine's own output does not reproduce across processes here"
                    if again is False
                    else "LOAD identical to SAVE; stock differs (whether stock reproduces itself across "
                    "processes was not measured: --repeat 2)"
                    if again is None
                    else "LOAD identical to SAVE; stock differs, though two stock starts agreed"
                )
            if row["save_self_consistent"] is False:
                # Then a difference from SAVE cannot be told from the engine's own run-to-run drift.
                row["reason"] = (
                    "the SAVE server itself answered the same request twice differently: the engine is "
                    "not run-to-run deterministic here, so this comparison cannot show Foundry's part"
                )
        elif any(c is None for c in checks):
            # A run that did not happen (e.g. stock ran out of time) proves nothing either way.
            # Only the four comparisons can be None, so at least one run is named.
            missing = [
                k
                for k in ("save", "stock")
                if None in (row[f"tokens_identical_to_{k}"], row[f"logprobs_identical_to_{k}"])
            ]
            row["outcome"] = "incomplete"
            row["reason"] = (
                f"no comparison with {' or '.join(missing)}; {errors[:400] or 'no error recorded'}"
            )
        else:
            row["outcome"], row["reason"] = "validated", None
        rows.append(row)
    return rows


def build(engine: str, inputs: dict[str, Path]) -> dict[str, Any]:
    rows = []
    for family in FAMILIES:
        if family in inputs:
            doc = json.loads(Path(inputs[family]).read_text())
            if doc.get("engine") not in (None, engine):
                raise SystemExit(f"{inputs[family]} is a {doc.get('engine')} run, not {engine}")
            rows += rows_for(family, doc)
    commits = sorted({r["commit"] for r in rows if r.get("commit")})
    dates = sorted({r["date"] for r in rows if r.get("date")})
    return {
        "engine": engine,
        "date": dates[-1] if dates else datetime.date.today().isoformat(),
        "commit": commits[0] if len(commits) == 1 else commits,
        "machine": "nvidia-h200",
        "command": "python benchmarks/models.py " + " ".join(sys.argv[1:]),
        "sources": {f: str(p) for f, p in inputs.items()},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("sglang", "vllm"), required=True)
    p.add_argument("--out", required=True, help="the table's JSON")
    p.add_argument("inputs", nargs="+", help="FAMILY=cold_start JSON, FAMILY one of " + ", ".join(FAMILIES))
    opts = p.parse_args(argv)
    inputs = {}
    for item in opts.inputs:
        family, sep, path = item.partition("=")
        if not sep or family not in FAMILIES:
            p.error(f"{item!r}: give FAMILY=PATH with FAMILY one of {', '.join(FAMILIES)}")
        inputs[family] = Path(path)
    table = build(opts.engine, inputs)
    Path(opts.out).write_text(json.dumps(table, indent=1) + "\n")
    for r in table["rows"]:
        print(
            f"{r['family']:<7} {r['mode']:<9} {r['outcome']:<10} graphs {r['graphs']} captures "
            f"{r['load_decode_captures']} tokens/logprobs = SAVE {r['tokens_identical_to_save']}/"
            f"{r['logprobs_identical_to_save']}, = stock {r['tokens_identical_to_stock']}/"
            f"{r['logprobs_identical_to_stock']}, distinct {r['distinct_outputs']}"
            + (f"  ({r['reason']})" if r.get("reason") else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
