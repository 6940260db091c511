"""Where a vLLM rank keeps its archive, what identifies "exactly this configuration", and auto mode.

Per rank ``r`` (the data-parallel rank; TP and PP are refused), under the configured ``archive_dir``:

* ``rank{r}/``           the Foundry core archive (``foundry_core.save`` / ``foundry_core.load``);
* ``rank{r}.vllm.json``  this plugin's manifest: the engine fingerprint, the KV-cache sizing that LOAD
  reuses instead of profiling memory, and the list of persisted graphs.  It is written last, after the
  core archive is complete, so its presence with a matching fingerprint is what "a valid archive for
  exactly this configuration" means in ``auto`` mode.
* ``rank{r}.start.json``  the report of the latest start of that rank (mode, graphs, capture/save or
  restore seconds, worker phase seconds, CUDA stream captures counted by the core's CUPTI recorder).
  Written for monitoring and benchmarks, best effort; nothing reads it back.

Nothing here touches the GPU; the worker supplies the device description.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from foundry_core.config import ConfigError, FoundryConfig
from foundry_core.engine.records import write_json_atomic
from foundry_vllm_plugin import settings

MANIFEST_SCHEMA = 1
MANIFEST_KIND = "foundry-vllm"
START_REPORT_SCHEMA = 1
START_REPORT_KIND = "foundry-vllm-start"


class ArchiveStateError(ConfigError):
    """``mode = "load"`` but no usable archive for this configuration; one line."""


def core_archive_dir(cfg: FoundryConfig, rank: int) -> Path:
    return cfg.rank_archive_dir(rank)


def manifest_path(cfg: FoundryConfig, rank: int) -> Path:
    return cfg.archive_dir / f"rank{rank}.vllm.json"


def start_report_path(cfg: FoundryConfig, rank: int) -> Path:
    return cfg.archive_dir / f"rank{rank}.start.json"


def _mode_name(mode: Any) -> str:
    return getattr(mode, "name", None) or str(mode)


def engine_fingerprint(vllm_config: Any, device: dict | None = None) -> dict:
    """Everything that decides what the decode graphs contain and where their memory lies.

    ``VllmConfig.compute_hash()`` covers model, cache, parallel, scheduler, compilation and
    ``additional_config`` (which holds only the Foundry TOML path).  The readable fields are repeated
    so that a mismatch can be explained, and a few that the hash leaves out but that change the memory
    layout (memory utilisation, explicit KV size, seed, load format) are added.
    """
    import vllm

    mc, cc, sc = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
    comp, pc = vllm_config.compilation_config, vllm_config.parallel_config
    fp: dict[str, Any] = {
        "vllm": getattr(vllm, "__version__", "unknown"),
        "config_hash": vllm_config.compute_hash(),
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "dtype": str(mc.dtype),
        "quantization": getattr(mc, "quantization", None),
        "max_model_len": int(mc.max_model_len),
        "seed": getattr(mc, "seed", None),
        "load_format": str(getattr(vllm_config.load_config, "load_format", "")),
        "block_size": getattr(cc, "block_size", None),
        "kv_cache_dtype": str(getattr(cc, "cache_dtype", "")),
        "gpu_memory_utilization": getattr(cc, "gpu_memory_utilization", None),
        "kv_cache_memory_bytes": getattr(cc, "kv_cache_memory_bytes", None),
        "max_num_seqs": getattr(sc, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
        "cudagraph_mode": _mode_name(comp.cudagraph_mode),
        "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes or []),
        "compilation_mode": _mode_name(getattr(comp, "mode", None)),
        "data_parallel_size": getattr(pc, "data_parallel_size", 1),
        "data_parallel_rank": getattr(pc, "data_parallel_rank", 0),
        "v2_model_runner": bool(getattr(vllm_config, "use_v2_model_runner", False)),
    }
    entry = settings.foundry_entry(getattr(vllm_config, "additional_config", None))
    if entry:  # in config_hash already; kept readable to say why a LOAD with another file is refused
        fp["foundry_config"] = entry.get("config")
    if getattr(mc, "is_hybrid", False):
        # What shapes a hybrid model's state caches and its gated-delta-net decode kernels but is not
        # in compute_hash (prefix caching, the two layout switches read from the environment).
        fp["hybrid"] = {
            "architecture": getattr(mc, "architecture", None),
            "enable_prefix_caching": getattr(cc, "enable_prefix_caching", None),
            **{
                key: getattr(cc, key, None)
                for key in (
                    "mamba_cache_mode",
                    "mamba_block_size",
                    "mamba_cache_dtype",
                    "mamba_ssm_cache_dtype",
                )
            },
            **{key: os.environ.get(key) for key in HYBRID_ENV},
        }
    if device:
        fp["device"] = dict(device)
    return json.loads(json.dumps(fp, default=str))


def read_manifest(path: Path) -> dict | None:
    """The manifest at ``path``, or ``None`` when it is missing or not a manifest of this schema."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or data.get("kind") != MANIFEST_KIND
        or data.get("schema") != MANIFEST_SCHEMA
    ):
        return None
    return data


