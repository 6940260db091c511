"""Cold and warm starts of a real engine server (SGLang or vLLM), stock and with Foundry, on one GPU.

    python benchmarks/cold_start.py --engine sglang --out $OUT/cold-sglang-h200.json --logs $OUT/logs

Each run is a fresh ``sglang.launch_server`` / ``vllm serve`` process in its own session, started with
a Qwen3-1.7B-shaped model (config and a small tokenizer written locally, dummy weights). The clock
starts just before the process is spawned; the server is *ready* once ``GET /health`` and
``GET /v1/models`` both answer 200; then one ``POST /v1/completions`` with 4 token-id prompts x 64
greedy tokens (top-5 logprobs) gives the time to first token, and an identical second request checks
that the server agrees with itself. Runs, in this order:

* ``save``: Foundry, mode ``auto``, empty archive: captures the graphs and packs the caches;
* ``load_cold``: Foundry, same archive, every cache emptied first (HOME and TMPDIR emptied, at the
  same paths for every run as in containers of one image; global caches removed, page cache dropped
  where allowed);
* ``stock_cold``: no plugin, every cache emptied first;
* ``load_warm`` / ``stock_warm``: each again with the caches its own cold run left (separate homes,
  so a stock run never warms a Foundry run or the other way round).

What was compiled is counted on disk: for Foundry runs the files in Foundry's private cache copies
(``FOUNDRY_CACHE_ROOT``) that did not come from the archive, and for every run the files that appeared
under its HOME, its TMPDIR and ``/tmp/torchinductor_*`` (caches nobody redirected). Compile-looking
log lines are counted too, as secondary evidence. The engine's own startup timers and Foundry's start
report are copied into each run.

The JSON at ``--out`` is rewritten after every run (a failed run keeps its error and log tail); a PNG
with the same stem shows each run's start split into phases when matplotlib is importable. One log per
run, ``<engine>-<run>.log`` in ``--logs``, stdout and stderr together, each line prefixed with the
seconds since spawn. Self-contained on purpose: it imports nothing from the plugins, so the stock
server cannot pick them up through this process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import signal
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import startup_stacks  # noqa: E402  (beside this file)

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENGINES = ("sglang", "vllm")
RUNS = ("save", "load_cold", "stock_cold", "load_warm", "stock_warm")
FOUNDRY_RUNS = ("save", "load_cold", "load_warm")
#: A warm run starts with the caches (HOME, TMPDIR) its cold sibling left behind.
WARM_OF = {"load_warm": "load_cold", "stock_warm": "stock_cold"}
#: ``--repeat N`` adds the cold pair N-1 more times, alternating: load_cold_2, stock_cold_2, ...
REPEATED = ("load_cold", "stock_cold")


def kind(run: str) -> str:
    """The run a repeat repeats (``load_cold_2`` -> ``load_cold``); a run's own name otherwise."""
    base, _, n = run.rpartition("_")
    return base if n.isdigit() and base in REPEATED else run


def repeats(first: str, runs: dict[str, Any]) -> list[str]:
    """``first`` and its repeats present in ``runs``, in order."""
    names = [first] if first in runs else []
    i = 2
    while f"{first}_{i}" in runs:
        names.append(f"{first}_{i}")
        i += 1
    return names


MIN_RUN_S = 60  # a run is not started with less budget than this

# Qwen3-1.7B's shape; dummy weights, so nothing is downloaded.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
}
# The servers only need a tokenizer that loads: prompts are token ids, outputs are compared as ids.
TOKENIZER_WORDS = 4096
TOKENIZER_SPECIALS = ("<unk>", "<|endoftext|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"

#: Four different prompts (one request, prompt = list of lists); ids stay inside the tokenizer's vocab
#: so no server refuses them as out of vocabulary.
PROMPTS = [
    [len(TOKENIZER_SPECIALS) + (37 * i + 11 * j) % TOKENIZER_WORDS for j in range(6 + 5 * i)]
    for i in range(4)
]
MAX_TOKENS = 64
TOP_LOGPROBS = 5
#: The seeded-sampling request (--sampling): both engines' OpenAI servers take a per-request seed.
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 4321}

PLUGIN_GROUPS = {"sglang": "sglang.srt.plugins", "vllm": "vllm.general_plugins"}
PLUGIN_TARGETS = {"sglang": "foundry_sglang_plugin:register", "vllm": "foundry_vllm_plugin:register"}
PLUGIN_NAME = "foundry"
SHIM_DIST = "foundry_graphs_cold_start_shim-0.0.0"
# The plugin's report directory variable, spelled out (importing the plugin here is what we avoid).
SGLANG_REPORT_ENV = "FOUNDRY_SGLANG_REPORT_DIR"
CACHE_ROOT_ENV = "FOUNDRY_CACHE_ROOT"  # foundry_core.engine.caches.ROOT_ENV
CARRIED_LIST = ".foundry-carried.json"  # foundry_core.engine.caches.CARRIED_LIST
PROFILE_ENV = "FOUNDRY_PROFILE_DIR"  # foundry_core.engine.profiling.ENV

#: Foundry settings a run must not inherit from the calling shell.
FOUNDRY_SETTINGS_ENV = (
    "FOUNDRY_SGLANG",
    "FOUNDRY_MODE",
    "FOUNDRY_CONFIG",
    "FOUNDRY_ARCHIVE_DIR",
    "FOUNDRY_ARCHIVE_DIGEST",
    "FOUNDRY_ARCHIVE_COMPRESS",
    "FOUNDRY_REGION_BASE",
    "FOUNDRY_REGION_SIZE",
    "FOUNDRY_SGLANG_REPLAY_TIMING",
    "FOUNDRY_SGLANG_REPLICA_MODES",
    SGLANG_REPORT_ENV,
    CACHE_ROOT_ENV,
    PROFILE_ENV,
)
#: Cache locations a run must not inherit: Foundry sets the ones it handles inside its engine
#: processes, and stock must fall back to the defaults under its fresh HOME/TMPDIR.
CACHE_ENV = (
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "VLLM_CACHE_ROOT",
    "TVM_FFI_CACHE_DIR",
    "FLASHINFER_WORKSPACE_BASE",
    "DG_JIT_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "XDG_CACHE_HOME",
    "TRITON_HOME",  # would move ~/.triton out of the fresh HOME
    "TORCH_EXTENSIONS_DIR",  # would move ~/.cache/torch_extensions out of it
)
#: Global caches a cold run must not find (removed before each cold run).
GLOBAL_CACHES = ("/tmp/torchinductor_*", "/root/.cache", "/root/.triton", "/root/.nv")
# Files caches keep for their own bookkeeping while running: not compilations. FlashInfer opens its
# flashinfer_jit.log when it is imported, whether or not it builds anything (ninja's .ninja_log,
# which only a build writes, still counts).
SKIP_SUFFIXES = (".lock", ".tmp", ".pid", ".log")
#: Folders under HOME that fill up without compiling anything (Hugging Face's modules package stub,
#: usage-stats configs): reported apart so they do not count as compilations.
NOT_COMPILES = ("home/.cache/huggingface", "home/.config")

# --- log patterns (one table each) -----------------------------------------------------------------

#: The engine's own startup timers: one number per match (a ``name`` group splits a timer by name).
ENGINE_TIMERS: dict[str, dict[str, str]] = {
    "sglang": {
        "init_distributed_s": r"Init torch distributed ends\. elapsed=([\d.]+) s",
        "load_weight_s": r"Load weight end\. elapsed=([\d.]+) s",
        "decode_graph_s": r"Capture (?:target )?decode .{0,20}?graph end\. elapsed=([\d.]+) s",
        "prefill_graph_s": r"Capture (?:target )?prefill .{0,20}?graph end\. elapsed=([\d.]+) s",
        "startup": r"Startup timing: (?P<name>.+?) took ([\d.]+) ?s",
    },
    "vllm": {
        "load_weights_s": r"Loading weights took ([\d.]+) seconds",
        "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
        "dynamo_transform_s": r"Dynamo bytecode transform time: ([\d.]+) s",
        "compile_graph_s": r"Compiling a graph for (?:compile range|dynamic shape).*?takes ([\d.]+) s",
        "compile_cache_load_s": r"Directly load the compiled graph\(s\) .*?took ([\d.]+) s",
        "torch_compile_total_s": r"torch\.compile (?:takes|took) ([\d.]+) s in total",
        "initial_warmup_s": r"Initial profiling/warmup run took ([\d.]+) s",
        "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
        "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
        "foundry_save_s": r"Foundry rank 0: saved \d+ decode graphs to .* in ([\d.]+) s",
        "foundry_restore_s": r"Foundry rank 0: restored \d+ decode graphs in ([\d.]+) s",
    },
}
#: Moments (first matching line) that split a start into phases.
PHASE_MARKS: dict[str, dict[str, str]] = {
    "sglang": {
        "imports_done": r"server_args=ServerArgs\(",
        "weights_begin": r"Load weight begin",
        "graphs_begin": r"Capture (?:target )?decode .{0,20}?graph begin",
        "graphs_end": r"Capture (?:target )?decode .{0,20}?graph end",
        "server_ready_log": r"The server is fired up and ready to roll",
    },
    "vllm": {
        "imports_done": r"non-default args:",
        "weights_begin": r"Starting to load model",
        "graphs_begin": r"Capturing CUDA graphs",
        "graphs_end": r"Graph capturing finished|Foundry rank 0: restored",
        # the end of vLLM's warmups after the graphs (sampler, kernel warmup, autotune lookups)
        "warmups_end": r"Kernel JIT monitor activated",
        "server_ready_log": r"Application startup complete",
    },
}
#: Lines that look like compilation (secondary evidence; counted per pattern, case-insensitive).
COMPILE_MARKERS = {
    "compiling": r"\bcompiling\b",
    "compile_took": r"compil(?:e|ed|ing|ation)\b.*\b(?:took|takes|in)\s+[\d.]+\s*s",
    "torch_compile": r"torch\.compile",
    "triton": r"\btriton\b",
    "nvcc": r"\bnvcc\b",
    "ninja": r"\bninja\b",
    "jit": r"\bJIT\b",
}
_LOG_PREFIX = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\] ?(.*)$")

