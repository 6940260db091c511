"""``foundry bench``: capture vs restore, and replay parity, measured side by side in one run.

One command on one GPU: a SAVE process warms up and captures the whole graph set natively and
times replays of every native graph; a fresh LOAD process restores the set (timed by phase) and
times replays of every restored graph on the same inputs. Results go to JSON and a PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

# A long decode capture list, 60 graphs: every size to 32, then steps of 8 to 256.
BENCH_BATCH_SIZES = tuple(range(1, 33)) + tuple(range(40, 257, 8))


def _dir_bytes(path: str) -> int:
    root = os.path.realpath(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def summarize(result: dict) -> dict:
    native, restored = result["replay_us_native"], result["replay_us_restored"]
    ratios = {bs: restored[bs] / native[bs] for bs in native if bs in restored and native[bs] > 0}
    restore_s = result["restore_s"]
    return {
        "graphs": result["graphs"],
        "nodes": result["nodes"],
        "capture_s": result["capture_s"],
        "restore_s": restore_s,
        "restore_breakdown": result["restore_breakdown"],
        "speedup": result["capture_s"] / restore_s if restore_s else None,
        "replay_us_native": native,
        "replay_us_restored": restored,
        "replay_ratio": ratios,
        "replay_ratio_max": max(ratios.values()) if ratios else None,
        "replay_ratio_min": min(ratios.values()) if ratios else None,
        "archive_bytes": _dir_bytes(result["archive"]),
        "us_per_node": 1e6 * restore_s / result["nodes"] if result["nodes"] else None,
        "bit_exact_all": result["bit_exact_all"],
        "load_stream_captures": result["load_stream_captures"],
    }


def plot(summary: dict, path: str) -> bool:
    """Capture-vs-restore bars and replay parity per batch size; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 3]})
    parts = summary["restore_breakdown"]
    ax1.bar(["native warmup\n+ capture"], [summary["capture_s"]], color="#888888")
    bottom = 0.0
    for key, color in (
        ("archive_read_s", "#1f77b4"),
        ("memory_s", "#2ca02c"),
        ("modules_s", "#ff7f0e"),
        ("graphs_s", "#d62728"),
    ):
        value = parts.get(key, 0.0)
        ax1.bar(["Foundry\nrestore"], [value], bottom=[bottom], color=color, label=key.replace("_s", ""))
        bottom += value
    ax1.set_ylabel("seconds")
    ax1.set_title(f"{summary['graphs']} graphs: {summary['speedup']:.1f}x")
    ax1.legend(fontsize=8)
    sizes = sorted(summary["replay_ratio"], key=int)
    ax2.plot([int(s) for s in sizes], [summary["replay_ratio"][s] for s in sizes], "o-", ms=3)
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.axhspan(0.99, 1.01, color="green", alpha=0.15, label="±1 %")
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("restored / native replay time (median)")
    ax2.set_title("replay parity")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(summary: dict) -> None:
    b = summary["restore_breakdown"]
    print(f"foundry bench: {summary['graphs']} graphs, {summary['nodes']} nodes")
    print(f"  native warmup + capture  {summary['capture_s']:8.3f} s")
    print(f"  restore                  {summary['restore_s']:8.3f} s   ({summary['speedup']:.1f}x faster)")
    for key in ("archive_read_s", "memory_s", "modules_s", "graphs_s"):
        print(f"    {key[:-2]:<22} {b.get(key, 0.0):8.3f} s")
    print(f"  per node                 {summary['us_per_node']:8.1f} us")
    print(f"  archive                  {summary['archive_bytes'] / 2**20:8.1f} MiB")
    print(
        f"  replay restored/native   {summary['replay_ratio_min']:.4f} .. {summary['replay_ratio_max']:.4f} "
        "(median of each batch size)"
    )
    print(f"  bit-exact                {summary['bit_exact_all']}")
