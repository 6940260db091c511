"""The side-by-side result from a work directory of benchmarks/sxs.py: per shape, each mode's starts
summed up, the floor, and Foundry's ratios with their spread over the alternating pairs; a chart
beside the JSON. Measures nothing."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import sxs_modes as modes

REPO = Path(__file__).resolve().parents[1]
#: mode -> the variant its row in the result stands for (the others are listed beside it)
MAIN_VARIANT = {
    "stock_naive": "cold",
    "stock_best": "best",
    "foundry": "cold",
    "peer": "cold",
    "stock_default": "default",
}
#: ratio name -> (the numerator's (mode, variant) in order of preference, the denominator's): below 1,
#: Foundry is faster. A pair's ratio takes the first numerator whose page cache was in the state of
#: the denominator's (dropped or not): a start that reads its files from disk is never set against one
#: that finds them cached. ``stock_best`` is a fresh container (page cache dropped) since 2026-12-05;
#: against the earlier one, whose page cache was kept, the warm LOAD (caches and page cache kept) is
#: what compares.
RATIOS = {
    "foundry_vs_stock_best": ((("foundry", "cold"), ("foundry", "warm")), ("stock_best", "best")),
    "foundry_vs_stock_naive": ((("foundry", "cold"),), ("stock_naive", "cold")),
    "foundry_vs_peer": ((("foundry", "cold"),), ("peer", "cold")),
    # upstream with the engine's caches kept beside its archive, as stock_best keeps them
    "foundry_vs_peer_best": ((("foundry", "cold"),), ("peer", "best")),
}


def spread(values: list[float]) -> dict[str, Any] | None:
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def _median_dict(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted(
        {k for d in dicts for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    )
    return {k: (spread([d.get(k) for d in dicts]) or {}).get("median") for k in keys}


def _launch(rec: dict[str, Any]) -> modes.Launch:
    """A recorded start's settings, its port and per-phase TOML path left out of the comparison."""
    argv = list(rec.get("argv") or [])
    if "--port" in argv:
        argv[argv.index("--port") + 1] = "PORT"
    return modes.Launch(argv, dict((rec.get("env") or {}).get("set") or {}))


def _same_per_prompt(outputs: dict[str, Any] | None, ref: dict[str, Any]) -> bool:
    """The same greedy tokens and top-5 logprobs, prompt by prompt (the batched request apart)."""
    outputs = outputs or {}
    return outputs.get("tokens") == ref.get("tokens") and outputs.get("top_logprobs") == ref.get(
        "top_logprobs"
    )


def summarize(
    recs: list[dict[str, Any]],
    reference: dict[str, Any] | None,
    foundry: dict[str, Any] | None,
    stock_batched: list[Any] | None = None,
) -> dict[str, Any]:
    ok = [r for r in recs if "error" not in r]
    out: dict[str, Any] = {
        "starts": len(recs),
        "ttft_cold_s": spread([r.get("ttft_cold_s") for r in ok]),
        "ready_s": spread([r.get("ready_s") for r in ok]),
        "phases": _median_dict([r.get("phases") or {} for r in ok]),
        "page_cache_dropped": sorted(
            {str(r.get("page_cache_dropped")) for r in recs if "page_cache_dropped" in r}
        ),
    }
    facts = [r["foundry"] for r in ok if r.get("foundry")]
    if facts:
        out["foundry"] = foundry_summary(facts)
    serving = [r["serving"] for r in ok if r.get("serving")]
    if serving:
        out["serving"] = {rate: _median_dict([s[rate] for s in serving if rate in s]) for rate in serving[0]}
    ref = (reference or {}).get("outputs")
    if ref is not None and ok:
        out["outputs_identical_to_stock"] = all(_same_per_prompt(r.get("outputs"), ref) for r in ok)
        out["outputs_differ_by_prompt"] = ref.get("prompts_differ")
        if ref.get("batched") is not None:  # one request for every prompt: stock itself may vary there
            out["batched_outputs_identical_to_stock"] = all(
                (r.get("outputs") or {}).get("batched") == ref["batched"] for r in ok
            )
            # Where stock's own starts answered it differently, the fair question is whether each
            # start's answer is one that some stock start gave too.
            if stock_batched:
                out["batched_outputs_among_stock_answers"] = all(
                    (r.get("outputs") or {}).get("batched") in stock_batched for r in ok
                )
    if foundry is not None and recs:
        out["settings_diff_from_foundry"] = modes.settings_diff(_launch(recs[-1]), _launch(foundry))
    # A start the budget cut short (sxs.py) did not fail: it had less time than a start may take
    cut = [r for r in recs if r.get("cut_by_budget")]
    if cut:
        out["cut_by_budget"] = len(cut)
    errors = [
        {"error": r["error"], "refusal": r.get("refusal"), "log": r.get("log")}
        for r in recs
        if "error" in r and not r.get("cut_by_budget")
    ]
    if errors:
        out["errors"] = errors[:3]
    return out


