"""What each side-by-side mode launches: the server's command line and environment, per engine.

Every mode starts the same server command (:func:`base_argv`) with the same environment
(:func:`base_env`); a mode only adds to them, and the additions are spelled out here, in one place:

* ``stock_naive``: nothing added; HOME and TMPDIR (where every engine cache lives by default) empty.
* ``stock_best``: :data:`STOCK_BEST_ENV` (and for vLLM :data:`STOCK_BEST_VLLM_COMPILE`), every launch
  setting Foundry applies that a stock user can apply too; the engine's own caches from an earlier
  stock start restored under HOME and TMPDIR.
* ``foundry``: :data:`STOCK_BEST_ENV` as well (Foundry sets the same values itself) plus the plugin:
  :data:`ALLOWED_DIFF` lists everything in which it may differ from ``stock_best``;
  tests/test_sxs_settings.py fails on any other difference and on a setting of Foundry's missing
  from :data:`STOCK_BEST_ENV`.
* ``peer`` (SGLang): upstream Foundry (``foundry-core`` 0.1.0rc3, its site first on the path)
  activated the way its README says, through ``FOUNDRY_GRAPH_EXTENSION_CONFIG``; it pins the rest
  itself (its LD_PRELOAD hook, ``TORCHDYNAMO_DISABLE=1``, prefill graphs off).
* ``stock_default`` (serving only): the engine's defaults, graph configuration included
  (:data:`GRAPH_ARGS` left out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

ENGINES = ("sglang", "vllm")
MODES = ("stock_naive", "stock_best", "foundry", "peer", "stock_default")
PEER_ENGINES = ("sglang",)

#: Launch settings of Foundry's that a stock user can set as well, with where Foundry sets them.
STOCK_BEST_ENV: dict[str, dict[str, str]] = {
    "sglang": {
        # foundry_core.engine.inductor.PINNED, set in the scheduler by pin_process()
        "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "0",
    },
    "vllm": {
        # foundry_vllm_plugin.session.launch_settings()
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
        "VLLM_USE_MEGA_AOT_ARTIFACT": "1",
        # foundry_core.engine.inductor.PINNED, set in the worker by pin_process()
        "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "0",
    },
}

#: The only differences allowed between ``stock_best`` and ``foundry``: engine arguments (by flag)
#: and environment variables (by name), each with why.
ALLOWED_DIFF: dict[str, dict[str, str]] = {
    "args": {
        "--enable-foundry": "turns the plugin on",
        "--foundry-config": "the plugin's TOML (mode, archive, region)",
    },
    "env": {
        "PYTHONPATH": "the entry-point shim that lets the engine find the plugin from src/",
        "SGLANG_PLUGINS": "the plugin allow-list: stock keeps Foundry out",
        "VLLM_PLUGINS": "the plugin allow-list: stock keeps Foundry out",
    },
}

#: Graph settings every mode but stock_default shares: decode graphs at the engine's default batch
#: sizes, nothing else captured. SGLang: prefill graphs off (neither Foundry nor upstream Foundry
#: persists its piecewise ones). vLLM: full decode graphs only, what Foundry's plugin requests
#: (foundry_vllm_plugin.support.FOUNDRY_CUDAGRAPH_MODE) where vLLM would add piecewise graphs.
GRAPH_ARGS = {"sglang": ["--cuda-graph-backend-prefill", "disabled"], "vllm": []}
VLLM_GRAPH_CONFIG = {"cudagraph_mode": "FULL_DECODE_ONLY"}
#: vLLM compilation-config entries Foundry's plugin sets (foundry_core.engine.inductor.pin into
#: ``inductor_compile_config``), which a stock user can pass too: stock_best and foundry get them.
STOCK_BEST_VLLM_COMPILE = {"inductor_compile_config": {"dynamic_scale_rblock": False}}

PLUGIN_GROUPS = {"sglang": "sglang.srt.plugins", "vllm": "vllm.general_plugins"}
PLUGIN_TARGETS = {"sglang": "foundry_core.plugin_entry:sglang", "vllm": "foundry_core.plugin_entry:vllm"}
PLUGIN_NAME = "foundry_graphs"  # our entry point's name (packages/<engine>/pyproject.toml)
PEER_PLUGIN_NAME = "foundry"  # upstream Foundry's (foundry-core 0.1.0rc3)
ALLOW_VAR = {"sglang": "SGLANG_PLUGINS", "vllm": "VLLM_PLUGINS"}
PEER_CONFIG_ENV = "FOUNDRY_GRAPH_EXTENSION_CONFIG"
SHIM_DIST = "foundry_graphs_sxs_shim-0.0.0"

#: Cache locations a start must not inherit from the calling shell: each engine must fall back to
#: its default under HOME/TMPDIR.
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
#: Everything a start must not inherit: cache locations and Foundry's (and upstream's) settings.
SCRUBBED_ENV = (
    *CACHE_ENV,
    "FOUNDRY_CONFIG",
    "FOUNDRY_MODE",
    "FOUNDRY_ARCHIVE_DIR",
    "FOUNDRY_CACHE_ROOT",
    PEER_CONFIG_ENV,
    "LD_PRELOAD",
)


@dataclasses.dataclass
class Launch:
    """One start's command line and environment."""

    argv: list[str]
    env: dict[str, str]


