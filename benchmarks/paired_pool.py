"""The paired rounds of several engine-benchmark calls, pooled into one comparison.

``benchmarks/{vllm,sglang}_h200.py --paired`` compares stock and LOAD round by round, but one device
call (600 s) holds one stock process, one LOAD process and only the rounds its budget leaves: 257 vLLM
rounds of 64 x 128 tokens at 6640e28 gave an end-to-end interval of 0.980..1.035, a little wider
than issue 13's ±3 %. Several calls on one warm machine add rounds, and pairs of processes: the
first call SAVEs and compares (``KEEP_WORK=1`` keeps its work directory), the later ones reuse its
archive with ``--order stock,load``. This tool pools their rounds: the median of all rounds with its
distribution-free 95 % interval (``engine_steps.median_ci95``), and each call's own median beside it,
so that a difference between process pairs (vLLM runs its decode graph at one of two device levels
per process) shows instead of hiding in the pool.

    python benchmarks/paired_pool.py --out benchmarks/results/vllm-h200-paired.json A.json B.json

The calls must compare the same thing: one engine and version, one commit, one model, the same
decode prompts and tokens; anything else is refused with the field that differs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

#: Round-by-round measures of a paired result (``engine_steps.paired_stats``) and how each compares.
MEASURES = {
    "e2e_tok_s_ratio": "ratio",
    "first_token_ratio": "ratio",
    "tok_s_ratio": "ratio",
    "replay_device_ratio": "ratio",
    "replay_host_diff_us": "diff",
}
#: Issue 13's decode targets, on the pooled 95 % interval: tokens/s end to end within ±3 %, device
#: time per replay within ±1 %, host time per replay at most 2 us above stock's.
TARGETS = {
    "e2e_tok_s_ratio": (0.97, 1.03),
    "replay_device_ratio": (0.99, 1.01),
    "replay_host_diff_us": (None, 2.0),
}
#: Fields that must agree between the pooled calls.
SAME = ("commit", "model", "decode_prompts", "decode_tokens", "vllm_version", "sglang_version", "machine")


# benchmarks/ on the path for its engine_steps (the module the engine benchmarks share), also when
# this script is loaded by its file, as the tests do.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
steps = importlib.import_module("engine_steps")


class PoolError(ValueError):
    """The results cannot be pooled (the message names the file and the field)."""


def within(stat_: dict[str, Any], target: tuple[float | None, float | None]) -> bool | None:
    """Whether the whole 95 % interval lies inside the target (None without an interval)."""
    ci = stat_.get("ci95")
    if not ci:
        return None
    lo, hi = target
    return (lo is None or ci[0] >= lo) and (hi is None or ci[1] <= hi)


def pool(results: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """``results``: (file name, result JSON) of each call. Returns the pooled comparison."""
    if not results:
        raise PoolError("nothing to pool")
    first_name, first = results[0]
    for name, res in results:
        paired = res.get("paired")
        if not paired or not (paired.get("e2e_tok_s_ratio") or {}).get("values"):
            raise PoolError(f"{name}: no paired rounds (run the benchmark with --paired)")
        for key in SAME:
            if res.get(key) != first.get(key):
                raise PoolError(
                    f"{name}: {key} {res.get(key)!r} differs from {first_name}'s {first.get(key)!r}"
                )
    pooled: dict[str, list[float]] = {k: [] for k in MEASURES}
    sources = []
    for name, res in results:
        paired = res["paired"]
        source = {
            "file": name,
            "date": res.get("date"),
            "command": res.get("command"),
            "rounds": paired.get("rounds"),
            "stopped": paired.get("stopped"),
            "ready_s": {k: res.get(f"ready_s_{k}") for k in ("stock", "save", "load")},
        }
        for key, how in MEASURES.items():
            values = [float(v) for v in (paired.get(key) or {}).get("values") or [] if v is not None]
            pooled[key] += values
            source[key] = {
                k: v
                for k, v in steps.round_stat(values, how == "ratio").items()
                if k in ("n", "median", "ci95")
            }
        sources.append(source)
    paired = {key: steps.round_stat(pooled[key], how == "ratio") for key, how in MEASURES.items()}
    paired["rounds"] = len(pooled["e2e_tok_s_ratio"])
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": first.get("commit"),
        "machine": first.get("machine"),
        "engine": "vllm" if first.get("vllm_version") else "sglang",
        "engine_version": first.get("vllm_version") or first.get("sglang_version"),
        "model": first.get("model"),
        "decode": f"{first.get('decode_prompts')} prompts x {first.get('decode_tokens')} tokens per generate",
        "command": "python benchmarks/paired_pool.py " + " ".join(shlex.quote(n) for n, _ in results),
        "sources": sources,
        "paired": paired,
        "targets": {
            key: {"interval": list(target), "met": within(paired[key], target)}
            for key, target in TARGETS.items()
        },
    }


def lines(result: dict[str, Any]) -> list[str]:
    """The pooled comparison in a few lines."""
    p = result["paired"]

    def cell(key: str, unit: str = "") -> str:
        s = p[key]
        ci = s.get("ci95")
        met = result["targets"].get(key, {}).get("met")
        flag = "" if key not in result["targets"] else (" target met" if met else " target NOT met")
        return f"{s['median']}{unit} (95% CI {ci[0]}..{ci[1]}{unit}){flag}" if ci else "n/a"

    out = [
        f"{result['engine']} {result['engine_version']}, commit {result['commit']}: {p['rounds']} rounds "
        f"from {len(result['sources'])} calls ({result['decode']})",
        f"  LOAD/stock tok/s end to end {cell('e2e_tok_s_ratio')}",
        f"  LOAD/stock device per replay {cell('replay_device_ratio')}",
        f"  LOAD - stock host per replay {cell('replay_host_diff_us', ' us')}",
    ]
    for s in result["sources"]:
        e2e = s["e2e_tok_s_ratio"]
        out.append(f"  {s['file']}: {s['rounds']} rounds, end to end {e2e['median']} (95% CI {e2e['ci95']})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result JSON of each --paired call")
    p.add_argument("--out", required=True, help="the pooled comparison (JSON)")
    args = p.parse_args(argv)
    try:
        loaded = [(Path(f).name, json.loads(Path(f).read_text())) for f in args.results]
        result = pool(loaded)
    except (OSError, json.JSONDecodeError, PoolError) as e:
        print(f"paired_pool: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