# --- arguments ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--out", required=True, help="result JSON (rewritten after every run); PNG beside it")
    p.add_argument("--logs", required=True, help="directory for <engine>-<run>.log")
    p.add_argument("--workdir", default=None, help="model, archive, homes, caches (default: new temp dir)")
    p.add_argument("--budget", type=float, default=2400.0, help="seconds for all runs together")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per run")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--region-size", default="128GiB", help="Foundry region per rank ([region] size)")
    p.add_argument(
        "--keep-global-caches",
        action="store_true",
        help=f"do not delete {', '.join(GLOBAL_CACHES)} before cold runs (for a machine you keep)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="Hugging Face config.json of the model to serve (default: the Qwen3-1.7B shape); "
        "benchmarks/configs/ has an MoE and a hybrid one",
    )
    p.add_argument(
        "--weights",
        choices=("dummy", "seeded"),
        default="dummy",
        help="dummy: the engines' --load-format dummy (fast, but every prompt gets the same degenerate "
        "output); seeded: a checkpoint written by foundry_tools.weights, whose outputs differ by prompt",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --weights seeded")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens generated per prompt")
    p.add_argument(
        "--sampling",
        action="store_true",
        help="also send one request with seeded sampling (temperature, top-p, top-k, a per-request seed) "
        "and compare its tokens and logprobs across runs as the greedy ones",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile Foundry runs' graph phase on the host (FOUNDRY_PROFILE_DIR=<logs>/profile-<run>); "
        "their timings are then not real ones",
    )
    p.add_argument(
        "--sample-stacks",
        action="store_true",
        help="sample every server process's main-thread stack (benchmarks/startup_stacks.py) into "
        "<logs>/stacks-<run>, to name where a start spends its time; timings then carry its overhead",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the cold pair (LOAD, stock) this many times in all, alternating, for the spread of "
        "their ratio (the extra runs are load_cold_2, stock_cold_2, ...; they need the SAVE)",
    )
    p.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for every run, stock and Foundry alike (repeatable), e.g. "
        "VLLM_USE_V2_MODEL_RUNNER=1 for a hybrid model on vLLM",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra server argument for every run (repeatable; --engine-arg=--flag for one that "
        "starts with a dash)",
    )
    p.add_argument(
        "--one-prompt-per-request",
        action="store_true",
        help="send each prompt as its own request, one after another, instead of all in one request: "
        "the engine then cannot batch them differently from run to run (vLLM's hybrid path drifts "
        "when it does); the outputs are compared the same way",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out (same engine, commit and workdir) and add these to them: "
        "warm runs in a later call on the same machine",
    )
    opts = p.parse_args(argv)
    opts.runs = [r.strip() for r in opts.runs.split(",") if r.strip()]
    # A repeat can be named on its own only to add it to an earlier call's result (its SAVE and its
    # first pair are there): a long benchmark then spreads over device calls.
    unknown = [r for r in opts.runs if r not in RUNS and not (opts.resume and kind(r) in REPEATED)]
    if unknown or len(set(opts.runs)) != len(opts.runs):
        p.error(
            f"--runs takes each of {', '.join(RUNS)} at most once, and with --resume repeats such as "
            f"load_cold_2 (got {unknown or opts.runs})"
        )
    if opts.repeat < 1:
        p.error("--repeat must be at least 1")
    bad = [e for e in opts.engine_env if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        p.error(f"--engine-env takes NAME=VALUE (got {bad[0]!r})")
    # The fixed order is part of the method (cold before warm, save before load), then the repeats
    # of the cold pair, alternating, so that a drift of the machine reaches both alike.
    named = [r for r in opts.runs if r not in RUNS]
    opts.runs = [r for r in RUNS if r in opts.runs]
    opts.runs += sorted(named, key=lambda r: (int(r.rpartition("_")[2]), REPEATED.index(kind(r))))
    opts.runs += [f"{r}_{i}" for i in range(2, opts.repeat + 1) for r in REPEATED if f"{r}_{i}" not in named]
    return opts


# --- the model directory -----------------------------------------------------------------------------


def tokenizer_vocab() -> dict[str, int]:
    words = [*TOKENIZER_SPECIALS, *(f"w{i}" for i in range(TOKENIZER_WORDS))]
    return {w: i for i, w in enumerate(words)}


def tokenizer_files() -> dict[str, dict[str, Any]]:
    """A word-level tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``, written by hand: the
    fallback where the parent's interpreter lacks ``tokenizers``/``transformers`` (the vLLM site)."""
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(TOKENIZER_SPECIALS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": tokenizer_vocab(), "unk_token": "<unk>"},
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config()}


def tokenizer_config() -> dict[str, Any]:
    # PreTrainedTokenizerFast loads in transformers 4 and 5 alike (5 maps it to its TokenizersBackend),
    # and an explicit class keeps AutoTokenizer from picking Qwen2's tokenizer by model_type.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 40960,
    }


def write_tokenizer(model_dir: Path) -> str:
    """Build the tokenizer with the ``tokenizers`` package and save it through transformers where
    both import; otherwise write the same files by hand. Returns which way it went."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        for name, data in tokenizer_files().items():
            (model_dir / name).write_text(json.dumps(data, indent=1))
        return "hand-written"
    tok = Tokenizer(models.WordLevel(vocab=tokenizer_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(TOKENIZER_SPECIALS))
    special = {k: v for k, v in tokenizer_config().items() if k.endswith("_token")}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(model_dir))
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = tokenizer_config()["tokenizer_class"]
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return "tokenizers+transformers"


def write_model(model_dir: Path, config: dict[str, Any] | None = None) -> str:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config or MODEL_CONFIG, indent=1))
    return write_tokenizer(model_dir)


def write_seeded_weights(model_dir: Path, seed: int) -> dict[str, Any]:
    """A checkpoint from ``foundry_tools.weights`` (in a subprocess: this script imports no Foundry
    code), so that prompts get different outputs and a comparison of logprobs means something."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "foundry_tools.weights", "--config", str(model_dir / "config.json")]
    cmd += ["--out", str(model_dir), "--seed", str(seed)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(SRC)])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"foundry_tools.weights failed: {done.stderr.strip()[-2000:]}")
    try:
        summary = json.loads(done.stdout)
    except ValueError:
        summary = {"stdout": done.stdout[-2000:]}
    return {"seed": seed, "seconds": round(time.monotonic() - t0, 1), "summary": summary}


def foundry_toml(archive_dir: Path, region_size: str) -> str:
    return f'mode = "auto"\narchive_dir = "{archive_dir}"\n\n[region]\nsize = "{region_size}"\n'


def write_entry_point_shim(root: Path) -> Path:
    """A minimal ``.dist-info`` declaring the plugin's entry points (both engines' groups), so an
    engine finds the plugin when ``src/`` is on PYTHONPATH but not pip-installed: both engines
    discover plugins through entry points only. Only the Foundry runs get it on their path."""
    info = root / f"{SHIM_DIST}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    name, version = SHIM_DIST.rsplit("-", 1)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = "".join(f"[{PLUGIN_GROUPS[e]}]\n{PLUGIN_NAME} = {PLUGIN_TARGETS[e]}\n\n" for e in ENGINES)
    (info / "entry_points.txt").write_text(groups)
    return root


def installed_plugins(engine: str) -> list[str]:
    """Plugin names the engine would find on this interpreter's path (no engine import), over all of
    its plugin groups: the stock allow-list names them all, so only Foundry is kept out."""
    from importlib.metadata import entry_points

    everything = entry_points()
    groups = everything.groups if hasattr(everything, "groups") else everything.keys()  # 3.12 / 3.10
    names: set[str] = set()
    for group in groups:
        if group.startswith(f"{engine}."):
            names.update(ep.name for ep in entry_points(group=group))
    return sorted(names)


# --- one run's command and environment ---------------------------------------------------------------


@dataclasses.dataclass
class RunPaths:
    """Where one run keeps its state; a warm run shares ``home``/``tmp`` with its cold sibling.

    Every run sees the same HOME and TMPDIR *paths*, as every container started from one image does:
    engines put them into cache keys (vLLM hashes its HOME-derived settings into the torch.compile
    cache key), so a SAVE under one HOME and a LOAD under another would miss for a reason no
    deployment has. Each run's own contents are kept in ``kept_home``/``kept_tmp`` between runs and
    moved into place for the run (:func:`prepare_run`, :func:`put_away`)."""

    home: Path
    tmp: Path
    kept_home: Path
    kept_tmp: Path
    cache_root: Path  # FOUNDRY_CACHE_ROOT (Foundry runs)
    report_dir: Path  # FOUNDRY_SGLANG_REPORT_DIR (Foundry runs on SGLang)

    @classmethod
    def for_run(cls, workdir: Path, run: str) -> RunPaths:
        owner = WARM_OF.get(run, run)
        # Short names: engines put their IPC sockets in TMPDIR, and a socket path has ~107 bytes.
        return cls(
            home=workdir / "home",
            tmp=workdir / "tmp",
            kept_home=workdir / f"home-{owner}",
            kept_tmp=workdir / f"tmp-{owner}",
            # One root for every Foundry run: Foundry's private folder under it is named after the
            # archive, so a LOAD uses the path its SAVE used (caches record absolute paths).
            cache_root=workdir / "foundry-caches",
            report_dir=workdir / f"report-{run}",
        )


def server_command(
    engine: str, model_dir: Path, port: int, toml: Path | None, *, dummy: bool = True
) -> list[str]:
    """The server's command line; identical for stock and Foundry except the two Foundry flags.
    ``dummy``: random weights of the engine's own (``--load-format dummy``) instead of the files."""
    load = ["--load-format", "dummy"] if dummy else []
    if engine == "sglang":
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir)]
        argv += [*load, "--attention-backend", "fa3", "--sampling-backend", "pytorch"]
        argv += ["--cuda-graph-max-bs-decode", "512", "--cuda-graph-backend-prefill", "disabled"]
        argv += ["--mem-fraction-static", "0.5", "--random-seed", "0", "--log-level", "info"]
    else:
        # The module rather than a ``vllm`` found on PATH: the same interpreter and engine site as
        # the version recorded here (a pip --target site puts its console scripts off PATH anyway).
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
        argv += [*load, "--max-num-seqs", "512", "--gpu-memory-utilization", "0.5"]
        argv += ["--seed", "0", "--max-model-len", "4096"]
    argv += ["--port", str(port), "--host", "127.0.0.1"]
    if toml is not None:
        argv += ["--enable-foundry", "--foundry-config", str(toml)]
    return argv


