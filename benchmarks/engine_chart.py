"""The chart of an engine benchmark's result (benchmarks/sglang_h200.py, benchmarks/vllm_h200.py).

Left: each run's tokens/s over its whole generates, repetition by repetition (stock, SAVE, LOAD), so
that a slow period of the host shows as the dip it is rather than hiding in a median. Right, for ``--paired`` results:
LOAD/stock per round for end-to-end tokens/s and for device time per replay, with the ±3 % and ±1 % bands
of issue 13's targets. The title carries the ready times and the restore on the critical path.

Both benchmarks write the chart beside their JSON (``<out>.png``); for committed results::

    python benchmarks/engine_chart.py benchmarks/results/sglang-h200.json benchmarks/results/vllm-h200.json

Needs matplotlib (the ``bench`` extra); without it nothing is drawn and None is returned.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

RUNS = (("stock", "tab:gray"), ("save", "tab:blue"), ("load", "tab:orange"))
#: (paired field, label, colour, half-width of the target band)
PAIRED = (
    ("e2e_tok_s_ratio", "tok/s end to end, LOAD / stock", "tab:orange", 0.03),
    ("replay_device_ratio", "device µs per replay, LOAD / stock", "tab:green", 0.01),
)


def end_to_end_tok_s(run: dict[str, Any]) -> list[float]:
    """Each timed repetition's tokens over its whole generate's time (prefill included, no baseline
    subtracted: the same work in every run, so the runs compare as they are)."""
    prompts, decoded = run.get("decode_prompts"), run.get("decode_tokens")
    if not prompts or not decoded:
        return []
    return [round((decoded + prompts) / t, 1) for t in run.get("timed_long_s") or [] if t]


def _engine_steps() -> Any:
    """benchmarks/engine_steps.py (standard library only at import), the module the benchmarks loaded
    under that name where they did."""
    if "engine_steps" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "engine_steps", Path(__file__).with_name("engine_steps.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["engine_steps"] = module
        spec.loader.exec_module(module)
    return sys.modules["engine_steps"]


def paired_values(result: dict[str, Any], field: str) -> list[Any]:
    """A paired field's per-round values; a result written before the field existed gets them from
    its runs through engine_steps.paired_stats, which writes the field in newer results."""
    paired = result.get("paired") or {}
    values = (paired.get(field) or {}).get("values")
    if values is None:
        runs = result.get("runs") or {}
        stats = _engine_steps().paired_stats(runs.get("stock"), runs.get("load"), paired.get("rounds") or 0)
        values = (stats.get(field) or {}).get("values")
    return values or []


def _title(result: dict[str, Any]) -> str:
    engine = "SGLang" if "sglang_version" in result else "vLLM"
    version = result.get("sglang_version") or result.get("vllm_version") or ""
    ready = " / ".join(
        f"{name} {result[f'ready_s_{name}']:.1f} s"
        for name, _ in RUNS
        if isinstance(result.get(f"ready_s_{name}"), (int, float))
    )
    restore = result.get("restore_critical_s")
    tail = f"; restore on the critical path {restore:.3f} s" if isinstance(restore, (int, float)) else ""
    head = f"{engine} {version}, {result.get('graphs')} graphs, commit {result.get('commit')}"
    return f"{head}\nready: {ready}{tail}"


def write_chart(result: dict[str, Any], path: str | Path) -> str | None:
    """Draw ``result`` into ``path`` (PNG). Returns the path, or None without matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result.get("runs") or {}
    reps = {name: end_to_end_tok_s(runs.get(name) or {}) for name, _ in RUNS}
    paired = result.get("paired") or {}
    if not any(reps.values()):
        return None
    panels = 2 if paired.get("rounds") else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    for name, color in RUNS:
        if reps[name]:
            ax.plot(range(1, len(reps[name]) + 1), reps[name], "o-", color=color, label=name)
    ax.set_xlabel("repetition")
    ax.set_ylabel("tokens/s, whole generate")
    ax.set_title(result.get("decode") or "decode", fontsize=9)
    ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0][1]
        for field, label, color, band in PAIRED:
            values = paired_values(result, field)
            if values:
                ax.plot(range(1, len(values) + 1), values, "o-", color=color, label=label)
                ax.axhspan(1 - band, 1 + band, color=color, alpha=0.12)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("round (stock and LOAD alternating)")
        ax.set_ylabel("LOAD / stock")
        ax.set_title(f"paired, {paired.get('rounds')} rounds; bands: ±3 % and ±1 %", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for name in argv:
        src = Path(name)
        out = write_chart(json.loads(src.read_text()), src.with_suffix(".png"))
        print(f"{src}: {out or 'no chart (no matplotlib, or no decode repetitions)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
