"""``foundry bench``: capture vs restore, and replay parity, measured side by side in one run.

One command on one GPU: a SAVE process warms up and captures the whole graph set natively; a fresh
LOAD process restores the set (timed by phase), checks it bit for bit, then captures native twins of
every graph in that same process and times native and restored replays alternately on the same
inputs, so process and order effects hit both alike. ``--presets`` (or FOUNDRY_BENCH_PRESETS) adds
other model sizes, saved and restored without replay timing, for restore time against node count.
Results go to JSON and a PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

from .demo import paired_text
from .options import BENCH_BATCH_SIZES  # noqa: F401  (re-exported: the bench's 60-graph capture list)


def _dir_bytes(path: str) -> int:
    root = os.path.realpath(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def archive_breakdown(path: str) -> dict[str, int]:
    """Bytes of an archive by kind of member: modules, graphs, memory, manifest, other."""
    root = os.path.realpath(path)
    out: dict[str, int] = {}
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            top = rel.split(os.sep, 1)[0]
            kind = (
                top
                if top in ("modules", "graphs", "memory")
                else ("manifest" if rel == "manifest.json" else "other")
            )
            out[kind] = out.get(kind, 0) + os.path.getsize(os.path.join(d, f))
    return out


def summarize(result: dict) -> dict:
    native, restored = result["replay_us_native"], result["replay_us_restored"]
    ratios = {bs: restored[bs] / native[bs] for bs in native if bs in restored and native[bs] > 0}
    restore_s = result["restore_s"]
    host_native, host_restored = (
        result.get("replay_host_us_native", {}),
        result.get("replay_host_us_restored", {}),
    )
    return {
        "graphs": result["graphs"],
        "nodes": result["nodes"],
        "capture_s": result["capture_s"],
        "restore_s": restore_s,
        "restore_critical_s": restore_s,
        "restore_background_s": result.get("restore_background_s"),
        "prepared": result.get("prepared", False),
        "tail_graphs": result.get("tail_graphs", 0),
        "first_replay_wait_s": result.get("first_replay_wait_s", 0.0),
        # the critical path plus what the first replays waited for graphs finished after load()
        "restore_until_replayed_s": restore_s + result.get("first_replay_wait_s", 0.0),
        "restore_breakdown": result["restore_breakdown"],
        # SAVE's own time after the capture (fc.save: walk, encode, snapshot, write), and the walk
        # per node (the driver queried node by node)
        "save_s": result.get("save_s"),
        "save_breakdown": result.get("save_breakdown", {}),
        "save_walk_us_per_node": (
            1e6 * result["save_breakdown"]["walk_s"] / result["nodes"]
            if result.get("save_breakdown", {}).get("walk_s") is not None and result["nodes"]
            else None
        ),
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
        "archive_breakdown": archive_breakdown(result["archive"]),
        "builder": result.get("builder"),
        "replay_method": result.get("replay_method"),
        "replay_us_native_save_process": result.get("replay_us_native_save_process", {}),
        # launch cost on the CPU (idle GPU before each call), restored minus native twin, per size
        "replay_host_us_native": host_native,
        "replay_host_us_restored": host_restored,
        "replay_host_us_extra": {
            bs: host_restored[bs] - host_native[bs] for bs in host_native if bs in host_restored
        },
        # the same with both executable graphs launched by one bare cuGraphLaunch (no Python around)
        "launch_host_us_native": result.get("launch_host_us_native", {}),
        "launch_host_us_restored": result.get("launch_host_us_restored", {}),
        # restored - native twin of each alternating round (median, quartiles): what a difference
        # of the two medians above hides when the host's speed moves during the run
        "replay_host_us_paired": result.get("replay_host_us_paired", {}),
        "launch_host_us_paired": result.get("launch_host_us_paired", {}),
        "scaling": result.get("scaling", []),
        # --check-structure: graph name -> first difference (restored vs saved; twins vs saved)
        "reinstantiate_s": result.get("reinstantiate_s"),
        "structure_differences": result.get("structure_differences"),
        "twin_structure_differences": result.get("twin_structure_differences"),
    }


def plot(summary: dict, path: str) -> bool:
    """Capture-vs-restore bars and replay parity per batch size; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scaling = summary.get("scaling") or []
    if len(scaling) > 1:
        fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1, 3, 2]})
        nodes = [row["nodes"] for row in scaling]
        ax3.plot(nodes, [row["restore_s"] for row in scaling], "o-", label="restore")
        ax3.plot(
            nodes, [row["capture_s"] for row in scaling], "s--", color="#888888", label="warmup + capture"
        )
        for row in scaling:
            ax3.annotate(row["preset"], (row["nodes"], row["restore_s"]), fontsize=8)
        ax3.set_xlabel("nodes (all graphs)")
        ax3.set_ylabel("seconds")
        ax3.set_yscale("log")
        ax3.set_title("time against node count")
        ax3.legend(fontsize=8)
    else:
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
    if summary.get("save_s") is not None:
        walk = summary.get("save_breakdown", {}).get("walk_s")
        per_node = summary.get("save_walk_us_per_node")
        print(
            f"  save (fc.save)           {summary['save_s']:8.3f} s"
            + (f"   (walk {walk:.3f} s, {per_node:.1f} us per node)" if per_node is not None else "")
        )
    print(f"  restore                  {summary['restore_s']:8.3f} s   ({summary['speedup']:.1f}x faster)")
    if summary.get("restore_background_s") is not None:
        print(
            f"    ahead, on a thread     {summary['restore_background_s']:8.3f} s   (not on the critical path)"
        )
    if summary.get("tail_graphs"):
        print(
            f"    finished after load()  {summary['tail_graphs']:8d} graphs (first replays waited "
            f"{summary['first_replay_wait_s']:.3f} s in all; restore until all replayed "
            f"{summary['restore_until_replayed_s']:.3f} s)"
        )
    if "retargeted_graphs" in b:
        deferred = int(b.get("deferred_graphs", 0))
        print(
            f"    built ahead            {summary['graphs'] - deferred} of {summary['graphs']} graphs "
            f"({int(b['retargeted_graphs'])} with memory nodes re-pointed after the mapping)"
        )
    for key in ("archive_read_s", "memory_s", "retarget_s", "modules_s", "graphs_s"):
        print(f"    {key[:-2]:<22} {b.get(key, 0.0):8.3f} s")
    for key in ("graph_read_s", "graph_build_s", "graph_instantiate_s", "graph_upload_s"):
        if key in b:
            print(f"      {key[:-2]:<20} {b[key]:8.3f} s")
    print(f"  builder                  {summary.get('builder')}")
    print(f"  per node                 {summary['us_per_node']:8.1f} us")
    print(f"  archive                  {summary['archive_bytes'] / 2**20:8.1f} MiB")
    for kind, n in sorted(summary.get("archive_breakdown", {}).items()):
        print(f"    {kind:<22} {n / 2**20:8.1f} MiB")
    for row in summary.get("scaling", []):
        print(
            f"  preset {row['preset']:<8} {row['nodes']:7d} nodes  capture {row['capture_s']:7.3f} s  "
            f"restore {row['restore_s']:6.3f} s  ({row['us_per_node']:.2f} us/node, bit-exact {row['bit_exact_all']})"
        )
    print(
        f"  replay restored/native   {summary['replay_ratio_min']:.4f} .. {summary['replay_ratio_max']:.4f} "
        "(median of each batch size)"
    )
    for bs, extra in sorted(summary.get("replay_host_us_extra", {}).items(), key=lambda kv: int(kv[0])):
        paired = summary.get("replay_host_us_paired", {}).get(bs)
        print(
            f"  launch on the CPU, bs {bs:<4} restored {summary['replay_host_us_restored'][bs]:6.2f} us, "
            f"native {summary['replay_host_us_native'][bs]:6.2f} us ({extra:+.2f} us"
            + (f"; {paired_text(paired)})" if paired else ")")
        )
        raw_r = summary.get("launch_host_us_restored", {}).get(bs)
        raw_n = summary.get("launch_host_us_native", {}).get(bs)
        if raw_r is not None and raw_n is not None:
            paired = summary.get("launch_host_us_paired", {}).get(bs)
            print(
                f"    bare cuGraphLaunch    restored {raw_r:6.2f} us, native {raw_n:6.2f} us ({raw_r - raw_n:+.2f} us"
                + (f"; {paired_text(paired)})" if paired else ")")
            )
    for key, what in (
        ("structure_differences", "restored = saved"),
        ("twin_structure_differences", "native twins = saved"),
    ):
        differences = summary.get(key)
        if differences is not None:
            print(
                f"  structure, {what:<20} {summary['graphs'] - len(differences)} of {summary['graphs']} graphs"
                + "".join(f"\n    {name}: {why}" for name, why in list(differences.items())[:5])
            )
    print(f"  bit-exact                {summary['bit_exact_all']}")