def _dropped(rec: dict[str, Any]) -> bool:
    return rec.get("page_cache_dropped") is True


def foundry_summary(facts: list[dict[str, Any]]) -> dict[str, Any]:
    """Foundry's own lines over a mode's starts (sxs_server.foundry_facts): its steps on the start's
    critical path, the archive check's split, when the read-ahead was planned, and how the schedulers
    started (each distinct reason once)."""
    reports = [f.get("report") or {} for f in facts]
    starts = [f.get("scheduler_start") or r.get("scheduler_start") for f, r in zip(facts, reports)]
    out: dict[str, Any] = {
        "critical_s": spread([r.get("foundry_critical_s") for r in reports]),
        "steps_s": _median_dict([r.get("foundry_steps_s") or {} for r in reports]),
        "check_archive_split": _median_dict([r.get("check_archive_split") or {} for r in reports]),
        "process_age_s": _median_dict([r.get("process_age_s") or {} for r in reports]),
        "readahead_planned_at_s": spread([f.get("readahead_planned_at_s") for f in facts]),
        "readahead_plan_s": spread([f.get("readahead_plan_s") for f in facts]),
        "caches_new_files_max": max((r.get("caches_new_files") or 0 for r in reports), default=0),
        "gc_frozen": sorted({str(r["gc_frozen"]) for r in reports if "gc_frozen" in r}),
        "gc_frozen_objects": spread([r.get("gc_frozen_objects") for r in reports]),
        "scheduler_start": sorted(
            {f"{s.get('method')}: {s.get('reason') or ''}".rstrip(": ") for s in starts if s}
        ),
    }
    return {k: v for k, v in out.items() if v not in (None, {}, [])}


def paired(
    recs: list[dict[str, Any]], numerators: tuple[tuple[str, str], ...], b: tuple[str, str], key
) -> dict[str, Any] | None:
    """``key(a) / key(b)`` per pair that has ``b`` and a numerator of ``numerators`` whose page cache
    was in ``b``'s state (the first such), with its spread and what was compared."""
    by = {}
    for r in recs:
        if "error" not in r and r.get("pair") is not None:
            by.setdefault((r["mode"], r["variant"], r["pair"]), r)
    values, compared, unmatched = [], set(), 0
    for pair in sorted({p for (_, _, p) in by}):
        rb = by.get((*b, pair))
        if rb is None or not any((*a, pair) in by for a in numerators):
            continue
        ra = next(
            (by[(*a, pair)] for a in numerators if _dropped(by.get((*a, pair), {})) == _dropped(rb)), None
        )
        if ra is None:
            unmatched += 1
            continue
        x, y = key(ra), key(rb)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y:
            values.append(x / y)
            compared.add(
                f"{ra['mode']} {ra['variant']} / {b[0]} {b[1]}, page cache {'dropped' if _dropped(rb) else 'kept'}"
            )
    s = spread(values)
    if not s:
        return None
    out = dict(s, pairs=[round(v, 4) for v in values], compared=sorted(compared))
    if unmatched:
        out["pairs_without_a_match"] = unmatched
    return out