def child_env(
    base: dict[str, str],
    engine: str,
    run: str,
    paths: RunPaths,
    shim: Path | None,
    other_plugins: list[str],
    user_base: str | None = None,
) -> dict[str, str]:
    """One run's environment: fresh or kept HOME/TMPDIR, no inherited cache locations or Foundry
    settings, offline, deterministic hashing; stock keeps the plugin out through the engine's
    allow-list, Foundry runs get the entry-point shim and a kept cache root."""
    foundry = kind(run) in FOUNDRY_RUNS
    drop = set(CACHE_ENV) | set(FOUNDRY_SETTINGS_ENV)
    env = {k: v for k, v in base.items() if k not in drop}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SRC) not in parts:
        parts.append(str(SRC))
    if foundry and shim is not None:
        parts.insert(0, str(shim))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(
        HOME=str(paths.home),
        TMPDIR=str(paths.tmp),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        # Same string hashing in every process: setup code that walks a set allocates in the same order.
        PYTHONHASHSEED="0",
        FOUNDRY_NO_PROGRESS="1",
    )
    if user_base and "PYTHONUSERBASE" not in base:
        # A fresh HOME must not hide packages installed with pip --user under the real one.
        env["PYTHONUSERBASE"] = user_base
    allow_var = "SGLANG_PLUGINS" if engine == "sglang" else "VLLM_PLUGINS"
    if engine == "vllm":
        env.update(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    others = [n for n in other_plugins if n != PLUGIN_NAME]
    if not foundry:
        # Both variables are allow-lists: a name no plugin has keeps every plugin out.
        env[allow_var] = ",".join(others) or "none"
        return env
    allowed = [x.strip() for x in env.get(allow_var, "").split(",") if x.strip()]
    if allow_var in env and PLUGIN_NAME not in allowed:
        env[allow_var] = ",".join([*allowed, PLUGIN_NAME])
    env[CACHE_ROOT_ENV] = str(paths.cache_root)
    if engine == "sglang":
        env[SGLANG_REPORT_ENV] = str(paths.report_dir)
    return env


# --- caches: emptying and counting -------------------------------------------------------------------


def _protected(path: Path, keep: list[Path]) -> bool:
    """True where deleting ``path`` would take something this benchmark runs from (a Python or an
    engine site installed under /root/.cache, the repository, the work directory)."""
    path = path.resolve()
    return any(k == path or path in k.parents for k in keep)


def purge_global_caches(keep: list[Path]) -> dict[str, list[str]]:
    removed, kept = [], []
    for pattern in GLOBAL_CACHES:
        for name in sorted(glob.glob(pattern)):
            path = Path(name)
            if _protected(path, keep):
                kept.append(name)
                continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(name)
    return {"removed": removed, "kept_in_use": kept}


def drop_page_cache() -> bool:
    """Best effort: needs root and a writable /proc/sys (not in most containers)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _files_under(root: Path) -> set[str]:
    found: set[str] = set()
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            full = Path(dirpath, fn)
            if fn.endswith(SKIP_SUFFIXES) or full.is_symlink() or not full.is_file():
                continue
            found.add(full.relative_to(root).as_posix())
    return found


def outside_roots(paths: RunPaths) -> dict[str, Path]:
    """The places a run may compile into that Foundry does not redirect, by report label."""
    roots = {"home": paths.home, "tmp": paths.tmp}
    for name in sorted(glob.glob("/tmp/torchinductor_*")):
        roots[f"/tmp/{Path(name).name}"] = Path(name)
    return roots


def snapshot(roots: dict[str, Path]) -> dict[str, set[str]]:
    return {label: _files_under(root) if root.is_dir() else set() for label, root in roots.items()}


def group_key(label: str, rel: str) -> str:
    """``home/.cache/flashinfer/x/y.so`` -> ``home/.cache/flashinfer``: the label plus at most two
    folder levels, never the file name itself."""
    folders = rel.split("/")[:-1][:2]
    return "/".join([label, *folders])


def count_new_files(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, Any]:
    """Files present after a run that were not there before it, per folder group; groups under
    :data:`NOT_COMPILES` are counted apart. A few names per group show what they are."""
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for label, files in after.items():
        for rel in sorted(files - before.get(label, set())):
            key = group_key(label, rel)
            counts[key] = counts.get(key, 0) + 1
            if len(examples.setdefault(key, [])) < 5:
                examples[key].append(rel)
    compiles = {k: n for k, n in counts.items() if not k.startswith(NOT_COMPILES)}
    return {
        "compiles": compiles,
        "not_compiles": {k: n for k, n in counts.items() if k not in compiles},
        "total": sum(compiles.values()),
        "examples": examples,
    }


#: Foundry's cache kinds (foundry_core.engine.caches.KINDS), spelled out: the stock child must not
#: import Foundry, and this script imports nothing from it.
CACHE_KINDS = ("vllm", "sglang", "inductor", "triton", "tvm-ffi", "flashinfer", "deep-gemm", "cuda")
#: foundry_core.engine.caches.REWRITTEN_ON_LOAD: where a same-byte rewrite is not a compilation.
REWRITTEN_ON_LOAD = ("vllm", "sglang", "inductor")


def _stamp(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def private_roots(cache_root: Path) -> list[Path]:
    """Foundry's private cache folders under ``cache_root`` (one or two levels down: Foundry puts
    them in a per-user folder): those holding at least one cache kind's folder."""
    if not cache_root.is_dir():
        return []
    found = [*sorted(cache_root.glob("*")), *sorted(cache_root.glob("*/*"))]
    return [p for p in found if p.is_dir() and any((p / k).is_dir() for k in CACHE_KINDS)]


