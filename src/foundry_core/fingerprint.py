"""What an archive was saved for: the machine, the software stack, the rank layout and the model.

A Foundry archive holds device code and CUDA graphs that are only valid on the setup that produced them.
The fingerprint records that setup; LOAD compares the saved fingerprint with :func:`current_fingerprint`
field by field, in the order of :data:`FINGERPRINT_FIELDS`, and refuses on the first difference
(:func:`compare_fingerprint`, here beside the making so that the two stay in step). A difference is a
:class:`FingerprintMismatch`, an :class:`~foundry_core.archive.ArchiveError`; both are defined in
:mod:`foundry_core.archive.errors` and importable from here as well.

This module imports neither torch nor the CUDA bindings at import time; :func:`current_fingerprint`
imports them when called. :func:`make_fingerprint` is pure, so tests can build fingerprints without a GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from foundry_core import __version__
from foundry_core.archive.errors import MISSING, ArchiveError, FingerprintMismatch, _one_line
from foundry_core.archive.format import _dumps, canonical_json_value

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


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def format_driver_version(version: int) -> str:
    """``cuDriverGetVersion`` returns ``1000 * major + 10 * minor``; 13000 -> ``"13.0"``, 12080 -> ``"12.8"``."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(
            f"driver_version: expected a positive integer from cuDriverGetVersion, got {version!r}"
        )
    return f"{version // 1000}.{(version % 1000) // 10}"


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


# --------------------------------------------------------------------------------------------------
# comparison


def _show(value: Any) -> str:
    return _one_line(repr(value), 120)


def _canon(value: Any, field: str, side: str) -> bytes:
    try:
        return _dumps(canonical_json_value(value, f"{side} fingerprint {field}"))
    except ValueError as e:
        raise ArchiveError(_one_line(str(e))) from None
    except RecursionError:
        raise ArchiveError(f"{side} fingerprint {field}: nested too deeply") from None


def _mismatch(field: str, saved: Any, current: Any) -> FingerprintMismatch:
    if saved is MISSING:
        text = f"archive was saved without {field}, this machine has {_show(current)}"
    elif current is MISSING:
        text = f"archive was saved for {field}={_show(saved)}, this machine has no {field}"
    else:
        text = f"archive was saved for {field}={_show(saved)}, this machine has {_show(current)}"
    return FingerprintMismatch(text + "; SAVE again on this setup", field, saved, current)


def _compare_values(field: str, saved: Any, current: Any) -> None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current), key=str):
            _compare_values(f"{field}.{key}", saved.get(key, MISSING), current.get(key, MISSING))
        return
    if saved is MISSING or current is MISSING:
        raise _mismatch(field, saved, current)
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        # Name the first difference: long lists (capture sizes) would otherwise print alike once cut.
        for i, (a, b) in enumerate(zip(saved, current)):
            _compare_values(f"{field}[{i}]", a, b)
        if len(saved) != len(current):
            n = min(len(saved), len(current))
            raise _mismatch(f"{field}[{n}:]", list(saved[n:]), list(current[n:]))
        return
    # Compare JSON encodings: a tuple equals the list JSON gives back, but True != 1 and 1 != 1.0.
    if _canon(saved, field, "saved") != _canon(current, field, "current"):
        raise _mismatch(field, saved, current)


def compare_fingerprint(saved: Mapping, current: Mapping) -> None:
    """Raise :class:`FingerprintMismatch` naming the first differing field.

    Order: :data:`~foundry_core.fingerprint.FINGERPRINT_FIELDS` (the fingerprint scheme, GPU, driver,
    CUDA, torch, Foundry, rank layout, ``model``), then any other keys sorted. Dict values (``model``)
    are compared key by key in sorted order and reported as ``model.<key>``. A key present on one
    side only is a mismatch. Values are compared as JSON (a tuple equals a list; ``True`` != ``1``).
    """
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping):
        raise ArchiveError("fingerprints must be dicts")
    order = list(FINGERPRINT_FIELDS) + sorted((set(saved) | set(current)) - set(FINGERPRINT_FIELDS), key=str)
    for field in order:
        _compare_values(str(field), saved.get(field, MISSING), current.get(field, MISSING))
