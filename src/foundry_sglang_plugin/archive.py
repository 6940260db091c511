"""Which configuration an archive belongs to, and whether one exists for this launch.

Each rank keeps its Foundry archive at ``archive_dir/rank<r>`` (the core's atomically swapped
archive, which may hold only the files its manifest lists). Beside it, not inside, the plugin writes
``archive_dir/rank<r>.sglang.json`` after the core archive is committed, so its presence marks a
finished SAVE: the configuration fingerprint, the memory-pool sizing (needed before the archive can
be opened on the GPU) and the decode shapes with their output layouts. ``auto`` mode loads only when
every rank of this launch has that file with exactly this launch's fingerprint; the core's own
``fc.load`` checks the same fingerprint again when the graphs are restored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
from pathlib import Path
from typing import Any

from foundry_core.engine.records import read_json, write_json_atomic
from foundry_core.fingerprint import package_version
from foundry_sglang_plugin import classified
from foundry_sglang_plugin._view import reader

SIDECAR_SUFFIX = ".sglang.json"
FORMAT = 2  # 2: fields and SGLANG_* switches from .classified (SGLang 0.5.23)

# Which server arguments and SGLANG_* switches are fingerprinted: :mod:`.classified` (every field and
# switch of SGLang 0.5.23 is fingerprinted, refused or irrelevant there; unknown ones are fingerprinted).
# Ports, hosts, logging and other serving-only settings are left out on purpose: they differ from
# launch to launch and would make ``auto`` recapture every time.
# Not fingerprinted: ``random_seed``. It changes no graph and no memory layout (graph-side Philox
# state is restored from the generator at each replay), and SGLang before the msgspec record
# (0.5.20) resolves an unset seed to a fresh random number in every launch, so with it ``auto`` would
# never find a matching archive there.


def _plain(value: Any) -> Any:
    """A JSON-stable rendering of a server-argument value (never a ``repr`` with an address in it for
    SGLang's own records, so that the launcher and each scheduler render one value alike)."""
    import enum

    if isinstance(value, enum.Enum):
        return _plain(value.value)
    to_builtins = _msgspec_builtins(value)
    if to_builtins is not None:
        return _plain(to_builtins)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _msgspec_builtins(value: Any) -> Any:
    msgspec = sys.modules.get("msgspec")
    if msgspec is None or not isinstance(value, msgspec.Struct):
        return None
    return msgspec.to_builtins(value, builtin_types=(), str_keys=True, enc_hook=repr)


def _record_fields(server_args: Any) -> tuple[str, ...]:
    cls = type(server_args)
    fields = getattr(cls, "__struct_fields__", None)
    if fields is None:
        fields = tuple(getattr(cls, "__dataclass_fields__", {}))
    return tuple(fields)


def _env_switches() -> dict[str, str]:
    """The fingerprinted ``SGLANG_*`` switches that are set, with their raw values."""
    import os

    try:
        from sglang.srt.environ import envs
    except ImportError:
        return {}
    declared = [n for n in dir(type(envs)) if n.startswith("SGLANG_")]
    return {n: os.environ[n] for n in classified.env_switches_to_fingerprint(declared) if n in os.environ}


def _decode_only(value: Any) -> Any:
    # Only the decode phase of the graph configuration is persisted; prefill graphs are refused.
    return value.get("decode") if isinstance(value, dict) else value


def _model_config_digest(model_path: Any) -> str | None:
    if not isinstance(model_path, str):
        return None
    config = Path(model_path) / "config.json"
    try:
        return hashlib.sha256(config.read_bytes()).hexdigest()
    except OSError:
        return None  # a hub id: the path and revision stand for it


def fingerprint(server_args: Any, cfg: Any) -> dict[str, Any]:
    """The configuration an archive is valid for; identical in the launcher and in each scheduler."""
    read = reader(server_args)
    names = classified.server_fields_to_fingerprint(_record_fields(server_args))
    args = {name: _plain(read(name)) for name in names}
    if "cuda_graph_config" in args:
        args["cuda_graph_config"] = _decode_only(args["cuda_graph_config"])
    return {
        "format": FORMAT,
        "engine": "sglang",
        "sglang": package_version("sglang"),
        "torch": package_version("torch"),
        "foundry": package_version("foundry-graphs"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "model_config_sha256": _model_config_digest(read("model_path")),
        "region": {"base": cfg.region_base, "size": cfg.region_size},
        "server_args": args,
        "sglang_env": _env_switches(),
    }


def world_size(server_args: Any) -> int:
    """Scheduler processes (one archive each) of this launch."""
    read = reader(server_args)
    return max(1, int(read("dp_size", 1) or 1)) * max(1, int(read("tp_size", 1) or 1))


def sidecar_path(cfg: Any, rank: int) -> Path:
    archive_path = Path(cfg.rank_archive_dir(rank))
    return archive_path.with_name(archive_path.name + SIDECAR_SUFFIX)


def read_sidecar(cfg: Any, rank: int) -> dict[str, Any] | None:
    data = read_json(sidecar_path(cfg, rank))
    return data if isinstance(data, dict) else None


def write_sidecar(cfg: Any, rank: int, data: dict[str, Any]) -> None:
    """Atomic and fsynced: its presence marks a finished SAVE, also after a crash."""
    write_json_atomic(sidecar_path(cfg, rank), data)


def drop_sidecar(cfg: Any, rank: int) -> None:
    """Invalidate a rank's archive before it is overwritten, so a crashed SAVE never looks complete.

    A sidecar that cannot be removed (a read-only ``archive_dir``) is left with a warning: the SAVE
    that follows cannot write there either, which ``auto`` mode survives and ``save`` mode reports."""
    path = sidecar_path(cfg, rank)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.getLogger("foundry.sglang").warning(
            "Foundry: cannot remove %s (%s); its archive is not used by this start", path, e.strerror or e
        )


def replica_ranks(server_args: Any, replica: int) -> range:
    """The ranks (archives) of data-parallel replica ``replica``: its tensor-parallel ranks."""
    tp = max(1, int(reader(server_args)("tp_size", 1) or 1))
    return range(replica * tp, (replica + 1) * tp)


def complete(server_args: Any, cfg: Any, replica: int | None = None) -> bool:
    """Whether every rank of this launch (of data-parallel replica ``replica`` only, where given) has
    a finished archive saved for exactly this configuration."""
    want = fingerprint(server_args, cfg)
    ranks = range(world_size(server_args)) if replica is None else replica_ranks(server_args, replica)
    for rank in ranks:
        side = read_sidecar(cfg, rank)
        if side is None or side.get("fingerprint") != want:
            return False
    return True


def decide_mode(server_args: Any, cfg: Any) -> str:
    """``save`` or ``load`` for this launch: ``auto`` loads only when the archive is :func:`complete`.

    Data-parallel replicas share nothing inside their graphs, so ``auto`` decides for each replica
    on its own ranks: where some replicas have their archives and others not (one replica's archive
    lost or damaged, the others' intact), the answer names each replica's mode in replica order,
    e.g. ``load,save``; the replicas with an archive restore it alone while the others SAVE theirs
    (:func:`replica_mode`). Tensor-parallel ranks of one replica always go together."""
    if cfg.mode != "auto":
        return cfg.mode
    dp = max(1, int(reader(server_args)("dp_size", 1) or 1))
    modes = ["load" if complete(server_args, cfg, replica=r) else "save" for r in range(dp)]
    return modes[0] if len(set(modes)) == 1 else ",".join(modes)


def replica_mode(mode: str, replica: int | None) -> str:
    """One replica's mode out of :func:`decide_mode`'s answer (a plain ``save``/``load`` is every
    replica's)."""
    if "," not in mode:
        return mode
    modes = mode.split(",")
    if replica is None or not 0 <= replica < len(modes):
        raise ValueError(f"the replicas' modes {mode!r} name no mode for data-parallel replica {replica}")
    return modes[replica]


def is_mode(mode: str | None) -> bool:
    """A settled mode: ``save``, ``load``, or one of them per data-parallel replica."""
    return bool(mode) and all(m in ("save", "load") for m in mode.split(","))