@dataclasses.dataclass
class Where:
    """The paths a start uses; the same HOME/TMPDIR paths for every mode, as in containers of one
    image (engines put them into cache keys)."""

    model_dir: Path
    home: Path
    tmp: Path
    port: int
    shim: Path | None = None  # entry-point shim folder (foundry)
    toml: Path | None = None  # Foundry's TOML (foundry) or upstream's (peer)
    peer_site: Path | None = None  # where foundry-core 0.1.0rc3 is installed (peer)


def base_argv(engine: str, where: Where, dummy: bool, mode: str) -> list[str]:
    """The server command every mode shares; only stock_default drops :data:`GRAPH_ARGS`."""
    load = ["--load-format", "dummy"] if dummy else []
    graphs = [] if mode == "stock_default" else GRAPH_ARGS[engine]
    if engine == "sglang":
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(where.model_dir)]
        argv += [*load, *graphs, "--random-seed", "0", "--log-level", "info"]
    else:
        # The module rather than a ``vllm`` on PATH: the interpreter and site recorded here.
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(where.model_dir)]
        argv += [*load, *graphs, "--seed", "0", "--max-model-len", "4096"]
    if engine == "vllm" and mode != "stock_default":
        config = dict(
            VLLM_GRAPH_CONFIG, **(STOCK_BEST_VLLM_COMPILE if mode in ("stock_best", "foundry") else {})
        )
        argv += ["--compilation-config", json.dumps(config, sort_keys=True)]
    return [*argv, "--port", str(where.port), "--host", "127.0.0.1"]


def installed_plugins(engine: str) -> list[str]:
    """The engine's general plugins installed beside it, ours left out (no engine import): a stock
    user's engine loads them, so every mode allows them."""
    from importlib.metadata import entry_points

    ours = {PLUGIN_NAME, PEER_PLUGIN_NAME}
    return sorted({ep.name for ep in entry_points(group=PLUGIN_GROUPS[engine])} - ours)


def base_env(
    parent: dict[str, str], engine: str, where: Where, repo_src: Path, others: tuple[str, ...] = ()
) -> dict[str, str]:
    env = {k: v for k, v in parent.items() if k not in SCRUBBED_ENV}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(repo_src) not in parts:
        parts.append(str(repo_src))
    env.update(
        PYTHONPATH=os.pathsep.join(parts),
        HOME=str(where.home),
        TMPDIR=str(where.tmp),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONHASHSEED="0",
        FOUNDRY_NO_PROGRESS="1",
    )
    if engine == "vllm":
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # Both variables are allow-lists: the other plugins stay in, ours and upstream's out; "none", a name no plugin has, keeps every plugin out.
    env[ALLOW_VAR[engine]] = ",".join(others) or "none"
    return env