def count_foundry_compiles(cache_root: Path, examples: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Per cache kind, files in Foundry's private copies under ``cache_root`` that were not carried
    from the archive (its ``.foundry-carried.json``): what the run compiled despite Foundry. Sums
    over every private root there (one per engine process that made one). ``examples`` receives a
    few names per kind, a rewritten carried file marked as such. A carried file written again with
    the same bytes (its CRC in the list) is no compilation: ``rewritten_unchanged`` counts them."""
    counts: dict[str, int] = {}
    unchanged = 0
    roots = private_roots(cache_root)
    for root in roots:
        try:
            carried = json.loads((root / CARRIED_LIST).read_text())
        except (OSError, ValueError):
            carried = {}
        for kind_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            before = carried.get(kind_dir.name) or ()
            if isinstance(before, dict):  # {path: [size, mtime_ns(, crc32)]}: a changed file counts too
                new = set()
                for rel in _files_under(kind_dir):
                    was = before.get(rel)
                    if was is None or was[:2] != _stamp(kind_dir / rel):
                        same = kind_dir.name in REWRITTEN_ON_LOAD and was is not None and len(was) > 2
                        if same and _crc(kind_dir / rel) == was[2]:
                            unchanged += 1  # written again with the bytes it was carried with
                        else:
                            new.add(rel)
            else:
                new = _files_under(kind_dir) - set(before)
            counts[kind_dir.name] = counts.get(kind_dir.name, 0) + len(new)
            if examples is not None:
                names = examples.setdefault(kind_dir.name, [])
                for rel in sorted(new)[: max(0, 8 - len(names))]:
                    names.append(f"{rel} (rewritten)" if rel in before else rel)
    counts["total"] = sum(counts.values())
    counts["private_roots"] = len(roots)
    counts["rewritten_unchanged"] = unchanged
    return counts


#: Autotune records (Inductor's chosen kernel configs) are small JSON files: SAVE's are kept whole in
#: its run record, and a LOAD's that were rewritten with other bytes too, so the two can be compared.
AUTOTUNE_SUFFIX = ".best_config"
AUTOTUNE_KEEP = 64


def autotune_records(cache_root: Path, only: set[str] | None = None) -> dict[str, str]:
    """``{kind/relative path: text}`` of the autotune records in Foundry's private folders under
    ``cache_root`` (only those named in ``only``, when given), at most :data:`AUTOTUNE_KEEP`."""
    out: dict[str, str] = {}
    for root in private_roots(cache_root):
        for path in sorted(root.rglob(f"*{AUTOTUNE_SUFFIX}")):
            name = path.relative_to(root).as_posix()
            if (only is None or name in only) and len(out) < AUTOTUNE_KEEP:
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    out[name] = path.read_text()[:4096]
    return out


def _crc(path: Path) -> int | None:
    try:
        return zlib.crc32(path.read_bytes())
    except OSError:
        return None


# --- the server's log --------------------------------------------------------------------------------


class LogPump(threading.Thread):
    """Copies the server's merged stdout/stderr into its log file, each line stamped with the
    seconds since spawn: one clock for every engine and process, finer than the engines' own
    second-resolution timestamps."""

    def __init__(self, stream: Any, path: Path, t0: float):
        super().__init__(daemon=True)
        self.stream, self.path, self.t0 = stream, path, t0
        self.lines: list[tuple[float, str]] = []

    def run(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            for raw in iter(self.stream.readline, b""):
                t = time.monotonic() - self.t0
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self.lines.append((t, line))
                f.write(f"[{t:9.3f}] {line}\n")
                f.flush()


def read_log(path: Path) -> list[tuple[float, str]]:
    """The (seconds, line) pairs of a log the pump wrote (lines without a stamp get the last one)."""
    out: list[tuple[float, str]] = []
    t = 0.0
    for line in path.read_text(errors="replace").splitlines():
        m = _LOG_PREFIX.match(line)
        if m:
            t, line = float(m.group(1)), m.group(2)
        out.append((t, line))
    return out


def _timer_hit(found: dict[str, Any], key: str, value: float, t: float, line: str) -> None:
    hit = found.setdefault(key, {"value": value, "t_s": round(t, 3), "n": 0, "sum": 0.0})
    hit["n"] += 1
    hit["sum"] = round(hit["sum"] + value, 4)
    if hit["n"] == 1:
        hit["line"] = line.strip()[-240:]


def parse_log(lines: list[tuple[float, str]], engine: str) -> dict[str, Any]:
    """Engine timers (value and when it was logged), phase marks (first time), compile-marker counts,
    and a few facts: graphs the engine listed, Foundry lines, tracebacks."""
    timers: dict[str, Any] = {}
    marks: dict[str, float] = {}
    compile_counts = dict.fromkeys(COMPILE_MARKERS, 0)
    timer_res = {k: re.compile(v) for k, v in ENGINE_TIMERS[engine].items()}
    mark_res = {k: re.compile(v) for k, v in PHASE_MARKS[engine].items()}
    compile_res = {k: re.compile(v, re.I) for k, v in COMPILE_MARKERS.items()}
    out: dict[str, Any] = {"foundry_lines": 0, "tracebacks": 0, "graphs_log": None}
    for t, line in lines:
        for key, rx in timer_res.items():
            for m in rx.finditer(line):
                name = m.groupdict().get("name")
                _timer_hit(timers, f"{key}:{name}" if name else key, float(m.groups()[-1]), t, line)
        for key, rx in mark_res.items():
            if key not in marks and rx.search(line):
                marks[key] = round(t, 3)
        for key, rx in compile_res.items():
            compile_counts[key] += bool(rx.search(line))
        out["foundry_lines"] += "Foundry" in line
        out["tracebacks"] += "Traceback (most recent call last)" in line
        m = _LAUNCH_SETTINGS.search(line)
        if m:  # what Foundry's start changed in the engine's settings (stock gets none of it)
            out["launch_settings"] = dict(re.findall(r"(\w+)=(\S+)", m.group(1)))
        n = _graphs_in_line(line, engine)
        if n is not None:
            out["graphs_log"] = max(out["graphs_log"] or 0, n)
    out.update(timers=timers, marks=marks, compile_markers=compile_counts)
    if lines:
        out["first_line_s"] = round(lines[0][0], 3)
        out["last_line_s"] = round(lines[-1][0], 3)
    return out


_LAUNCH_SETTINGS = re.compile(r"Foundry: engine settings for a shorter start: (.*?) \(each kept")
_SGLANG_BS = re.compile(r"Capture (?:target )?decode .{0,20}?graph begin\..*?bs=\[([^\]]*)\]")
_VLLM_BAR = re.compile(r"Capturing CUDA graphs[^\r\n]*?(\d+)/(\d+)")


def _graphs_in_line(line: str, engine: str) -> int | None:
    if engine == "sglang":
        m = _SGLANG_BS.search(line)
        return len([x for x in m.group(1).split(",") if x.strip()]) if m else None
    totals = [int(total) for _, total in _VLLM_BAR.findall(line)]
    return max(totals) if totals else None


# --- HTTP ---------------------------------------------------------------------------------------------

# No proxy for 127.0.0.1, whatever the environment says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _HTTP.open(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:2000]
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")[:2000]


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: servers started back to back
    (engine_faults' LOAD and the stock server beside it) bind theirs only seconds later, and the
    kernel may offer a just-probed port again in between."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class ServerDied(RuntimeError):
    pass


def wait_ready(base: str, proc: subprocess.Popen, deadline: float) -> str:
    """Poll (every 0.1 s) until /health and /v1/models both answer 200; returns the model id."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerDied(f"server exited with status {proc.returncode} before it was ready")
        try:
            status, _ = http_json(base + "/health", timeout=2.0)
            if status == 200:
                status, models = http_json(base + "/v1/models", timeout=2.0)
                if status == 200 and isinstance(models, dict) and models.get("data"):
                    return models["data"][0]["id"]
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise TimeoutError("server not ready before the run's timeout")


def completion_body(
    engine: str,
    model_id: str,
    max_tokens: int = MAX_TOKENS,
    sampling: dict[str, Any] | None = None,
    prompts: list[Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model_id,
        "prompt": PROMPTS if prompts is None else prompts,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": TOP_LOGPROBS,
        "ignore_eos": True,
        "return_token_ids": True,  # both engines: choices[i].token_ids
    }
    if engine == "vllm":
        body["return_tokens_as_token_ids"] = True  # logprob keys as "token_id:N", not decoded text
    body.update(sampling or {})
    return body


def _token_id(token: Any) -> Any:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token.split(":", 1)[1])
        except ValueError:
            return token
    return token


def extract_outputs(response: Any) -> dict[str, Any]:
    """Per prompt (by choice index): generated token ids (``token_ids`` where the server gave them,
    else the logprob tokens), the chosen tokens' logprobs, and the top logprobs as [key, value]
    pairs. Keys are decoded text on SGLang, so ids the small tokenizer lacks collapse alike in
    every run; the comparison stays fair."""
    choices = sorted((response or {}).get("choices") or [], key=lambda c: c.get("index", 0))
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text": []}
    for c in choices:
        lp = c.get("logprobs") or {}
        tokens = c.get("token_ids") or c.get("output_ids") or [_token_id(t) for t in lp.get("tokens") or []]
        out["tokens"].append(list(tokens))
        out["token_logprobs"].append(lp.get("token_logprobs"))
        out["top_logprobs"].append(
            [
                sorted(([str(k), v] for k, v in (d or {}).items()), key=lambda kv: kv[0])
                for d in lp.get("top_logprobs") or []
            ]
        )
        out["text"].append(c.get("text"))
    return out


def outputs_differ(outputs: dict[str, Any] | None) -> bool | None:
    """True when the prompts did not all produce the same tokens (a degenerate model would)."""
    tokens = (outputs or {}).get("tokens")
    if not tokens:
        return None
    return len({json.dumps(t) for t in tokens}) > 1


# --- one run -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    engine: str
    workdir: Path
    logs: Path
    model_dir: Path
    archive_dir: Path
    toml: Path
    shim: Path | None
    other_plugins: list[str]
    keep_global_caches: bool
    keep_paths: list[Path]
    user_base: str | None = None
    gpu_baseline_mib: int | None = None
    profile: bool = False  # --profile: Foundry runs profile their graph phase into the logs folder
    stacks_shim: Path | None = None  # --sample-stacks: sitecustomize folder put first on every path
    dummy_weights: bool = True  # --weights dummy
    max_tokens: int = MAX_TOKENS
    sampling: bool = False
    engine_env: dict[str, str] = dataclasses.field(default_factory=dict)  # --engine-env, every run
    engine_args: list[str] = dataclasses.field(default_factory=list)  # --engine-arg, every run
    one_prompt_per_request: bool = False  # --one-prompt-per-request


def kill_group(proc: subprocess.Popen) -> None:
    """End the server and everything it spawned (schedulers, engine core), SIGTERM then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            # Reap the leader: an unreaped zombie would keep its group "alive" to killpg(pid, 0).
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


def _nvidia_smi(query: str) -> list[str]:
    try:
        q = subprocess.run(
            ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [x.strip() for x in q.stdout.splitlines() if x.strip()] if q.returncode == 0 else []


def gpu_memory_used_mib() -> int | None:
    try:
        return sum(int(x.split(",")[0]) for x in _nvidia_smi("gpu=memory.used")) or None
    except ValueError:
        return None


def wait_gpu_free(baseline_mib: int | None, limit_s: float = 30.0) -> float:
    """A killed engine frees its memory asynchronously: the next run must not start beside it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        used = gpu_memory_used_mib()
        settled = used is None or baseline_mib is None or used <= baseline_mib + 1024
        if settled and not _nvidia_smi("compute-apps=pid"):
            break
        time.sleep(0.5)
    return round(time.monotonic() - t0, 1)


def prepare_run(bench: Bench, run: str, paths: RunPaths) -> dict[str, Any]:
    """Empty what a cold run must not find; a warm run keeps its sibling's HOME/TMPDIR."""
    prep: dict[str, Any] = {"cold": run not in WARM_OF}
    for d in (paths.home, paths.tmp):  # what an interrupted run left in place
        shutil.rmtree(d, ignore_errors=True)
    if prep["cold"]:
        for d in (paths.kept_home, paths.kept_tmp):
            shutil.rmtree(d, ignore_errors=True)
        if not bench.keep_global_caches:
            prep["global_caches"] = purge_global_caches(bench.keep_paths)
        prep["page_cache_dropped"] = drop_page_cache()
    else:
        prep["home_reused"] = paths.kept_home.is_dir() and any(paths.kept_home.iterdir())
    for kept, live in ((paths.kept_home, paths.home), (paths.kept_tmp, paths.tmp)):
        if kept.is_dir():
            kept.rename(live)
        live.mkdir(parents=True, exist_ok=True)
    for d in (paths.cache_root, paths.report_dir):
        shutil.rmtree(d, ignore_errors=True)
    if run == "save":
        shutil.rmtree(bench.archive_dir, ignore_errors=True)  # SAVE starts from an empty archive
    if kind(run) in FOUNDRY_RUNS:
        bench.archive_dir.mkdir(parents=True, exist_ok=True)
        (bench.archive_dir / "rank0.start.json").unlink(missing_ok=True)  # only this run may write it
    return prep


def put_away(paths: RunPaths) -> None:
    """After a run: its HOME and TMPDIR go back to where its warm sibling will find them."""
    for kept, live in ((paths.kept_home, paths.home), (paths.kept_tmp, paths.tmp)):
        shutil.rmtree(kept, ignore_errors=True)
        if live.is_dir():
            live.rename(kept)


def complete(base: str, body: dict[str, Any], deadline: float, one_by_one: bool) -> tuple[int, Any, float]:
    """POST ``body`` to /v1/completions: the status, the response and when the first answer came.
    With ``one_by_one``, each of its prompts is a request of its own, in order, answered as one
    response whose choices are indexed by prompt (or the first failing request's status and body)."""
    url = base + "/v1/completions"
    if not one_by_one:
        status, resp = http_json(url, body, timeout=max(5.0, deadline - time.monotonic()))
        return status, resp, time.monotonic()
    choices, usage, first = [], None, None
    for i, prompt in enumerate(body["prompt"]):
        status, resp = http_json(
            url, dict(body, prompt=[prompt]), timeout=max(5.0, deadline - time.monotonic())
        )
        first = first or time.monotonic()
        if status != 200:
            return status, resp, first
        (choice,) = resp.get("choices") or [None]
        choices.append(dict(choice or {}, index=i))
        usage = usage or resp.get("usage")
    return 200, {"choices": choices, "usage": usage}, first


def request_phase(
    engine: str,
    proc: subprocess.Popen,
    rec: dict[str, Any],
    base: str,
    t0: float,
    deadline: float,
    max_tokens: int = MAX_TOKENS,
    sampling: bool = False,
    one_by_one: bool = False,
) -> None:
    """Ready, first request (TTFT), second request (self-consistency), and with ``sampling`` two
    seeded-sampling requests; fills ``rec`` as it goes. ``one_by_one``: each prompt its own request
    (the TTFT is then the first prompt's answer)."""
    rec["stage"] = "starting"
    rec["model_id"] = wait_ready(base, proc, deadline)
    t_ready = time.monotonic()
    rec["ready_s"] = round(t_ready - t0, 3)
    rec["stage"] = "first request"
    body = completion_body(engine, rec["model_id"], max_tokens)
    # One by one, the TTFT is the first prompt's answer, as a user's first request would see it.
    status, resp, t_first = complete(base, body, deadline, one_by_one)
    if status != 200:
        raise RuntimeError(f"first /v1/completions answered {status}: {str(resp)[:500]}")
    rec["ttft_s"] = round(t_first - t0, 3)
    rec["first_request_s"] = round(t_first - t_ready, 3)
    rec["outputs"] = extract_outputs(resp)
    rec["stage"] = "second request"
    status, resp2, _ = complete(base, body, deadline, one_by_one)
    rec["second_request_s"] = round(time.monotonic() - t_first, 3)
    if status != 200:
        raise RuntimeError(f"second /v1/completions answered {status}: {str(resp2)[:500]}")
    second = extract_outputs(resp2)
    rec["self_consistent"] = {
        "tokens": second["tokens"] == rec["outputs"]["tokens"],
        "logprobs": (second["token_logprobs"], second["top_logprobs"])
        == (rec["outputs"]["token_logprobs"], rec["outputs"]["top_logprobs"]),
    }
    rec["outputs_differ_between_prompts"] = outputs_differ(rec["outputs"])
    rec["usage"] = (resp or {}).get("usage")
    if not sampling:
        return
    rec["stage"] = "sampling requests"
    body = completion_body(engine, rec["model_id"], max_tokens, SAMPLING)
    sampled = []
    for _ in range(2):
        status, got, _ = complete(base, body, deadline, one_by_one)
        if status != 200:
            raise RuntimeError(f"sampling /v1/completions answered {status}: {str(got)[:500]}")
        sampled.append(extract_outputs(got))
    rec["outputs_sampled"] = sampled[0]
    rec["self_consistent_sampled"] = sampled[0] == sampled[1]


def read_start_report(bench: Bench, paths: RunPaths) -> dict[str, Any] | None:
    path = (
        paths.report_dir / "rank0.json"
        if bench.engine == "sglang"
        else bench.archive_dir / "rank0.start.json"
    )
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"unreadable": f"{path}: {e}"}