def outputs_across_starts(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Whether every start that answered, whatever its mode (SAVEs included), gave the same per-prompt
    tokens and top-5 logprobs: a run without a stock start (foundry against peer) has no stock
    reference, and a SAVE captures as stock does."""
    answered = [r for r in recs if "error" not in r and (r.get("outputs") or {}).get("tokens") is not None]
    if not answered:
        return None
    first = answered[0]["outputs"]
    batched = [r["outputs"].get("batched") for r in answered if r["outputs"].get("batched") is not None]
    return {
        "starts": len(answered),
        "modes": sorted({f"{r['mode']} {r['variant']}" for r in answered}),
        "identical": all(_same_per_prompt(r["outputs"], first) for r in answered),
        "differ_by_prompt": first.get("prompts_differ"),
        "batched_identical": all(b == batched[0] for b in batched) if batched else None,
    }


def shape_result(shape_dir: Path) -> dict[str, Any]:
    recs = [json.loads(p.read_text()) for p in sorted((shape_dir / "starts").glob("*.json"))]
    floors = [json.loads(p.read_text()) for p in sorted((shape_dir / "floor").glob("*.json"))]
    # Stock's outputs: stock_naive's, else those of the start that filled stock_best's caches.
    stock = [r for r in recs if r["mode"] in ("stock_naive", "stock_best") and r.get("outputs")]
    reference = min(stock, key=lambda r: (r["mode"] != "stock_naive", r["variant"] != "fill"), default=None)
    foundry = next((r for r in recs if r["mode"] == "foundry" and r["variant"] == "cold"), None)
    stock_batched = [r["outputs"]["batched"] for r in stock if r["outputs"].get("batched") is not None]
    result: dict[str, Any] = {"modes": {}, "ratios": {}}
    for mode in modes.MODES:
        mine = [r for r in recs if r["mode"] == mode]
        if not mine:
            continue
        main = [r for r in mine if r["variant"] == MAIN_VARIANT[mode]]
        # A mode's row is its main start alone: a SAVE is no LOAD, whatever else ran.
        entry = summarize(main, reference, foundry, stock_batched) if main else {"starts": 0}
        for variant in sorted({r["variant"] for r in mine} - {MAIN_VARIANT[mode]}):
            entry[variant] = summarize(
                [r for r in mine if r["variant"] == variant], reference, None, stock_batched
            )
        result["modes"][mode] = entry
    for name, (numerators, b) in RATIOS.items():
        result["ratios"][name] = paired(recs, numerators, b, lambda r: r.get("ttft_cold_s"))
    serving = {}
    for rate in sxs_serving_rates(recs):
        serving[rate] = paired(
            recs,
            (("foundry", "cold"),),
            ("stock_default", "default"),
            lambda r, rate=rate: ((r.get("serving") or {}).get(rate) or {}).get("output_tok_s"),
        )
    result["ratios"]["serving_throughput_vs_stock_default"] = serving or None
    result["outputs_across_starts"] = outputs_across_starts(recs)
    result["floor"] = {
        "import_entry_module_s": spread([(f.get("import_entry_module") or {}).get("wall_s") for f in floors]),
        "import_entry_module_warm_s": spread(
            [(f.get("import_entry_module_warm") or {}).get("wall_s") for f in floors]
        ),
        "import_page_cache_dropped": sorted(
            {str((f.get("import_entry_module") or {}).get("page_cache_dropped")) for f in floors}
        ),
        "read_weights_s": spread([(f.get("read_weights") or {}).get("s") for f in floors]),
        # the context alone: the interpreter start is in import_entry_module_s already
        "cuda_context_s": spread([(f.get("cuda_context") or {}).get("inner_s") for f in floors]),
        "errors": sorted(
            {str(v["error"]) for f in floors for v in f.values() if isinstance(v, dict) and "error" in v}
        ),
    }
    model = shape_dir.parent / "models" / shape_dir.name / ".sxs-model.json"
    result["model"] = json.loads(model.read_text()) if model.is_file() else None
    return result


def sxs_serving_rates(recs: list[dict[str, Any]]) -> list[str]:
    return sorted({rate for r in recs for rate in (r.get("serving") or {})})


def _versions(python: str) -> dict[str, Any]:
    code = (
        "import json\nfrom importlib.metadata import version as v\nout={}\n"
        "for n in ('sglang','vllm','torch'):\n try: out[n]=v(n)\n except Exception: out[n]=None\nprint(json.dumps(out))"
    )
    try:
        q = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
        return json.loads(q.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def _commit() -> str | None:
    if os.environ.get("FOUNDRY_COMMIT"):
        return os.environ["FOUNDRY_COMMIT"]
    try:
        q = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        )
    except OSError:  # no git on the machine: FOUNDRY_COMMIT says it
        return None
    return q.stdout.strip() or None


def _machine() -> str:
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        gpus = [r for r in q.stdout.splitlines() if r.strip()]
    except OSError:
        gpus = []
    return (
        f"{len(gpus)}x {gpus[0]}; host {socket.gethostname()}"
        if gpus
        else f"no GPU seen; host {socket.gethostname()}"
    )


def chart(result: dict[str, Any], path: Path) -> str | None:
    """Per shape, each mode's median start split into its phases, the TTFT marked; None or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {e}"
    shapes = list(result["shapes"])
    if not shapes:
        return "no chart: no shapes"
    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 1.2 + 3.2 * len(shapes)), squeeze=False)
    colors = {
        "imports": "#8da0cb",
        "spawn": "#a6d854",
        "setup": "#e5c494",
        "weights": "#ffd92f",
        "compile": "#e78ac3",
        "jit": "#b3b3b3",
        "graphs": "#fc8d62",
        "warmups": "#66c2a5",
    }
    for ax, shape in zip(axes[:, 0], shapes):
        rows = []  # each mode's main start, and Foundry's warm LOAD and SAVE beside its cold one
        for mode, entry in result["shapes"][shape]["modes"].items():
            beside = ((f"{mode} warm", entry.get("warm") or {}), (f"{mode} SAVE", entry.get("save") or {}))
            for label, e in ((mode, entry), *beside):
                if e.get("ttft_cold_s"):
                    cache = "dropped" if "True" in e.get("page_cache_dropped", []) else "kept"
                    rows.append((f"{label}\n(page cache {cache})", e))
        for y, (_label, entry) in enumerate(rows):
            left = 0.0
            for phase, color in colors.items():
                v = entry["phases"].get(phase)
                if v:
                    ax.barh(y, v, left=left, color=color, label=phase if y == 0 else None)
                    left += v
            t = entry["ttft_cold_s"]
            ax.errorbar(
                t["median"], y, xerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], fmt="k|", ms=14
            )
            ax.text(t["median"], y, f"  {t['median']:.1f} s", va="center")
        floor = result["shapes"][shape].get("floor") or {}
        parts = [
            (floor.get(k) or {}).get("median")
            for k in ("import_entry_module_s", "read_weights_s", "cuda_context_s")
        ]
        if any(parts):  # the floor: what any start pays before it can answer
            ax.axvline(sum(p for p in parts if p), color="k", ls="--", lw=1, label="floor")
        ax.set_yticks(range(len(rows)), [m for m, _ in rows])
        ax.set_title(
            f"{result['engine']} {result.get('engine_version')}, {shape}: launch to first streamed token"
        )
        ax.set_xlabel("seconds (bars: median phases; mark: TTFT median and range)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=7, ncol=3)
    note = result.get("note")  # what a reader of the numbers must know (set by hand after a run)
    if note:
        import textwrap

        lines = textwrap.wrap(f"Note: {note}", 150)
        fig.set_figheight(fig.get_figheight() + 0.16 * len(lines))
        fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.16 * len(lines) / fig.get_figheight(), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(opts: argparse.Namespace) -> int:
    root = opts.workdir.resolve()
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        print(f"{root}: no runs (meta.json missing)", file=sys.stderr)
        return 2
    meta = json.loads(meta_path.read_text())
    if meta.get("engine") != opts.engine:
        print(f"{root} holds {meta.get('engine')}'s runs, not {opts.engine}'s", file=sys.stderr)
        return 2
    versions = _versions(meta.get("python") or sys.executable)
    now = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
        "machine": _machine(),
        "engine_version": versions.get(opts.engine),
        "torch_version": versions.get("torch"),
    }
    # The facts of the machine the starts ran on, kept in the work dir by the merge made there: a
    # later merge of the same records elsewhere (a CPU machine, after a parse fix) keeps them and
    # says when and where it merged again.
    facts = meta.get("facts")
    if facts and now["machine"].startswith("no GPU seen"):
        merged_again = {"date": now["date"], "commit": now["commit"]}
    else:
        facts, merged_again = now, None
        meta_path.write_text(json.dumps({**meta, "facts": facts}))
    result: dict[str, Any] = {
        "date": facts["date"],
        "commit": facts["commit"],
        "machine": facts["machine"],
        "command": opts.command or os.environ.get("SXS_COMMAND"),
        "engine": opts.engine,
        "engine_version": facts["engine_version"],
        "torch_version": facts["torch_version"],
        **({"merged_again": merged_again} if merged_again else {}),
        "allowed_diff_stock_best_vs_foundry": modes.ALLOWED_DIFF,
        "stock_best_env": modes.STOCK_BEST_ENV[opts.engine],
        "shapes": {},
    }
    for shape_dir in sorted(p for p in root.iterdir() if (p / "starts").is_dir()):
        result["shapes"][shape_dir.name] = shape_result(shape_dir)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    why = chart(result, opts.out.with_suffix(".png"))
    print(f"wrote {opts.out}" + (f" ({why})" if why else f" and {opts.out.with_suffix('.png')}"))
    return 0


def chart_main(result_path: Path) -> int:
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError) as e:
        print(f"{result_path}: not a result ({e})", file=sys.stderr)
        return 2
    why = chart(result, result_path.with_suffix(".png"))
    print(why or f"wrote {result_path.with_suffix('.png')}")
    return 1 if why else 0
