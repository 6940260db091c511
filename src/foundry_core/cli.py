"""The ``foundry`` command: demo, bench, soak, inspect, verify.

``demo``, ``bench`` and ``soak`` are tools beside the library (the ``foundry_tools`` package): they
are imported here only inside their subcommand functions, and their options come from
``foundry_tools.options``, which imports no torch, so ``foundry --version`` and ``foundry --help``
stay quick. The library itself (every other ``foundry_core`` module) never imports ``foundry_tools``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from . import __version__


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def cmd_inspect(args) -> int:
    from .archive import ArchiveError, open_archive
    from .graph_codec import read_description

    try:
        archive = open_archive(args.archive)
    except ArchiveError as e:
        print(f"foundry inspect: {e}", file=sys.stderr)
        return 1
    meta, fp = archive.meta, archive.fingerprint
    if meta.get("kind") == "foundry-caches":
        print(f"archive   {archive.path} (carried compile caches)")
        print(f"digest    {archive.digest}")
        _print_caches(archive)
        return 0
    print(f"archive   {archive.path}")
    print(f"digest    {archive.digest}")
    stored = sum(entry["size"] for entry in archive.manifest["files"].values())
    packed = sum(1 for entry in archive.manifest["files"].values() if "encoding" in entry)
    print(
        f"files     {len(archive.files)}, {_human(sum(archive.files.values()))} "
        f"({_human(stored)} on disk, {packed} compressed)"
    )
    print("\nfingerprint")
    for key, value in fp.items():
        print(f"  {key:<20} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    rows = []
    for g in meta.get("graphs", []):
        desc = read_description(archive, g)
        kernels = sum(1 for n in desc["nodes"] if n["type"] == "kernel")
        comms = ", ".join(f"{k} {n}" for k, n in sorted((g.get("collectives") or {}).items())) or "-"
        rows.append([g["name"], g["nodes"], kernels, len(desc["edges"]), "yes" if g["rng"] else "no", comms])
    print()
    print(_table(rows, ["graph", "nodes", "kernels", "edges", "rng", "collectives"]))
    totals = meta.get("collectives")
    if totals is not None:  # archives saved before collectives were counted have no entry
        shown = ", ".join(f"{k} {n}" for k, n in totals.items()) or "none"
        print(f"\ncollective kernels: {shown} (NCCL kernels are refused at SAVE)")
    for rec in meta.get("symmetric", []):  # torch symmetric memory the graphs address, checked at LOAD
        peers = ", ".join(f"{p:#x}" for p in rec["buffer_ptrs"])
        print(
            f"symmetric {rec['name']}: rank {rec['rank']} of {rec['world_size']}, {_human(rec['buffer_size'])} "
            f"per rank at {peers}; multicast {rec['multicast_ptr']:#x}"
        )
    heap = meta.get("nvshmem_heap")
    if heap:  # NVSHMEM's heap as SAVE placed it; LOAD must place it the same (checked)
        print(f"NVSHMEM heap: {_human(heap['size'])} at {heap['base']:#x}")
    rows = []
    by_image: dict[str, int] = {}
    for image, _name, _attrs in meta.get("kernels", []):
        by_image[image] = by_image.get(image, 0) + 1
    # Variables SAVE found changed in the engine's module, written into the restored one at LOAD;
    # modules whose NVSHMEM device state the LOAD process's NVSHMEM sets up (module_globals.py).
    variables = Counter(row[0] for row in meta.get("globals", []))
    nvshmem = set(meta.get("nvshmem_images", []))
    # variables holding pointers outside the region, left as the image has them
    skipped = Counter(row[0] for row in meta.get("globals_skipped", []))
    for image in meta.get("images", []):
        state = [f"{variables[image]} variables"] if image in variables else []
        state += [f"{skipped[image]} not restored"] if image in skipped else []
        state += ["NVSHMEM"] if image in nvshmem else []
        rows.append(
            [
                image[:16],
                by_image.get(image, 0),
                _human(archive.files[f"modules/{image}.cubin"]),
                ", ".join(state) or "-",
            ]
        )
    print()
    print(_table(rows, ["module", "kernels used", "bytes", "restored state"]))
    if args.kernels:
        print()
        print(
            _table([[image[:16], name] for image, name, _ in meta.get("kernels", [])], ["module", "kernel"])
        )
    layout = meta.get("layout", {})
    live = [s for s in layout.get("segments", []) if s[2]]
    print(
        f"\nregion    base {layout.get('base', 0):#x}, {len(layout.get('segments', []))} segments "
        f"({len(live)} live, {_human(sum(s[1] for s in live))})"
    )
    carried = Path(str(archive.path).rstrip("/") + ".caches")
    if carried.is_dir():
        try:
            caches = open_archive(carried)
        except ArchiveError as e:
            print(f"\ncaches    {carried}: {e}")
        else:
            print(f"\ncaches    {carried}, digest {caches.digest}")
            _print_caches(caches)
    return 0


def _print_caches(archive) -> None:
    """The carried caches of an engine: one row per cache kind."""
    engine = (archive.fingerprint.get("model") or {}).get("engine") or {}
    name = engine.get("name", "?")
    version = engine.get(name) or ""
    rows = [
        [
            f"{name} {version}".strip(),
            kind,
            v.get("files", 0),
            _human(int(v.get("bytes", 0))),
            v.get("what", ""),
        ]
        for kind, v in sorted((archive.meta.get("kinds") or {}).items())
    ]
    print()
    print(_table(rows, ["engine", "cache", "files", "bytes", "what"]))


def cmd_verify(args) -> int:
    from .api import verify
    from .archive import ArchiveError, open_archive

    try:
        # A multi-GPU launch keeps an archive per rank, each saved on its own device: unless told
        # otherwise, check each as its own rank would load it (rank, world size, device ordinal).
        saved = open_archive(args.archive)
        rank = saved.fingerprint.get("rank", 0) if args.rank is None else args.rank
        world_size = saved.fingerprint.get("world_size", 1) if args.world_size is None else args.world_size
        device = saved.meta.get("device", 0) if args.device is None else args.device
        archive = verify(
            args.archive, device=device, rank=rank, world_size=world_size, expected_digest=args.digest
        )
    except ArchiveError as e:
        print(f"foundry verify: REFUSED: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"foundry verify: {e}", file=sys.stderr)
        return 2
    print(f"foundry verify: OK: {archive.path} ({len(archive.meta['graphs'])} graphs) matches this machine")
    return 0


def _git_commit() -> str:
    if os.environ.get("FOUNDRY_COMMIT"):  # set where the tree travels without its .git (the GPU runs)
        return os.environ["FOUNDRY_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cmd_demo(args) -> int:
    from foundry_tools.demo import gpu_available, orchestrate, print_summary

    if not gpu_available():
        print(
            "foundry demo: no NVIDIA GPU is visible on this machine (torch.cuda.is_available() is False). "
            "The demo captures and restores CUDA graphs, so it needs one; nothing was run."
        )
        return 2
    result = orchestrate(args)
    print_summary(result)
    if args.out:
        import torch

        result = {
            "date": datetime.date.today().isoformat(),
            "commit": _git_commit(),
            "machine": torch.cuda.get_device_name(args.device),
            "command": "foundry " + " ".join(sys.argv[1:]),
            "foundry_version": __version__,
            **result,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"  results written to {args.out}")
    ok = (
        result["bit_exact_all"]
        and result["load_stream_captures"] == 0
        and result["load_warmup_forwards"] == 0
    )
    return 0 if ok else 1


def cmd_tp(args) -> int:
    from foundry_tools.tp import orchestrate, visible_gpus

    gpus = visible_gpus()
    needed = 1 if args.share_gpus else args.world_size
    if gpus < needed:
        print(
            f"foundry tp: --world-size {args.world_size} needs {needed} NVIDIA GPU{'s' if needed > 1 else ''}"
            f"{' (--share-gpus)' if args.share_gpus else ''}, this machine shows {gpus}; nothing was run."
        )
        return 2
    result = orchestrate(args)
    for r in result["ranks"]:
        print(
            f"  rank {r['rank']}: {r['graphs']} graph, {r['symm_mem_collectives']} symmetric-memory "
            f"collective kernels, {r['nccl_kernels']} NCCL; capture {r['capture_s']:.3f} s, restore "
            f"{r['restore_s']:.3f} s; {r['steps_identical']}/{r['steps']} steps identical to SAVE, "
            f"{r['load_decode_captures']} captures at LOAD"
        )
    if "reproduce" in result:
        rep = result["reproduce"]
        print(
            f"  second SAVE: fingerprints equal {rep['fingerprints_equal']}, offsets equal {rep['offsets_equal']}"
        )
    failed = f": {result['failed']}" if result.get("failed") else ""
    print(f"foundry tp: {'OK' if result['ok'] else 'FAILED'} (world size {result['world_size']}){failed}")
    if args.out:
        import torch

        result = {
            "date": datetime.date.today().isoformat(),
            "commit": _git_commit(),
            "machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
            "command": "foundry " + " ".join(sys.argv[1:]),
            "foundry_version": __version__,
            **result,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"  results written to {args.out}")
    return 0 if result["ok"] else 1


def cmd_bench(args) -> int:
    from foundry_tools.bench import plot, print_table, summarize
    from foundry_tools.demo import gpu_available, orchestrate

    if not gpu_available():
        print("foundry bench: no NVIDIA GPU is visible on this machine; nothing was run.")
        return 2
    summary = summarize(orchestrate(args))
    print_table(summary)
    import torch

    record = {
        "date": datetime.date.today().isoformat(),
        "commit": _git_commit(),
        "machine": torch.cuda.get_device_name(args.device),
        "command": "foundry " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "replays_per_size": args.replays,
        **summary,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"  results written to {args.out}")
        png = str(Path(args.out).with_suffix(".png"))
        if plot(summary, png):
            print(f"  plot written to {png}")
        else:
            print("  (matplotlib is not installed: no plot)")
    return 0 if summary["bit_exact_all"] else 1


def cmd_soak(args) -> int:
    from foundry_tools.demo import gpu_available
    from foundry_tools.soak import orchestrate, print_summary

    if not gpu_available():
        print("foundry soak: no NVIDIA GPU is visible on this machine; nothing was run.")
        return 2
    record, status = orchestrate(args, commit=_git_commit(), command="foundry " + " ".join(sys.argv[1:]))
    print_summary(record)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"  results written to {args.out}")
    return status


def build_parser() -> argparse.ArgumentParser:
    """The ``foundry`` parser. Imports no torch and no tool: only ``foundry_tools.options``."""
    from foundry_tools.options import (
        BENCH_BATCH_SIZES,
        CHECK_STRUCTURE_HELP,
        NO_PREPARE_HELP,
        REINSTANTIATE_HELP,
        HelpFormatter,
        add_arguments,
        add_soak_arguments,
        add_tp_arguments,
    )

    fmt = HelpFormatter
    p = argparse.ArgumentParser(
        prog="foundry", description="CUDA-graph persistence for LLM serving engines", formatter_class=fmt
    )
    p.add_argument("--version", action="version", version=f"foundry {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    what = "SAVE the embedded model's decode graphs, LOAD them in a fresh process, compare"
    d = sub.add_parser("demo", help=what, description=what, formatter_class=fmt)
    add_arguments(d)
    d.set_defaults(preset="1.7b")
    d.add_argument("--workdir", default=None, help="where the archive and reference outputs go")
    d.add_argument("--out", default=None, help="write the results as JSON here")
    d.add_argument("--no-prepare", action="store_true", help=NO_PREPARE_HELP)
    d.add_argument("--check-structure", action="store_true", help=CHECK_STRUCTURE_HELP)
    d.set_defaults(func=cmd_demo)

    what = "native capture vs restore, and replay parity, in one run"
    b = sub.add_parser("bench", help=what, description=what, formatter_class=fmt)
    add_arguments(b)
    b.set_defaults(preset="1.7b", batch_sizes=list(BENCH_BATCH_SIZES))
    b.add_argument("--replays", type=int, default=200, help="timed replays per batch size (median)")
    b.add_argument("--workdir", default=None, help="where the archives and reference outputs go")
    b.add_argument("--out", default=None, help="JSON results (a PNG plot is written beside it)")
    b.add_argument("--no-prepare", action="store_true", help=NO_PREPARE_HELP)
    b.add_argument(
        "--upload", action="store_true", help="LOAD: upload each graph to the device as it is restored"
    )
    b.add_argument("--check-structure", action="store_true", help=CHECK_STRUCTURE_HELP)
    b.add_argument("--reinstantiate", action="store_true", help=REINSTANTIATE_HELP)
    b.add_argument(
        "--presets",
        default=None,
        help="other model sizes to save and restore too, for restore time against nodes (e.g. tiny,small)",
    )
    b.set_defaults(func=cmd_bench)

    what = (
        "10,000 replays of restored graphs, load/unload cycles with memory curves, and (with --tests) the "
        "CPU reliability tests, into one JSON record"
    )
    s = sub.add_parser("soak", help=what, description=what, formatter_class=fmt)
    add_arguments(s)
    add_soak_arguments(s)
    s.set_defaults(preset="1.7b", func=cmd_soak)

    what = (
        "the embedded model tensor-parallel over this host's GPUs: SAVE per rank, LOAD in fresh processes, "
        "all-reduce through torch symmetric memory inside the graph, outputs compared"
    )
    t = sub.add_parser("tp", help=what, description=what, formatter_class=fmt)
    add_tp_arguments(t)
    t.add_argument("--workdir", default=None, help="where the archives and reference outputs go")
    t.add_argument("--out", default=None, help="write the results as JSON here")
    t.add_argument("--reproduce", action="store_true", help="SAVE twice; fingerprints and offsets must match")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds each phase may take")
    t.set_defaults(func=cmd_tp)

    what = "show an archive's graphs, kernels, modules, bytes and fingerprint"
    i = sub.add_parser("inspect", help=what, description=what, formatter_class=fmt)
    i.add_argument("archive", help="archive directory (or its carried caches, ARCHIVE.caches)")
    i.add_argument("--kernels", action="store_true", help="also list every kernel by name")
    i.set_defaults(func=cmd_inspect)

    what = "check an archive's integrity and fingerprint against this machine"
    v = sub.add_parser("verify", help=what, description=what, formatter_class=fmt)
    v.add_argument("archive", help="archive directory")
    v.add_argument(
        "--device",
        type=int,
        default=None,
        help="CUDA device index it would be loaded on (default: the one it was saved on)",
    )
    v.add_argument("--rank", type=int, default=None, help="rank it would be loaded as (default: its own)")
    v.add_argument(
        "--world-size", type=int, default=None, help="ranks of the launch (default: as it was saved)"
    )
    v.add_argument("--digest", default=None, help="also require this archive digest (sha256)")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