def other_rank_reports(bench: Bench, paths: RunPaths) -> dict[str, Any]:
    """The start reports of the ranks other than 0 (SGLang writes one per scheduler), by rank."""
    if bench.engine != "sglang":
        return {}
    out = {}
    for path in sorted(paths.report_dir.glob("rank*.json")):
        rank = path.stem[len("rank") :]
        if rank.isdigit() and rank != "0":
            try:
                out[rank] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                out[rank] = {"unreadable": f"{path}: {e}"}
    return out


def run_one(bench: Bench, run: str, timeout_s: float, runs: dict[str, Any]) -> dict[str, Any]:
    """One server start, measured; the record is in ``runs`` from the start, so a benchmark ended
    from outside (SIGTERM) still writes what this run got to."""
    paths = RunPaths.for_run(bench.workdir, run)
    foundry = kind(run) in FOUNDRY_RUNS
    rec: dict[str, Any] = {"name": run, "foundry": foundry, "ok": False, "timeout_s": round(timeout_s)}
    runs[run] = rec
    rec["prepare"] = prepare_run(bench, run, paths)
    rec["paths"] = {k: str(v) for k, v in dataclasses.asdict(paths).items()}
    before = snapshot(outside_roots(paths))
    port = free_port()
    argv = server_command(
        bench.engine, bench.model_dir, port, bench.toml if foundry else None, dummy=bench.dummy_weights
    )
    argv += bench.engine_args
    env = child_env(
        dict(os.environ), bench.engine, run, paths, bench.shim, bench.other_plugins, bench.user_base
    )
    env.update(bench.engine_env)
    if bench.profile and foundry:
        env[PROFILE_ENV] = str(bench.logs / f"profile-{run}")
    if bench.stacks_shim is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(bench.stacks_shim), env["PYTHONPATH"]])
        env[startup_stacks.ENV] = str(bench.logs / f"stacks-{run}")
    rec.update(command=shlex.join(argv), port=port, log=f"{bench.engine}-{run}.log")
    rec["env_changes"] = env_changes(dict(os.environ), env)
    log_path = bench.logs / rec["log"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=str(bench.workdir),
        start_new_session=True,  # its own process group: one killpg ends the server and its children
    )
    pump = LogPump(proc.stdout, log_path, t0)
    pump.start()
    try:
        request_phase(
            bench.engine,
            proc,
            rec,
            f"http://127.0.0.1:{port}",
            t0,
            t0 + timeout_s,
            max_tokens=bench.max_tokens,
            sampling=bench.sampling,
            one_by_one=bench.one_prompt_per_request,
        )
        rec["ok"] = True
        rec["stage"] = "done"
    except BaseException as e:  # everything goes into the record; the benchmark goes on
        rec["error"] = f"{type(e).__name__}: {e} (stage {rec.get('stage')})"
        if not isinstance(e, (TimeoutError, RuntimeError)):
            rec["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
    finally:
        rec["wall_s"] = round(time.monotonic() - t0, 2)
        kill_group(proc)
        rec["exit_code"] = proc.wait()
        pump.join(timeout=10)
        rec["gpu_free_wait_s"] = wait_gpu_free(bench.gpu_baseline_mib)
        try:
            finish_record(bench, rec, paths, before, pump.lines)
        finally:
            put_away(paths)
    return rec


def env_changes(base: dict[str, str], env: dict[str, str]) -> dict[str, Any]:
    """What a run's environment sets or removes relative to the caller's (for the record)."""
    return {
        "set": {k: v for k, v in sorted(env.items()) if base.get(k) != v},
        "removed": sorted(k for k in base if k not in env),
    }


def finish_record(
    bench: Bench,
    rec: dict[str, Any],
    paths: RunPaths,
    before: dict[str, set[str]],
    lines: list[tuple[float, str]],
) -> None:
    """What the run left: its log facts, the files it created, Foundry's report, its phases."""
    rec["log_parse"] = parse_log(lines, bench.engine)
    rec["outside_files"] = count_new_files(before, snapshot(outside_roots(paths)))
    if rec["foundry"]:
        examples: dict[str, list[str]] = {}
        rec["foundry_cache_files"] = count_foundry_compiles(paths.cache_root, examples)
        rec["foundry_cache_examples"] = {k: v for k, v in examples.items() if v}
        rewritten = {
            f"{kind}/{name.removesuffix(' (rewritten)')}"
            for kind, names in examples.items()
            for name in names
            if name.endswith(f"{AUTOTUNE_SUFFIX} (rewritten)")
        }
        if rec["name"] == "save" or rewritten:  # SAVE's as carried; a LOAD's where it wrote others
            rec["autotune_records"] = autotune_records(
                paths.cache_root, None if rec["name"] == "save" else rewritten
            )
        rec["foundry_report"] = read_start_report(bench, paths)
        others = other_rank_reports(bench, paths)
        if others:  # tensor parallelism: every rank's start, beside rank 0's
            rec["foundry_rank_reports"] = others
    rec["compiled_files"] = compiled_files(rec)
    rec["phases"] = phases(rec, bench.engine)
    if rec["foundry"]:
        judge_foundry_run(rec)
    if not rec["ok"]:
        rec["log_tail"] = "\n".join(line for _, line in lines[-60:])[-6000:]


#: What a Foundry run measured; set aside (``not_counted``) when Foundry did not run in the mode the
#: run was meant to measure.
MEASURED = (
    "ready_s",
    "ttft_s",
    "first_request_s",
    "second_request_s",
    "outputs",
    "outputs_sampled",
    "self_consistent",
    "self_consistent_sampled",
    "outputs_differ_between_prompts",
    "compiled_files",
    "phases",
)


def judge_foundry_run(rec: dict[str, Any]) -> None:
    """Adds the first line of Foundry's own error to a failed run's error (the engine's exit status
    alone says little), and fails a run whose Foundry mode is not the one it was meant to measure:
    a ``load_*`` run whose archive was missing or refused in ``auto`` mode captured and saved
    instead (seen on the H200 when another model's SAVE had replaced the archive in a shared
    workdir). Such a run's measurements go to ``not_counted``, so no comparison or ratio uses them."""
    report = rec.get("foundry_report") or {}
    if report.get("error") and not rec["ok"]:
        first = str(report["error"]).strip().splitlines()[0]
        rec["error"] = f"{rec.get('error')}; Foundry: {first}"
    wanted = "save" if kind(rec["name"]) == "save" else "load"
    mode = report.get("mode")
    if mode is None or mode == wanted:
        return
    rec["ok"] = False
    why = f"Foundry ran in mode {mode!r}, not {wanted!r}: this run is not a {wanted.upper()}"
    rec["error"] = f"{rec['error']}; {why}" if rec.get("error") else why
    rec["not_counted"] = {k: rec.pop(k) for k in MEASURED if k in rec}


def compiled_files(rec: dict[str, Any]) -> dict[str, Any]:
    """One count of what a run compiled: Foundry's kinds by name, the unredirected places by folder."""
    out: dict[str, Any] = {}
    for kind, n in (rec.get("foundry_cache_files") or {}).items():
        if kind not in ("total", "private_roots", "rewritten_unchanged"):
            out[kind] = n
    out.update((rec.get("outside_files") or {}).get("compiles") or {})
    out["total"] = sum(v for v in out.values())
    unchanged = (rec.get("foundry_cache_files") or {}).get("rewritten_unchanged")
    if unchanged:  # beside the total, not in it: no compilation wrote them
        out["rewritten_unchanged"] = unchanged
    return out


# --- phases, result, summary ------------------------------------------------------------------------


def graph_phase_s(rec: dict[str, Any], engine: str) -> tuple[float | None, str | None]:
    """Seconds of the decode-graph phase: the engine's own timer where it logged one (the same
    measure for stock and Foundry), else Foundry's report."""
    timers = (rec.get("log_parse") or {}).get("timers") or {}
    key = "decode_graph_s" if engine == "sglang" else "graph_capture_s"
    if key in timers:
        return timers[key]["value"], f"log:{key}"
    report = rec.get("foundry_report") or {}
    for name in ("restore_s", "capture_s"):
        if isinstance(report.get(name), int | float):
            return float(report[name]), f"report:{name}"
    graphs = (report.get("phases_s") or {}).get("graphs")
    return (float(graphs), "report:phases_s.graphs") if isinstance(graphs, int | float) else (None, None)


def phases(rec: dict[str, Any], engine: str) -> dict[str, Any]:
    """Spawn+imports (until the engine's first own log line), setup until ready (split into the
    graph phase, where known, and the rest), ready -> first token."""
    parse = rec.get("log_parse") or {}
    marks = parse.get("marks") or {}
    ready = rec.get("ready_s")
    spawn = marks.get("imports_done", parse.get("first_line_s"))
    if ready is not None and spawn is not None:
        spawn = min(spawn, ready)
    until_ready = round(ready - spawn, 3) if ready is not None and spawn is not None else None
    graph, graph_src = graph_phase_s(rec, engine)
    setup = until_ready
    if until_ready is not None and graph is not None:
        setup = round(until_ready - graph, 3)
    return {
        "spawn_imports_s": spawn,
        "setup_s": setup,
        "graph_phase_s": graph,
        "graph_phase_source": graph_src,
        "until_ready_s": until_ready,
        "ready_to_first_token_s": rec.get("first_request_s"),
        "ready_s": ready,
        "ttft_s": rec.get("ttft_s"),
        "marks_s": marks,
    }


def _first(values: list[Any]) -> Any:
    return next((v for v in values if v is not None), None)


def _get(runs: dict[str, Any], run: str, key: str) -> Any:
    return (runs.get(run) or {}).get(key)


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 4) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def _same(a: Any, b: Any) -> bool | None:
    return None if a is None or b is None else a == b


