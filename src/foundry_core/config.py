"""The Foundry TOML configuration shared by every engine plugin.

One schema, parsed here, so that SGLang and vLLM read the same file the same way::

    mode = "auto"                 # save | load | auto
    archive_dir = "/var/cache/foundry/qwen3-1.7b"
    strict = false                # true: auto refuses to start instead of falling back to a start
                                  # without what Foundry would do (archive refused, restore failed,
                                  # SAVE not writable), one line saying why
    allow_untested_release = false  # true: go on with an engine release outside the tested range
                                  # (foundry_core.engine.release), at your own risk; every LOAD is
                                  # then structure-checked

    [region]
    base = 0x600000000000         # fixed virtual address of the device-memory region
    size = "128GiB"               # virtual size reserved (physical memory is mapped on use)

    [caches]
    carry = true                  # SAVE stores the engine's compile/JIT caches; LOAD hands them over

    [trust]
    archive_digest = ""           # optional: pin the archive's manifest digest (sha256 hex);
                                  # several ranks: a table, archive_digest = { 0 = "...", 1 = "..." }
    caches_digest = ""            # optional: pin the carried caches the same way (needed to use
                                  # them once archive_digest is set)

    [load]
    check_structure = false       # after LOAD, read every graph back from the driver and refuse to
                                  # serve unless each is the archive's, node for node (slow)

Unknown keys are an error, not a silent no-op: a typo in a key would otherwise change what is
restored without anyone noticing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .errors import FoundryError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

MODES = ("save", "load", "auto")
DEFAULT_REGION_BASE = 0x600000000000
DEFAULT_REGION_SIZE = 128 << 30
# Per-rank regions are laid out back to back from the base (rank r at base + r * stride), so the
# stride must leave room for one region; 1 TiB keeps ranks far apart in the 47-bit user VA space.
RANK_STRIDE = 1 << 40
_GRANULE = 2 << 20
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(FoundryError, ValueError):
    """A Foundry configuration that cannot be used; the message is one line a user can act on."""


@dataclasses.dataclass(frozen=True)
class FoundryConfig:
    mode: str = "auto"
    archive_dir: Path = Path("foundry-archive")
    region_base: int = DEFAULT_REGION_BASE
    region_size: int = DEFAULT_REGION_SIZE
    archive_digest: str | None = None  # the rank-0 pin (the only one of a single-rank engine)
    archive_digests: tuple[tuple[int, str], ...] = ()  # every pinned rank, (rank, digest)
    carry_caches: bool = True  # [caches] carry: compile/JIT caches travel with the archive
    caches_digests: tuple[tuple[int, str], ...] = ()  # [trust] caches_digest, (rank, digest)
    check_structure: bool = False  # [load] check_structure: LOAD reads its graphs back and compares
    strict: bool = False  # auto refuses instead of falling back (foundry_core.engine.decide)
    allow_untested_release: bool = False  # go on with an untested engine release (engine.release)
    source: Path | None = None  # the file it came from, for messages

    def rank_archive_dir(self, rank: int = 0) -> Path:
        """Each rank of a multi-process engine keeps its own archive under the configured directory."""
        return self.archive_dir / f"rank{rank}"

    def digest_for_rank(self, rank: int = 0) -> str | None:
        """The pinned digest of ``rank``'s archive; None when nothing is pinned.

        Once anything is pinned every rank must be: an unpinned rank is an error, not a free pass.
        """
        if not self.archive_digests:
            return None
        pins = dict(self.archive_digests)
        if rank not in pins:
            raise ConfigError(
                f"trust.archive_digest pins rank(s) {sorted(pins)} but not rank {rank}: pin every rank or none"
            )
        return pins[rank]

    def rank_caches_dir(self, rank: int = 0) -> Path:
        """The carried compile/JIT caches of ``rank`` (an archive of their own, beside the graphs')."""
        return self.archive_dir / f"rank{rank}.caches"

    def caches_digest_for_rank(self, rank: int = 0) -> str | None:
        """The pinned digest of ``rank``'s carried caches; None when they are not pinned."""
        return dict(self.caches_digests).get(rank)

    def rank_region_base(self, rank: int = 0) -> int:
        return self.region_base + rank * RANK_STRIDE

    def to_env(self) -> dict[str, str]:
        """Settings as environment variables, for engines that start workers in fresh processes."""
        env = {
            "FOUNDRY_MODE": self.mode,
            "FOUNDRY_ARCHIVE_DIR": str(self.archive_dir),
            "FOUNDRY_REGION_BASE": hex(self.region_base),
            "FOUNDRY_REGION_SIZE": str(self.region_size),
        }
        if self.archive_digests:
            pins = dict(self.archive_digests)
            env["FOUNDRY_ARCHIVE_DIGEST"] = (
                pins[0] if list(pins) == [0] else json.dumps({str(r): d for r, d in sorted(pins.items())})
            )
        for key, on in (
            ("FOUNDRY_STRICT", self.strict),
            ("FOUNDRY_ALLOW_UNTESTED_RELEASE", self.allow_untested_release),
        ):
            if on:
                env[key] = "1"
        if self.source is not None:
            env["FOUNDRY_CONFIG"] = str(self.source)
        return env


def parse_size(value: Any, key: str) -> int:
    """Accept an int (bytes) or a string such as ``"64GiB"``, ``"512M"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"{key}: cannot read size {value!r} (use bytes or e.g. '64GiB')")
        unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
        n = int(m.group(1)) * _UNITS[unit]
    else:
        raise ConfigError(f"{key}: expected a size, got {type(value).__name__}")
    if n <= 0:
        raise ConfigError(f"{key}: size must be positive, got {n}")
    return n


def _parse_address(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an address, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value, 0)
        except ValueError:
            raise ConfigError(f"{key}: cannot read address {value!r}") from None
    if not isinstance(value, int):
        raise ConfigError(f"{key}: expected an address, got {type(value).__name__}")
    if value <= 0 or value % _GRANULE:
        raise ConfigError(f"{key}: {value:#x} must be a positive multiple of 2 MiB")
    if value >= 1 << 47:
        raise ConfigError(f"{key}: {value:#x} lies outside the 47-bit user address space")
    return value


_TOP_KEYS = {"mode", "archive_dir", "strict", "allow_untested_release", "region", "caches", "trust", "load"}
_REGION_KEYS = {"base", "size"}
_CACHES_KEYS = {"carry"}
_TRUST_KEYS = {"archive_digest", "caches_digest"}
_LOAD_KEYS = {"check_structure"}


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r} (known: {', '.join(sorted(allowed))})")


def _table(data: dict, name: str, allowed: set[str], where: str) -> dict:
    """The ``[name]`` table (empty when absent), its keys checked."""
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{name}] must be a table")
    _check_keys(table, allowed, f"{where} [{name}]")
    return table


def _flag(table: dict, name: str, key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{name + '.' if name else ''}{key}: expected true or false, got {value!r}")
    return value


def config_from_dict(data: dict, source: Path | None = None, base_dir: Path | None = None) -> FoundryConfig:
    """Validate a parsed TOML table; relative ``archive_dir`` is taken relative to ``base_dir``."""
    where = str(source) if source else "foundry config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table")
    _check_keys(data, _TOP_KEYS, where)
    mode = data.get("mode", "auto")
    if mode not in MODES:
        raise ConfigError(f"{where}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if "archive_dir" not in data:
        raise ConfigError(f"{where}: archive_dir is required")
    archive_dir = data["archive_dir"]
    if not isinstance(archive_dir, str) or not archive_dir:
        raise ConfigError(f"{where}: archive_dir must be a non-empty path string")
    path = Path(os.path.expanduser(archive_dir))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    region = _table(data, "region", _REGION_KEYS, where)
    base = _parse_address(region.get("base", DEFAULT_REGION_BASE), "region.base")
    size = parse_size(region.get("size", DEFAULT_REGION_SIZE), "region.size")
    if size % _GRANULE:
        raise ConfigError(f"region.size: {size} must be a multiple of 2 MiB")
    if size > RANK_STRIDE:
        raise ConfigError(f"region.size: {size} exceeds the per-rank stride of {RANK_STRIDE} bytes")
    if base + size > 1 << 47:
        raise ConfigError(
            f"region: base {base:#x} + size {size:#x} ends past the 47-bit user address space; lower region.base"
        )
    carry = _flag(_table(data, "caches", _CACHES_KEYS, where), "caches", "carry", True)
    trust = _table(data, "trust", _TRUST_KEYS, where)
    pins = _parse_pins(trust.get("archive_digest", ""))
    cache_pins = _parse_pins(trust.get("caches_digest", ""), "trust.caches_digest")
    check_structure = _flag(_table(data, "load", _LOAD_KEYS, where), "load", "check_structure", False)
    return FoundryConfig(
        strict=_flag(data, "", "strict", False),
        allow_untested_release=_flag(data, "", "allow_untested_release", False),
        mode=mode,
        archive_dir=path,
        region_base=base,
        region_size=size,
        archive_digest=dict(pins).get(0),
        archive_digests=pins,
        carry_caches=carry,
        caches_digests=cache_pins,
        check_structure=check_structure,
        source=source,
    )


def _check_digest(value: Any, key: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ConfigError(f"{key}: expected 64 lowercase hex characters (sha256)")
    return value


def _parse_pins(value: Any, key: str = "trust.archive_digest") -> tuple[tuple[int, str], ...]:
    """A digest pin: "" (not pinned), one digest (rank 0), or a table rank -> digest."""
    if value == "":
        return ()  # empty means "not pinned"; other falsy values (false, 0) are errors, not "unset"
    if isinstance(value, dict):
        pins = {}
        for rank, digest in value.items():
            if not str(rank).isdigit():
                raise ConfigError(f"{key}: table keys are ranks (0, 1, ...), got {rank!r}")
            pins[int(rank)] = _check_digest(digest, f"{key}.{rank}")
        if not pins:
            raise ConfigError(f'{key}: an empty table pins nothing; use "" or omit it')
        return tuple(sorted(pins.items()))
    return ((0, _check_digest(value, key)),)


def load_config(path: str | os.PathLike) -> FoundryConfig:
    """Read and validate a Foundry TOML file; raises :class:`ConfigError` with a one-line reason."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"foundry config {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"foundry config {path} cannot be read: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"foundry config {path} is not valid TOML: {e}") from None
    return config_from_dict(data, source=path.resolve(), base_dir=path.resolve().parent)


def config_from_env(environ: dict[str, str] | None = None) -> FoundryConfig | None:
    """The inverse of :meth:`FoundryConfig.to_env`; ``None`` when Foundry is not enabled."""
    env = os.environ if environ is None else environ
    if "FOUNDRY_CONFIG" in env:
        return load_config(env["FOUNDRY_CONFIG"])
    if "FOUNDRY_MODE" not in env:
        return None
    data: dict[str, Any] = {
        "mode": env["FOUNDRY_MODE"],
        "archive_dir": env.get("FOUNDRY_ARCHIVE_DIR", ""),
        "region": {
            "base": env.get("FOUNDRY_REGION_BASE", hex(DEFAULT_REGION_BASE)),
            # parse_size reads both "137438953472" and "128GiB" and reports bad text as a ConfigError
            "size": env.get("FOUNDRY_REGION_SIZE", str(DEFAULT_REGION_SIZE)),
        },
    }
    if env.get("FOUNDRY_ARCHIVE_DIGEST"):
        pinned = env["FOUNDRY_ARCHIVE_DIGEST"]
        if pinned.startswith("{"):
            try:
                pinned = json.loads(pinned)
            except ValueError:
                raise ConfigError(
                    "FOUNDRY_ARCHIVE_DIGEST: not a digest nor a JSON table of rank -> digest"
                ) from None
        data["trust"] = {"archive_digest": pinned}
    for key, name in (
        ("FOUNDRY_STRICT", "strict"),
        ("FOUNDRY_ALLOW_UNTESTED_RELEASE", "allow_untested_release"),
    ):
        if key in env:
            data[name] = env[key] == "1"
    return config_from_dict(data, source=None)
