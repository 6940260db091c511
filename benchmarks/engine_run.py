"""One engine server run as benchmarks/engine_faults.py starts it: the model folder (config, small
tokenizer, optional seeded weights), the server's command line and environment (stock keeps the
plugin out through the engine's allow-list; Foundry runs find it through an entry-point shim), the
greedy request and its outputs, and the machine's facts. Moved here from the former cold_start.py
(replaced by benchmarks/sxs.py); the server plumbing itself is benchmarks/sxs_server.py's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from sxs_model import SPECIALS as TOKENIZER_SPECIALS  # noqa: E402
from sxs_model import WORDS as TOKENIZER_WORDS  # noqa: E402
from sxs_model import tokenizer_files, tokenizer_vocab  # noqa: E402,F401
from sxs_modes import CACHE_ENV  # noqa: E402
from sxs_server import ServerDied, free_port, http_json, kill_group, wait_ready  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENGINES = ("sglang", "vllm")

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


# The servers only need a tokenizer that loads (sxs_model's): prompts are token ids, outputs are
# compared as ids.
EOS_TOKEN = "<|im_end|>"


#: Four different prompts (one request, prompt = list of lists); ids stay inside the tokenizer's vocab
#: so no server refuses them as out of vocabulary.
PROMPTS = [
    [len(TOKENIZER_SPECIALS) + (37 * i + 11 * j) % TOKENIZER_WORDS for j in range(6 + 5 * i)]
    for i in range(4)
]


MAX_TOKENS = 64


TOP_LOGPROBS = 5


PLUGIN_GROUPS = {"sglang": "sglang.srt.plugins", "vllm": "vllm.general_plugins"}


PLUGIN_TARGETS = {"sglang": "foundry_core.plugin_entry:sglang", "vllm": "foundry_core.plugin_entry:vllm"}


PLUGIN_NAME = "foundry_graphs"  # packages/<engine>/pyproject.toml


SHIM_DIST = "foundry_graphs_engine_run_shim-0.0.0"


# The plugin's report directory variable, spelled out (importing the plugin here is what we avoid).
SGLANG_REPORT_ENV = "FOUNDRY_SGLANG_REPORT_DIR"


CACHE_ROOT_ENV = "FOUNDRY_CACHE_ROOT"  # foundry_core.engine.caches.ROOT_ENV


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


def tokenizer_config() -> dict[str, Any]:
    # sxs_model's: PreTrainedTokenizerFast loads in transformers 4 and 5 alike
    return dict(tokenizer_files()["tokenizer_config.json"])


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


@dataclasses.dataclass
class RunPaths:
    """Where one run keeps its state (HOME, TMPDIR, Foundry's cache root and report folder).

    Every Foundry run sees the same HOME and TMPDIR *paths*, as every container started from one
    image does: engines put them into cache keys (vLLM hashes its HOME-derived settings into the
    torch.compile cache key), so a SAVE under one HOME and a LOAD under another would miss for a
    reason no deployment has. ``kept_home``/``kept_tmp`` are kept for engine_faults' servers
    (faults_server.py)."""

    home: Path
    tmp: Path
    kept_home: Path
    kept_tmp: Path
    cache_root: Path  # FOUNDRY_CACHE_ROOT (Foundry runs)
    report_dir: Path  # FOUNDRY_SGLANG_REPORT_DIR (Foundry runs on SGLang)


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
    foundry = run != "stock_cold"  # engine_faults: "save" (any Foundry start) or "stock_cold"
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


@dataclasses.dataclass
class Bench:
    """One benchmark's model, archive, plugin shim and machine baseline (engine_faults' ``Ctx.bench``,
    in faults_context.py)."""

    engine: str
    workdir: Path
    logs: Path
    model_dir: Path
    archive_dir: Path
    toml: Path
    shim: Path | None
    other_plugins: list[str]
    user_base: str | None = None
    gpu_baseline_mib: int | None = None
    dummy_weights: bool = True  # --weights dummy
    max_tokens: int = MAX_TOKENS


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
    return Bench(
        engine=opts.engine,
        workdir=workdir,
        logs=logs,
        model_dir=model_dir,
        archive_dir=archive_dir,
        toml=toml,
        shim=shim,
        other_plugins=plugins,
        user_base=site.getuserbase(),
        gpu_baseline_mib=gpu_memory_used_mib(),
        dummy_weights=opts.weights == "dummy",
        max_tokens=opts.max_tokens,
    )