def _outputs(runs: dict[str, Any], run: str, field: str) -> Any:
    return ((runs.get(run) or {}).get("outputs") or {}).get(field)


def _agree(runs: dict[str, Any], repeated: list[str], reference: str) -> bool | None:
    """Whether every run of ``repeated`` gave ``reference``'s tokens and top logprobs; None when
    one of them (or there is none) has no outputs to compare."""
    same = [
        _same(_outputs(runs, r, f), _outputs(runs, reference, f))
        for r in repeated
        for f in ("tokens", "top_logprobs")
    ]
    return None if None in same or not same else all(same)


def decode_captures(engine: str, report: dict[str, Any] | None) -> int | None:
    """Stream captures in the graph phase of a start: SGLang counts the decode-graph phase itself;
    vLLM's worker snapshots the process total before the graphs and at the end."""
    report = report or {}
    if engine == "sglang":
        phase = report.get("decode_phase_stream_captures")
        return sum(phase.values()) if isinstance(phase, dict) else None
    counts = report.get("stream_captures") or {}
    end, begin = counts.get("end"), counts.get("before_graphs")
    return end - begin if isinstance(end, int) and isinstance(begin, int) else None


def rank_rows(engine: str, runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Tensor / data parallelism: one row per rank from the SAVE's and the cold LOAD's start
    reports (rank 0's ``foundry_report``, the others' ``foundry_rank_reports``); None with one rank.
    The collective kernel counts are the archive's (``foundry inspect``), as the LOAD read them."""

    def reports(run: str) -> dict[str, dict[str, Any]]:
        rec = runs.get(run) or {}
        if "not_counted" in rec:
            return {}
        out = {"0": rec.get("foundry_report") or {}}
        out.update(
            {r: rep for r, rep in (rec.get("foundry_rank_reports") or {}).items() if isinstance(rep, dict)}
        )
        return out

    save, load = reports("save"), reports("load_cold")
    ranks = sorted(set(save) | set(load), key=int)
    if len(ranks) < 2:
        return None
    rows = []
    for r in ranks:
        s, ld = save.get(r) or {}, load.get(r) or {}
        coll = ld.get("collectives") if isinstance(ld.get("collectives"), dict) else None
        rows.append(
            {
                "rank": int(r),
                "graphs": _first([ld.get("graphs"), s.get("graphs")]),
                "capture_s": s.get("capture_s"),
                "restore_s": ld.get("restore_s"),
                "save_decode_captures": decode_captures(engine, s) if s else None,
                "load_decode_captures": decode_captures(engine, ld) if ld else None,
                "symm_mem_collectives": coll.get("symm_mem", 0) if coll is not None else None,
                "nccl_kernels": coll.get("nccl", 0) if coll is not None else None,
                "custom_all_reduce_kernels": coll.get("custom_all_reduce", 0) if coll is not None else None,
                "archive_digest": ld.get("archive_digest"),
                "load_mode": ld.get("mode"),
            }
        )
    return rows


def assemble(meta: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result document; any run may be missing or failed (its fields are then None)."""
    engine = meta["engine"]
    reports = {r: (runs.get(r) or {}).get("foundry_report") or {} for r in FOUNDRY_RUNS}
    # A run whose measurements were set aside (judge_foundry_run) does not speak for its kind.
    rep = {r: {} if "not_counted" in (runs.get(r) or {}) else reports[r] for r in FOUNDRY_RUNS}
    out = dict(meta)
    out["graphs"] = _first(
        [rep["load_cold"].get("graphs"), rep["save"].get("graphs")]
        + [((runs.get(r) or {}).get("log_parse") or {}).get("graphs_log") for r in RUNS]
    )
    for kind in ("stock", "load"):
        for temp in ("cold", "warm"):
            out[f"ttft_s_{kind}_{temp}"] = _get(runs, f"{kind}_{temp}", "ttft_s")
            out[f"ready_s_{kind}_{temp}"] = _get(runs, f"{kind}_{temp}", "ready_s")
    out["ttft_s_save"], out["ready_s_save"] = _get(runs, "save", "ttft_s"), _get(runs, "save", "ready_s")
    out["ttft_ratio_cold"] = _ratio(out["ttft_s_load_cold"], out["ttft_s_stock_cold"])
    out["ttft_ratio_warm"] = _ratio(out["ttft_s_load_warm"], out["ttft_s_stock_warm"])
    out["load_compiles"] = _get(runs, "load_cold", "compiled_files")
    out["stock_compiles"] = _get(runs, "stock_cold", "compiled_files")
    out["load_decode_captures"] = decode_captures(engine, rep["load_cold"]) if rep["load_cold"] else None
    out["save_decode_captures"] = decode_captures(engine, rep["save"]) if rep["save"] else None
    out["tokens_identical_to_save"] = _same(
        _outputs(runs, "load_cold", "tokens"), _outputs(runs, "save", "tokens")
    )
    out["tokens_identical_to_stock"] = _same(
        _outputs(runs, "load_cold", "tokens"), _outputs(runs, "stock_cold", "tokens")
    )
    lp = ("token_logprobs", "top_logprobs")
    load_lp = [_outputs(runs, "load_cold", f) for f in lp]
    save_lp = [_outputs(runs, "save", f) for f in lp]
    out["logprobs_identical_to_save"] = None if None in load_lp + save_lp else load_lp == save_lp
    stock_lp = [_outputs(runs, "stock_cold", f) for f in lp]
    out["logprobs_identical_to_stock"] = None if None in load_lp + stock_lp else load_lp == stock_lp
    # Stock against its own restart: where its cold and warm starts disagree (vLLM 0.26 did once, at
    # 4adbae1), LOAD == stock_cold alone says nothing either way; LOAD is compared with each stock run.
    stock_runs = [r for r in runs if r.startswith("stock") and (runs.get(r) or {}).get("outputs")]
    out["stock_warm_identical_to_stock_cold"] = _agree(runs, ["stock_warm"], "stock_cold")
    out["load_identical_to_stock_runs"] = {r: _agree(runs, ["load_cold"], r) for r in stock_runs}
    load_tokens = _outputs(runs, "load_cold", "tokens")
    out["distinct_outputs"] = len({json.dumps(t) for t in load_tokens}) if load_tokens else None
    sampled = {r: (runs.get(r) or {}).get("outputs_sampled") for r in ("save", "load_cold", "stock_cold")}
    out["sampled_identical_to_save"] = (
        None if None in (sampled["load_cold"], sampled["save"]) else sampled["load_cold"] == sampled["save"]
    )
    out["sampled_identical_to_stock"] = (
        None
        if None in (sampled["load_cold"], sampled["stock_cold"])
        else sampled["load_cold"] == sampled["stock_cold"]
    )
    out["warm_tokens_identical_to_save"] = _same(
        _outputs(runs, "load_warm", "tokens"), _outputs(runs, "save", "tokens")
    )
    out["outputs_differ_between_prompts"] = outputs_differ((runs.get("load_cold") or {}).get("outputs"))
    out["self_consistent"] = {r: _get(runs, r, "self_consistent") for r in RUNS if r in runs}
    out["modes"] = {r: reports[r].get("mode") for r in FOUNDRY_RUNS if r in runs}
    # A stock server must not have loaded the plugin: any Foundry line in its log says it did.
    out["foundry_lines_in_stock_logs"] = {
        r: ((runs.get(r) or {}).get("log_parse") or {}).get("foundry_lines")
        for r in RUNS
        if r.startswith("stock") and r in runs
    }
    # The engine settings each Foundry start set for itself (docs/cold-start.md); stock ran with
    # the engine's defaults unless --engine-env gave every run the same.
    out["launch_settings"] = {
        r: ((runs.get(r) or {}).get("log_parse") or {}).get("launch_settings")
        for r in FOUNDRY_RUNS
        if r in runs
    }
    out["load_caches"] = rep["load_cold"].get("caches")
    out["save_caches"] = rep["save"].get("caches")
    out["restore_s"], out["capture_s"] = rep["load_cold"].get("restore_s"), rep["save"].get("capture_s")
    out["ranks"] = rank_rows(engine, runs)  # ready and outputs are the server's: the fields above
    out["breakdown"] = _get(runs, "load_cold", "phases")
    out["breakdown_stock_cold"] = _get(runs, "stock_cold", "phases")
    out["warm_restart"] = warm_restart(engine, runs)
    out.update(cold_repeats(runs))
    out["errors"] = {r: rec["error"] for r, rec in runs.items() if rec and rec.get("error")}
    out["runs"] = runs
    return out


def stock_warm_costs(engine: str, rec: dict[str, Any] | None) -> dict[str, float | None]:
    """What a stock warm restart spends compiling, warming up and capturing (its own log), the work
    a LOAD replaces. vLLM: torch.compile's total (a cache load when warm), the initial profiling /
    warmup run, the capture, and its warmups after the graphs until "Kernel JIT monitor activated".
    SGLang: the decode-graph phase (its per-shape warmup forwards, JIT builds and capture); its
    server warmup request is not counted, a LOAD runs it too."""
    parse = (rec or {}).get("log_parse") or {}
    timers, marks = parse.get("timers") or {}, parse.get("marks") or {}
    # The engine's own graph-phase timer, as the breakdown reads it (vLLM's "Capturing CUDA graphs"
    # line is a progress bar that reaches the log when it is done: no measure of the capture).
    capture = graph_phase_s(rec or {}, engine)[0]
    if engine == "sglang":
        return {"compile_s": None, "warmup_s": None, "capture_s": capture}

    def timer(name: str) -> float | None:
        return (timers.get(name) or {}).get("sum")

    after = None
    if marks.get("warmups_end") is not None and marks.get("graphs_end") is not None:
        after = round(marks["warmups_end"] - marks["graphs_end"], 3)
    parts = [timer("initial_warmup_s"), after]
    return {
        "compile_s": timer("torch_compile_total_s"),
        "warmup_s": None if all(p is None for p in parts) else round(sum(p or 0.0 for p in parts), 3),
        "capture_s": capture,
    }


def warm_restart(engine: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Issue 12's warm target, as measured: how much sooner the warm LOAD was ready than the warm
    stock run, against what stock spent compiling, warming up and capturing (stock_warm_costs).
    ``met``: the LOAD was ready sooner by at least that much; None when a part is missing."""
    load, stock = runs.get("load_warm") or {}, runs.get("stock_warm") or {}
    if not (load.get("ok") and stock.get("ok")):
        return None
    costs = stock_warm_costs(engine, stock)
    known = [v for v in costs.values() if v is not None]
    saved = _get(runs, "stock_warm", "ready_s") - _get(runs, "load_warm", "ready_s")
    total = round(sum(known), 3) if known else None
    return {
        "ready_saved_s": round(saved, 3),
        "stock": costs,
        "stock_compile_warmup_capture_s": total,
        "met": None if total is None else saved >= total,
    }


def cold_repeats(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every cold pair (the first and its ``--repeat``s): each run's TTFT, each pair's ratio, their
    median and spread ((max - min) / median), whether every repeated LOAD's tokens and logprobs
    equal SAVE's, and whether every repeated stock run's equal the first stock run's. A ratio whose
    spread is larger than its distance to a target shows nothing."""
    loads, stocks = repeats("load_cold", runs), repeats("stock_cold", runs)
    ttft = {
        r: (runs.get(r) or {}).get("ttft_s") if (runs.get(r) or {}).get("ok") else None
        for r in loads + stocks
    }
    pairs = [_ratio(ttft[a], ttft[b]) for a, b in zip(loads, stocks)]
    ratios = sorted(r for r in pairs if r is not None)
    median = statistics.median(ratios) if ratios else None

    return {
        "ttft_s_load_cold_runs": [ttft[r] for r in loads],
        "ttft_s_stock_cold_runs": [ttft[r] for r in stocks],
        "ttft_ratio_cold_pairs": pairs,
        "ttft_ratio_cold_median": None if median is None else round(median, 4),
        "ttft_ratio_cold_spread": round((ratios[-1] - ratios[0]) / median, 4) if len(ratios) > 1 else None,
        "repeated_loads_identical_to_save": _agree(runs, loads, "save"),
        # Whether stock itself reproduces across processes: where it does not (an engine whose
        # compile picks kernels by timing in every new process), no LOAD can be identical to stock.
        "repeated_stocks_identical_to_stock": _agree(runs, stocks[1:], "stock_cold"),
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    def f(key: str) -> str:
        v = result.get(key)
        return "n/a" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    total = (result.get("load_compiles") or {}).get("total")
    lines = [
        f"cold_start {result.get('engine')} {f('engine_version')} on {f('machine')} (commit {f('commit')})",
        f"  graphs {f('graphs')}; LOAD decode-phase stream captures {f('load_decode_captures')}; "
        f"LOAD compiled files {total if total is not None else 'n/a'}",
        f"  cold: ready stock {f('ready_s_stock_cold')} s / LOAD {f('ready_s_load_cold')} s; "
        f"TTFT stock {f('ttft_s_stock_cold')} s / LOAD {f('ttft_s_load_cold')} s (ratio {f('ttft_ratio_cold')})",
        f"  warm: ready stock {f('ready_s_stock_warm')} s / LOAD {f('ready_s_load_warm')} s; "
        f"TTFT stock {f('ttft_s_stock_warm')} s / LOAD {f('ttft_s_load_warm')} s (ratio {f('ttft_ratio_warm')})",
        "  warm restart: LOAD ready {} s sooner; stock's compile + warmup + capture {} s (target met: {})".format(
            *(
                (result.get("warm_restart") or {}).get(k, "n/a")
                for k in ("ready_saved_s", "stock_compile_warmup_capture_s", "met")
            )
        ),
        f"  tokens LOAD==SAVE {f('tokens_identical_to_save')}, LOAD==stock {f('tokens_identical_to_stock')}, "
        f"logprobs LOAD==SAVE {f('logprobs_identical_to_save')}, prompts differ {f('outputs_differ_between_prompts')}",
        f"  stock warm == stock cold {f('stock_warm_identical_to_stock_cold')}; LOAD == each stock run "
        f"{json.dumps(result.get('load_identical_to_stock_runs'), sort_keys=True)}",
    ]
    if len(result.get("ttft_ratio_cold_pairs") or []) > 1:
        lines.append(
            f"  cold pairs {result['ttft_ratio_cold_pairs']}: median {f('ttft_ratio_cold_median')}, "
            f"spread {f('ttft_ratio_cold_spread')}; repeated LOADs == SAVE {f('repeated_loads_identical_to_save')}, "
            f"repeated stocks == stock {f('repeated_stocks_identical_to_stock')}"
        )
    if result.get("load_compiles"):
        lines.append(f"  LOAD compiles: {json.dumps(result['load_compiles'], sort_keys=True)}")
    # What the first cold LOAD's start report says about Foundry's own time (the plugins' fields).
    report = ((result.get("runs") or {}).get("load_cold") or {}).get("foundry_report") or {}
    own = {
        k: report[k]
        for k in ("restore_s", "prepared", "prepared_ready", "prepared_s", "begin_s")
        if k in report
    }
    if own:
        lines.append(f"  LOAD report: {json.dumps(own, sort_keys=True)}")
    for row in result.get("ranks") or []:
        lines.append(
            f"  rank {row['rank']}: graphs {row['graphs']}, capture {row['capture_s']} s, restore "
            f"{row['restore_s']} s, LOAD decode captures {row['load_decode_captures']}, symmetric-memory "
            f"collectives {row['symm_mem_collectives']}, NCCL kernels {row['nccl_kernels']}"
        )
    for run, err in (result.get("errors") or {}).items():
        lines.append(f"  {run}: {str(err).strip()[:300]}")
    return lines


# --- the chart ---------------------------------------------------------------------------------------

CHART_PHASES = (
    ("spawn_imports_s", "spawn + imports", "#9aa5b1"),
    ("until_ready_s", "engine setup until ready", "#3d7ab8"),
    ("ready_to_first_token_s", "ready -> first token", "#e0a030"),
)
CHART_ORDER = ("stock_cold", "load_cold", "stock_warm", "load_warm", "save")


def write_chart(result: dict[str, Any], path: Path) -> str | None:
    """A stacked bar per run (stock vs LOAD, cold and warm); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = result.get("runs") or {}
    names = [r for r in CHART_ORDER if (runs.get(r) or {}).get("phases")]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottoms = [0.0] * len(names)
    for key, label, color in CHART_PHASES:
        values = [runs[r]["phases"].get(key) or 0.0 for r in names]
        ax.bar(names, values, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, r in enumerate(names):
        ttft = runs[r].get("ttft_s")
        ax.text(i, bottoms[i], f"{ttft:.1f} s" if ttft else "failed", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("seconds from spawn")
    engine = " ".join(str(x) for x in (result.get("engine"), result.get("engine_version")) if x)
    title = f"{engine}: time to first token"
    ax.set_title(f"{title}, {result.get('graphs')} graphs")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# --- the parent -------------------------------------------------------------------------------------


def _flat(value: Any) -> bool:
    """A list of scalars, or of lists of scalars (token ids, logprobs): one line in a result."""

    def scalar(v: Any) -> bool:
        return not isinstance(v, dict | list)

    return isinstance(value, list) and all(
        scalar(v) or (isinstance(v, list) and all(scalar(w) for w in v)) for v in value
    )


def results_text(data: Any, depth: int = 0) -> str:
    """JSON as ``json.dumps(indent=1)`` writes it, except that lists of numbers (and of such lists)
    stay on one line: the outputs of a run took half of a result's bytes as one number per line,
    and every device call carries the committed results beside its wheel piece."""
    pad = " " * (depth + 1)
    if isinstance(data, dict) and data:
        items = (f"{pad}{json.dumps(str(k))}: {results_text(v, depth + 1)}" for k, v in data.items())
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(data, list) and data and not _flat(data):
        return "[\n" + ",\n".join(pad + results_text(v, depth + 1) for v in data) + "\n" + " " * depth + "]"
    return json.dumps(data, default=str)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(results_text(data) + "\n")
    os.replace(tmp, path)


def machine() -> str:
    rows = _nvidia_smi("gpu=name,driver_version")
    if not rows:
        return f"GPU unknown (nvidia-smi failed); host {socket.gethostname()}"
    name, _, driver = rows[0].rpartition(",")
    return f"{len(rows)}x {name.strip()}, driver {driver.strip()}; host {socket.gethostname()}"


def commit() -> str | None:
    if os.environ.get("FOUNDRY_COMMIT"):
        return os.environ["FOUNDRY_COMMIT"]
    try:
        q = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (q.stdout.strip() or None) if q.returncode == 0 else None


def engine_version(engine: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(engine)
    except PackageNotFoundError:
        return None


def python_bytecode(engine: str) -> dict[str, Any]:
    """Whether the engine's Python modules start from compiled bytecode, as in an image that pip
    built (pip compiles at install), or are compiled from source in every process (an install with
    ``--no-compile`` where ``PYTHONDONTWRITEBYTECODE`` keeps Python from caching the result)."""
    import importlib.util

    out: dict[str, Any] = {
        "dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
    }
    spec = importlib.util.find_spec(engine)
    if spec is None or not spec.submodule_search_locations:
        return out
    sources = compiled = 0
    tag = sys.implementation.cache_tag
    for pkg in spec.submodule_search_locations:
        for py in Path(pkg).rglob("*.py"):
            sources += 1
            compiled += (py.parent / "__pycache__" / f"{py.stem}.{tag}.pyc").is_file()
    out.update(engine_sources=sources, engine_sources_with_bytecode=compiled)
    return out


def setup(opts: argparse.Namespace, meta: dict[str, Any]) -> Bench:
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="foundry-cold-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    logs = Path(opts.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    model_dir, archive_dir, toml = workdir / "model", workdir / "archive", workdir / "foundry.toml"
    config = json.loads(Path(opts.model_config).read_text()) if opts.model_config else MODEL_CONFIG
    meta["model_config"] = config
    meta["tokenizer"] = write_model(model_dir, config)
    meta["weights"] = opts.weights
    if opts.weights == "seeded":
        meta["seeded_weights"] = write_seeded_weights(model_dir, opts.seed)
    toml.write_text(foundry_toml(archive_dir, opts.region_size))
    plugins = installed_plugins(opts.engine)
    shim = None if PLUGIN_NAME in plugins else write_entry_point_shim(workdir / "entry-point")
    meta.update(workdir=str(workdir), plugin_entry_point="installed" if shim is None else f"shim at {shim}")
    meta["native_library"] = [p.name for p in (SRC / "foundry_core").glob("_foundry_native*.so")]
    meta["python_bytecode"] = python_bytecode(opts.engine)
    keep = [Path(sys.prefix), Path(sys.executable), REPO, workdir, logs, Path(opts.out).resolve().parent]
    keep += [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return Bench(
        engine=opts.engine,
        workdir=workdir,
        logs=logs,
        model_dir=model_dir,
        archive_dir=archive_dir,
        toml=toml,
        shim=shim,
        other_plugins=plugins,
        keep_global_caches=opts.keep_global_caches,
        keep_paths=[p.resolve() for p in keep],
        user_base=site.getuserbase(),
        gpu_baseline_mib=gpu_memory_used_mib(),
        profile=opts.profile,
        stacks_shim=startup_stacks.write_shim(workdir / "stacks-shim")
        if getattr(opts, "sample_stacks", False)
        else None,
        dummy_weights=opts.weights == "dummy",
        max_tokens=opts.max_tokens,
        sampling=opts.sampling,
        # absent from the namespaces other benchmarks build for setup() (engine_faults.py)
        engine_env=dict(e.split("=", 1) for e in getattr(opts, "engine_env", [])),
        engine_args=list(getattr(opts, "engine_arg", [])),
        one_prompt_per_request=bool(getattr(opts, "one_prompt_per_request", False)),
    )


def recorded_engine_args(
    doc: dict[str, Any], key: str = "engine_args", flag: str = "--engine-arg"
) -> list[str]:
    """The extra server arguments (``engine_env``, ``--engine-env``: environment) every run of a
    result had, stock's too: kept since 2026-12-03, read from the benchmark's command line for
    results written before (joined with spaces, never quoted, so a split gives the values back)."""
    if key in doc:
        return list(doc[key])
    words = (doc.get("command") or "").split()
    return [w.split("=", 1)[1] for w in words if w.startswith(f"{flag}=")] + [
        b for a, b in zip(words, words[1:]) if a == flag
    ]


def resumed_runs(out_path: Path, meta: dict[str, Any], opts: argparse.Namespace) -> dict[str, Any]:
    """The runs of an earlier call whose result is at ``out_path``; only the same engine, commit and
    workdir qualify, since a warm run reuses its cold sibling's folders and the SAVE's archive."""
    try:
        earlier = json.loads(out_path.read_text())
    except FileNotFoundError:
        return {}
    same = {k: earlier.get(k) == meta[k] for k in ("engine", "commit", "max_tokens", "sampling")}
    # Runs compared with each other must have sent their requests alike.
    same["one_prompt_per_request"] = (
        bool(earlier.get("one_prompt_per_request")) == meta["one_prompt_per_request"]
    )
    same["workdir"] = opts.workdir is not None and earlier.get("workdir") == str(Path(opts.workdir).resolve())
    # ... and started their servers alike (a compile setting given to every run changes the outputs).
    for key, flag in (("engine_args", "--engine-arg"), ("engine_env", "--engine-env")):
        same[key] = sorted(recorded_engine_args(earlier, key, flag)) == sorted(meta[key])
    if not all(same.values()):
        raise SystemExit(f"--resume: {out_path} is another benchmark's result ({same})")
    kept = {r: rec for r, rec in (earlier.get("runs") or {}).items() if r not in opts.runs}
    meta["resumed_from"] = {k: earlier.get(k) for k in ("date", "command", "elapsed_s")}
    meta["runs_requested"] = [r for r in RUNS if r in kept or r in opts.runs]
    meta["runs_requested"] += [
        r for r in [*kept, *opts.runs] if r not in RUNS and r not in meta["runs_requested"]
    ]
    return kept


def skip_reason(run: str, runs: dict[str, Any], left_s: float) -> str | None:
    if run != "save" and kind(run) in FOUNDRY_RUNS and "save" in runs and not runs["save"].get("ok"):
        return "skipped: the SAVE run did not succeed"
    if left_s < MIN_RUN_S:
        return f"skipped: {left_s:.0f} s of the budget left"
    return None


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.monotonic()
    out_path = Path(opts.out).resolve()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "command": " ".join(sys.argv if argv is None else [sys.argv[0], *argv]),
        "engine": opts.engine,
        "engine_version": engine_version(opts.engine),
        "python": sys.version.split()[0],
        "runs_requested": opts.runs,
        "prompts": PROMPTS,
        "max_tokens": opts.max_tokens,
        "sampling": SAMPLING if opts.sampling else None,
        "one_prompt_per_request": opts.one_prompt_per_request,
        # Given to every run, stock too (e.g. a compile setting Foundry pins, so stock compiles alike).
        "engine_args": list(getattr(opts, "engine_arg", [])),
        "engine_env": list(getattr(opts, "engine_env", [])),
    }
    runs: dict[str, dict[str, Any]] = resumed_runs(out_path, meta, opts) if opts.resume else {}

    def flush() -> dict[str, Any]:
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        result = assemble(meta, runs)
        write_json(out_path, result)
        return result

    # The caller's own time limit (SIGTERM) still ends the current server and writes the result.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        bench = setup(opts, meta)
        flush()
        for run in opts.runs:
            left = opts.budget - (time.monotonic() - started)
            reason = skip_reason(run, runs, left - 30)
            if reason:
                runs[run] = {"name": run, "ok": False, "skipped": True, "error": reason}
            else:
                timeout = min(opts.timeout, left - 30)  # room to end the server and write
                print(f"[cold_start] {opts.engine} {run}: starting (timeout {timeout:.0f} s)", flush=True)
                r = run_one(bench, run, timeout, runs)
                print(
                    f"[cold_start] {run}: {'ok' if r['ok'] else 'FAILED'} ready {r.get('ready_s')} s, "
                    f"ttft {r.get('ttft_s')} s {r.get('error') or ''}",
                    flush=True,
                )
            flush()
    except BaseException as e:  # the result is written whatever happens
        meta["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    result = flush()
    try:
        meta["chart"] = write_chart(result, out_path.with_suffix(".png"))
    except Exception as e:  # a chart is never worth losing the result
        meta["chart"] = f"failed: {type(e).__name__}: {e}"
    result = flush()
    print("\n".join(summary_lines(result)), flush=True)
    ok = all((runs.get(r) or {}).get("ok") for r in opts.runs) and "error" not in meta
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
