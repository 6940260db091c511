"""What an archive was saved for: the machine, the software stack, the rank layout and the model.

A Foundry archive holds device code and CUDA graphs that are only valid on the setup that produced them.
The fingerprint records that setup; LOAD compares the saved fingerprint with :func:`current_fingerprint`
field by field, in the order of :data:`FINGERPRINT_FIELDS`, and refuses on the first difference
(see :func:`foundry_core.archive.compare_fingerprint`).

This module imports neither torch nor the CUDA bindings at import time; :func:`current_fingerprint`
imports them when called. :func:`make_fingerprint` is pure, so tests can build fingerprints without a GPU.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from foundry_core import __version__

#: Version of the fingerprint scheme itself; bumped when fields are added, removed or change meaning,
#: so that an old archive is reported as "saved with fingerprint scheme N" rather than a confusing field.
FINGERPRINT_FORMAT = 1

#: The comparison order. Cheap, coarse facts come first so that the message names the most basic
#: difference: the scheme, then the GPU, the driver, CUDA, torch, Foundry, the rank layout, and last
#: the caller-supplied ``model`` dict (compared key by key, reported as ``model.<key>``).
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "fingerprint_format",
    "gpu_name",
    "compute_capability",
    "sm_count",
    "driver_version",
    "cuda_version",
    "torch_version",
    "foundry_version",
    "rank",
    "world_size",
    "model",
)

_CC_RE = re.compile(r"^\d+\.\d+$")
_REQUIRED = ("gpu_name", "compute_capability", "sm_count", "driver_version", "cuda_version", "torch_version")


def format_driver_version(version: int) -> str:
    """``cuDriverGetVersion`` returns ``1000 * major + 10 * minor``; 13000 -> ``"13.0"``, 12080 -> ``"12.8"``."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(
            f"driver_version: expected a positive integer from cuDriverGetVersion, got {version!r}"
        )
    return f"{version // 1000}.{(version % 1000) // 10}"


def canonical_json_value(value: Any, where: str) -> Any:
    """Return ``value`` as plain JSON data (tuples become lists); refuse anything JSON cannot hold exactly.

    Dict keys must be strings (``json`` would silently turn ``1`` into ``"1"``), floats must be finite.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: cannot store non-finite number {value!r}")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [canonical_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            out[k] = canonical_json_value(v, f"{where}.{k}")
        return out
    raise ValueError(f"{where}: cannot store a value of type {type(value).__name__}")


def make_fingerprint(**fields: Any) -> dict:
    """Build a fingerprint dict from explicit fields; pure, needs no GPU.

    Required: ``gpu_name``, ``compute_capability`` (``"9.0"``), ``sm_count``, ``driver_version`` (``"13.0"``
    or the raw ``cuDriverGetVersion`` integer), ``cuda_version`` (``torch.version.cuda``; ``None`` for a
    CPU build of torch), ``torch_version``. Defaults: ``fingerprint_format`` = :data:`FINGERPRINT_FORMAT`,
    ``foundry_version`` = this Foundry, ``rank`` = 0, ``world_size`` = 1, ``model`` = ``{}``.
    Unknown field names raise :class:`ValueError` (a typo would otherwise never be compared).
    """
    unknown = sorted(set(fields) - set(FINGERPRINT_FIELDS))
    if unknown:
        raise ValueError(f"unknown fingerprint field {unknown[0]!r} (known: {', '.join(FINGERPRINT_FIELDS)})")
    missing = [f for f in _REQUIRED if f not in fields]
    if missing:
        raise ValueError(f"fingerprint field {missing[0]!r} is required")
    fp: dict[str, Any] = {
        "fingerprint_format": fields.get("fingerprint_format", FINGERPRINT_FORMAT),
        "foundry_version": fields.get("foundry_version", __version__),
        "rank": fields.get("rank", 0),
        "world_size": fields.get("world_size", 1),
        "model": fields.get("model") if fields.get("model") is not None else {},
    }
    for f in _REQUIRED:
        fp[f] = fields[f]

    def _int(name: str, lo: int) -> None:
        v = fp[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"fingerprint field {name!r}: expected an integer >= {lo}, got {v!r}")

    def _str(name: str, optional: bool = False) -> None:
        v = fp[name]
        if optional and v is None:
            return
        if not isinstance(v, str) or not v:
            raise ValueError(f"fingerprint field {name!r}: expected a non-empty string, got {v!r}")

    _int("fingerprint_format", 1)
    _str("gpu_name")
    _str("compute_capability")
    if not _CC_RE.match(fp["compute_capability"]):
        raise ValueError(
            f"fingerprint field 'compute_capability': expected 'major.minor', got {fp['compute_capability']!r}"
        )
    _int("sm_count", 1)
    if isinstance(fp["driver_version"], int) and not isinstance(fp["driver_version"], bool):
        fp["driver_version"] = format_driver_version(fp["driver_version"])
    _str("driver_version")
    _str("cuda_version", optional=True)
    _str("torch_version")
    _str("foundry_version")
    _int("rank", 0)
    _int("world_size", 1)
    if fp["rank"] >= fp["world_size"]:
        raise ValueError(f"fingerprint: rank {fp['rank']} is outside world_size {fp['world_size']}")
    if not isinstance(fp["model"], dict):
        raise ValueError(f"fingerprint field 'model': expected a dict, got {type(fp['model']).__name__}")
    fp["model"] = canonical_json_value(fp["model"], "model")
    # Key order of the dict follows FINGERPRINT_FIELDS; the manifest stores it with sorted keys anyway.
    fp = {k: fp[k] for k in FINGERPRINT_FIELDS}
    json.dumps(fp, allow_nan=False)  # cannot fail after canonical_json_value; a cheap invariant check
    return fp


def current_fingerprint(
    device: int = 0, *, model: dict | None = None, rank: int = 0, world_size: int = 1
) -> dict:
    """The fingerprint of CUDA device ``device`` in this process, with the caller's ``model`` facts.

    ``model`` should hold everything about the engine setup that changes the captured graphs (model
    name/revision, dtype, capture sizes, parallel layout, pool sizes...); it is compared key by key.
    Raises :class:`RuntimeError` when torch has no usable CUDA device.
    """
    import torch  # lazy: the archive format must be usable without torch

    if not torch.cuda.is_available():
        raise RuntimeError("cannot fingerprint this machine: torch sees no CUDA device")
    props = torch.cuda.get_device_properties(device)
    from cuda.bindings import driver  # lazy as well

    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot fingerprint this machine: cuDriverGetVersion failed with {err!r}")
    return make_fingerprint(
        gpu_name=str(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=int(props.multi_processor_count),
        driver_version=int(version),
        cuda_version=torch.version.cuda,
        torch_version=str(torch.__version__),
        rank=rank,
        world_size=world_size,
        model=model if model is not None else {},
    )
