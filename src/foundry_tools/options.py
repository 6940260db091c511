"""The command-line options of ``foundry demo``, ``bench`` and ``soak``, and their defaults.

Kept apart from the tools themselves so that building the ``foundry`` parser (``foundry --help``,
``foundry --version``) imports neither torch nor the tools: this module imports only argparse and
``foundry_core.config``.
"""

from __future__ import annotations

import argparse

from foundry_core.config import DEFAULT_REGION_BASE, DEFAULT_REGION_SIZE

# The workloads ``foundry_tools.workloads.Workload`` builds.
VARIANTS = ("qwen3", "qwen3-compiled", "hf-qwen3")
PRESETS = ("tiny", "small", "0.6b", "1.7b")

# SGLang's default decode capture list starts 1, 2, 4, 8, then steps of 8 (and 16 further up).
DEFAULT_BATCH_SIZES = (
    1,
    2,
    4,
    8,
    12,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    72,
    80,
    88,
    96,
    104,
    112,
    120,
    128,
    144,
    160,
)

# ``foundry bench``: a long decode capture list, 60 graphs: every size to 32, then steps of 8 to 256.
BENCH_BATCH_SIZES = tuple(range(1, 33)) + tuple(range(40, 257, 8))

# ``foundry soak``.
DEFAULT_REPLAYS = 10_000
DEFAULT_CYCLES = 20
DEFAULT_WARMUP_CYCLES = 1
DEFAULT_HOST_GROWTH_LIMIT_MIB = 64


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except where there is none to show (None, a flag's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def address(text: str) -> int:
    """An integer in any base Python reads (``0x600000000000``, ``105553116266496``)."""
    return int(text, 0)


NO_PREPARE_HELP = (
    "LOAD: rebuild modules and graphs after the model is built instead of on a thread while it is "
    "built (foundry_core.prepare)"
)


CHECK_STRUCTURE_HELP = (
    "LOAD: read every restored graph back from the driver and compare it with the archive's "
    "description, and the native twins (with --replays) with it too, addresses aside"
)


REINSTANTIATE_HELP = (
    "LOAD, an experiment: after the restore, replace each graph's executable by one instantiated "
    "afresh from it (to tell whether re-pointing executables built ahead slows their launch)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model, batch sizes and region: what a SAVE and every LOAD must repeat identically."""
    p.add_argument("--variant", default="qwen3", choices=VARIANTS, help="which workload to build and capture")
    p.add_argument("--preset", default="small", help=f"model size: {', '.join(PRESETS)}")
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_BATCH_SIZES),
        help="one decode graph per batch size",
    )
    p.add_argument("--max-seq-len", type=int, default=512, help="KV cache length per sequence")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument(
        "--region-base",
        type=address,
        default=hex(DEFAULT_REGION_BASE),  # a string default goes through ``type``: an int once parsed
        help="fixed virtual address of the device-memory region",
    )
    p.add_argument(
        "--region-size",
        type=int,
        default=DEFAULT_REGION_SIZE,
        help=f"virtual size of the region, in bytes (default: %(default)s, {DEFAULT_REGION_SIZE / 2**30:g} GiB)",
    )
    p.add_argument("--archive", default=None, help="archive directory (default: a temporary one)")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The options of :func:`add_arguments` (``--archive`` aside) as a worker process's command line,
    so that the SAVE and LOAD workers a tool starts get the same model, sizes and region."""
    return [
        "--variant",
        args.variant,
        "--preset",
        args.preset,
        "--max-seq-len",
        str(args.max_seq_len),
        "--seed",
        str(args.seed),
        "--device",
        str(args.device),
        "--region-base",
        hex(args.region_base),
        "--region-size",
        str(args.region_size),
        "--batch-sizes",
        *map(str, args.batch_sizes),
    ]


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``foundry soak`` adds to the demo's (model, sizes, region)."""
    p.add_argument("--replays", type=int, default=DEFAULT_REPLAYS, help="soak replays in all (round robin)")
    p.add_argument("--cycles", type=int, default=DEFAULT_CYCLES, help="load/unload cycles after the soak")
    p.add_argument(
        "--warmup-cycles",
        type=int,
        default=DEFAULT_WARMUP_CYCLES,
        help="first cycles left out of the memory growth (lazily created driver and allocator state)",
    )
    p.add_argument(
        "--host-growth-limit-mib",
        type=int,
        default=DEFAULT_HOST_GROWTH_LIMIT_MIB,
        help="largest host RSS growth over the cycles (after the warm-up) that passes",
    )
    p.add_argument(
        "--tests",
        default=None,
        metavar="DIR",
        help="the repository's tests/ folder: run its CPU reliability tests (tamper matrix, damage "
        "fuzzing, SIGKILL crash test) alongside, counted. Without it that phase is skipped",
    )
    p.add_argument(
        "--no-cpu-suite", action="store_true", help="skip the CPU reliability tests even with --tests"
    )
    p.add_argument("--workdir", default=None, help="archive, baseline and the CPU suite's log go here")
    p.add_argument("--out", default=None, help="write the reliability record as JSON here")


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``foundry tp`` that each rank's process takes too."""
    p.add_argument("--world-size", type=int, default=2, help="ranks, one GPU each")
    p.add_argument("--preset", default="small", help="embedded model size (tiny, small, 0.6b, 1.7b)")
    p.add_argument("--batch-size", type=int, default=8, help="the one padded decode batch size")
    p.add_argument("--max-seq-len", type=int, default=256, help="KV cache length per sequence")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    p.add_argument(
        "--all-reduce",
        default="auto",
        choices=("auto", "one_shot", "multimem"),
        help="torch symmetric-memory kernel: multimem needs NVLink multicast; auto takes it where the GPUs have it",
    )
    p.add_argument(
        "--region-base", type=address, default=hex(DEFAULT_REGION_BASE), help="region base address"
    )
    p.add_argument("--region-size", type=int, default=DEFAULT_REGION_SIZE, help="region size in bytes")
    p.add_argument(
        "--share-gpus",
        action="store_true",
        help="ranks share this host's GPUs round-robin (rank r on GPU r mod n), torch told to allow it "
        "(TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES): the TP path (processes, peer mappings, placement) "
        "on fewer GPUs than ranks; its times mean nothing (the ranks' spinning kernels time-slice)",
    )