def launch(
    engine: str,
    mode: str,
    where: Where,
    dummy: bool,
    parent: dict[str, str],
    repo_src: Path,
    others: tuple[str, ...] = (),
) -> Launch:
    """The command and environment of one start of ``mode``; ``others``: :func:`installed_plugins`."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
    if mode == "peer" and engine not in PEER_ENGINES:
        raise ValueError(f"mode peer exists for {', '.join(PEER_ENGINES)} only")
    argv = base_argv(engine, where, dummy, mode)
    env = base_env(parent, engine, where, repo_src, others)
    if mode in ("stock_best", "foundry"):
        env.update(STOCK_BEST_ENV[engine])
    if mode == "foundry":
        if where.toml is None or where.shim is None:
            raise ValueError("mode foundry needs its TOML and the entry-point shim")
        argv += ["--enable-foundry", "--foundry-config", str(where.toml)]
        env["PYTHONPATH"] = os.pathsep.join([str(where.shim), env["PYTHONPATH"]])
        env[ALLOW_VAR[engine]] = ",".join([*others, PLUGIN_NAME])
    if mode == "peer":
        if where.toml is None or where.peer_site is None:
            raise ValueError("mode peer needs its TOML and upstream Foundry's site")
        # Our src stays off the path's plugin list (no shim): only upstream's entry point exists.
        env["PYTHONPATH"] = os.pathsep.join([str(where.peer_site), env["PYTHONPATH"]])
        env[ALLOW_VAR[engine]] = ",".join([*others, PEER_PLUGIN_NAME])
        env[PEER_CONFIG_ENV] = str(where.toml)
    return Launch(argv, env)


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """``--flag -> [values]`` of a command line (the command itself under the key ``""``)."""
    out: dict[str, list[str]] = {"": []}
    key = ""
    for item in argv:
        if item.startswith("--"):
            key, sep, value = item.partition("=")
            out.setdefault(key, [])
            if sep:
                out[key].append(value)
        else:
            out.setdefault(key, []).append(item)
    return out


def settings_diff(a: Launch, b: Launch) -> dict[str, list[str]]:
    """The engine arguments (flags) and environment variables in which two launches differ."""
    fa, fb = _flags(a.argv), _flags(b.argv)
    args = sorted(k or "<command>" for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
    env = sorted(k for k in set(a.env) | set(b.env) if a.env.get(k) != b.env.get(k))
    return {"args": args, "env": env}


def disallowed(diff: dict[str, list[str]]) -> dict[str, list[str]]:
    """The part of :func:`settings_diff` that :data:`ALLOWED_DIFF` does not allow."""
    return {kind: [n for n in names if n not in ALLOWED_DIFF[kind]] for kind, names in diff.items()}


def write_shim(root: Path, engine: str) -> Path:
    """A ``.dist-info`` declaring the plugin's entry point, so the engine finds the plugin from src/
    (engines discover plugins through entry points only). Only Foundry's starts get it."""
    info = root / f"{SHIM_DIST}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    name, version = SHIM_DIST.rsplit("-", 1)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[{PLUGIN_GROUPS[engine]}]\n{PLUGIN_NAME} = {PLUGIN_TARGETS[engine]}\n"
    )
    return root


def foundry_toml(path: Path, mode: str, archive: Path, region_size: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'mode = "{mode}"\narchive_dir = "{archive}"\n\n[region]\nsize = "{region_size}"\n')
    return path


def peer_toml(path: Path, mode: str, workspace: Path, region_size: str) -> Path:
    """Upstream Foundry's TOML (keys as its ``CUDAGraphExtensionConfig`` reads them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'mode = "{mode}"\nworkspace_root = "{workspace}"\nregion_size = "{region_size}"\n')
    return path
