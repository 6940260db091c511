"""The ``foundry`` subcommands these tools bring: demo, bench, soak and tp.

The core's command line (``foundry_core.cli``) does not import this package: it finds these through
the entry-point group ``foundry_graphs.commands``, where each name maps to one of the ``add_*``
functions below. Each takes the ``foundry`` parser's subparsers and adds its subcommand. Loading this
module is cheap (argparse and ``foundry_tools.options``, no torch); the tools themselves are imported
inside the subcommand functions, when one runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from foundry_core import __version__

from .options import (
    BENCH_BATCH_SIZES,
    CHECK_STRUCTURE_HELP,
    NO_PREPARE_HELP,
    REINSTANTIATE_HELP,
    HelpFormatter,
    add_arguments,
    add_soak_arguments,
    add_tp_arguments,
)

NO_GPU = "no NVIDIA GPU is visible on this machine (torch.cuda.is_available() is False); nothing was run"


def git_commit() -> str:
    """The commit the results were measured at: FOUNDRY_COMMIT, else the checkout's HEAD, else unknown."""
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


def _record(result: dict, machine: str) -> dict:
    """A result with what says where and how it was measured in front of it."""
    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": machine,
        "command": "foundry " + " ".join(sys.argv[1:]),
        "foundry_version": __version__,
        **result,
    }


def _write(out: str, record: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"  results written to {out}")


def cmd_demo(args) -> int:
    from .demo import gpu_available, orchestrate, print_summary

    if not gpu_available():
        print(f"foundry demo: {NO_GPU} (the demo captures and restores CUDA graphs).")
        return 2
    result = orchestrate(args)
    print_summary(result)
    if args.out:
        import torch

        result = _record(result, torch.cuda.get_device_name(args.device))
        _write(args.out, result)
    ok = (
        result["bit_exact_all"]
        and result["load_stream_captures"] == 0
        and result["load_warmup_forwards"] == 0
    )
    return 0 if ok else 1


def cmd_tp(args) -> int:
    from .tp import orchestrate, visible_gpus

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

        result = _record(result, f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}")
        _write(args.out, result)
    return 0 if result["ok"] else 1


def cmd_bench(args) -> int:
    from .bench import plot, print_table, summarize
    from .demo import gpu_available, orchestrate

    if not gpu_available():
        print(f"foundry bench: {NO_GPU}.")
        return 2
    summary = summarize(orchestrate(args))
    print_table(summary)
    import torch

    record = _record(
        {"preset": args.preset, "replays_per_size": args.replays, **summary},
        torch.cuda.get_device_name(args.device),
    )
    if args.out:
        _write(args.out, record)
        png = str(Path(args.out).with_suffix(".png"))
        if plot(summary, png):
            print(f"  plot written to {png}")
        else:
            print("  (matplotlib is not installed: no plot)")
    return 0 if summary["bit_exact_all"] else 1


def cmd_soak(args) -> int:
    from .demo import gpu_available
    from .soak import orchestrate, print_summary

    if not gpu_available():
        print(f"foundry soak: {NO_GPU}.")
        return 2
    record, status = orchestrate(args, commit=git_commit(), command="foundry " + " ".join(sys.argv[1:]))
    print_summary(record)
    if args.out:
        _write(args.out, record)
    return status


def _add(sub, name: str, what: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=what, description=what, formatter_class=HelpFormatter)


def add_demo(sub) -> None:
    d = _add(sub, "demo", "SAVE the embedded model's decode graphs, LOAD them in a fresh process, compare")
    add_arguments(d)
    d.set_defaults(preset="1.7b")
    d.add_argument("--workdir", default=None, help="where the archive and reference outputs go")
    d.add_argument("--out", default=None, help="write the results as JSON here")
    d.add_argument("--no-prepare", action="store_true", help=NO_PREPARE_HELP)
    d.add_argument("--check-structure", action="store_true", help=CHECK_STRUCTURE_HELP)
    d.set_defaults(func=cmd_demo)


def add_bench(sub) -> None:
    b = _add(sub, "bench", "native capture vs restore, and replay parity, in one run")
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


def add_soak(sub) -> None:
    what = (
        "10,000 replays of restored graphs, load/unload cycles with memory curves, and (with --tests) the "
        "CPU reliability tests, into one JSON record"
    )
    s = _add(sub, "soak", what)
    add_arguments(s)
    add_soak_arguments(s)
    s.set_defaults(preset="1.7b", func=cmd_soak)


def add_tp(sub) -> None:
    what = (
        "the embedded model tensor-parallel over this host's GPUs: SAVE per rank, LOAD in fresh processes, "
        "all-reduce through torch symmetric memory inside the graph, outputs compared"
    )
    t = _add(sub, "tp", what)
    add_tp_arguments(t)
    t.add_argument("--workdir", default=None, help="where the archives and reference outputs go")
    t.add_argument("--out", default=None, help="write the results as JSON here")
    t.add_argument("--reproduce", action="store_true", help="SAVE twice; fingerprints and offsets must match")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds each phase may take")
    t.set_defaults(func=cmd_tp)


# What the packaging metadata declares in ``foundry_graphs.commands`` (name = foundry_tools.commands:FUNC).
ENTRY_POINTS = {"demo": "add_demo", "bench": "add_bench", "soak": "add_soak", "tp": "add_tp"}