def write_manifest(path: Path, fingerprint: dict, sizing: dict, graphs: list[dict]) -> dict:
    """Write the manifest atomically (rename over any older one) and return what was written."""
    data = {
        "kind": MANIFEST_KIND,
        "schema": MANIFEST_SCHEMA,
        "fingerprint": fingerprint,
        "sizing": sizing,
        "graphs": graphs,
    }
    write_json_atomic(path, data)
    return data


#: Environment switches of vLLM's gated-delta-net layers that decide, at capture, which decode path
#: and which conv-state layout the graph holds.
HYBRID_ENV = ("VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE", "VLLM_SSM_CONV_STATE_LAYOUT")


def kv_layout(cache_config: Any, kv_cache_config: Any) -> dict:
    """How the KV cache is laid out once vLLM has sized it: the block size after vLLM aligned it to
    the state pages of a hybrid model (that happens after the engine is configured), the padded
    state page, and every cache group (spec type, block and page size, layers) and cache tensor
    (its plain fields). LOAD must build the same, or the graphs' views into it lie elsewhere."""

    def plain(obj: Any) -> dict:
        fields = getattr(obj, "__dataclass_fields__", None) or vars(obj)
        values = {name: getattr(obj, name, None) for name in fields}
        return {k: v for k, v in values.items() if isinstance(v, (int, str, list, tuple)) or v is None}

    groups = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = getattr(group, "kv_cache_spec", None)
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": getattr(spec, "block_size", None),
                "page_size_bytes": getattr(spec, "page_size_bytes", None),
                "layers": list(getattr(group, "layer_names", None) or []),
            }
        )
    layout = {
        "block_size": getattr(cache_config, "block_size", None),
        "mamba_page_size_padded": getattr(cache_config, "mamba_page_size_padded", None),
        "groups": groups,
        "tensors": [plain(t) for t in getattr(kv_cache_config, "kv_cache_tensors", None) or []],
    }
    return json.loads(json.dumps(layout, default=str))


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """A short description of the first differing key, or ``None`` when the fingerprints agree."""
    was, now = saved.get("foundry_config"), current.get("foundry_config")
    if was and now and was != now:  # an archive from before the field was kept compares by hash only
        return (
            f"it was saved with --foundry-config {was}, this start names {now}; vLLM hashes that path "
            "into its configuration and compile cache, so SAVE and LOAD must name the same file "
            '(mode = "auto" saves once and loads after)'
        )
    for key in sorted((set(saved) | set(current)) - {"foundry_config"}):
        if saved.get(key) != current.get(key):
            return f"{key}: archive has {saved.get(key)!r}, engine has {current.get(key)!r}"
    return None


def resolve_mode(cfg: FoundryConfig, rank: int, fingerprint: dict) -> tuple[str, dict | None, str]:
    """Decide SAVE or LOAD for one rank: ``(mode, manifest or None, reason)``.

    ``save`` always saves (and replaces the archive); ``load`` refuses, with one line, unless a manifest
    with this exact fingerprint and its core archive exist; ``auto`` loads in that case and saves
    otherwise.
    """
    mpath = manifest_path(cfg, rank)
    if cfg.mode == "save":
        return "save", None, "mode = save"
    manifest = read_manifest(mpath)
    problem = None
    if manifest is None:
        problem = f"no archive manifest at {mpath}"
    elif not core_archive_dir(cfg, rank).is_dir():
        problem = f"archive manifest {mpath} has no core archive at {core_archive_dir(cfg, rank)}"
    else:
        diff = fingerprint_mismatch(manifest.get("fingerprint", {}), fingerprint)
        if diff is not None:
            problem = f"archive {mpath} was saved for another configuration ({diff})"
    if problem is None:
        return "load", manifest, f"valid archive for this configuration at {mpath}"
    if cfg.mode == "load":
        raise ArchiveStateError(f"foundry mode = load, but {problem}")
    return "save", None, problem
