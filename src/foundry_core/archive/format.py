"""What an archive is on disk: the format constants, member names, strict JSON and the manifest schema.

Everything here is pure (no file system, no threads): the rules that the writer follows and the
reader enforces, kept in one place so that the two cannot drift apart (:mod:`foundry_core.fingerprint`
builds and compares fingerprints with the same :func:`canonical_json_value`). The manifest is
written by :func:`_manifest_bytes` (canonical JSON) and carries its own checksum
(:func:`_self_checksum`); :func:`_check_manifest` is the strict schema check a LOAD runs before
trusting any field of it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
from typing import Any

from .errors import MISSING, ArchiveError, _one_line

FORMAT = "foundry-archive"
#: The format this Foundry writes and the newest it reads. 2: a member may be stored compressed
#: (its manifest entry then has an ``encoding``); version-1 archives have no compressed members.
FORMAT_VERSION = 2
#: The oldest format this Foundry still reads.
MIN_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_MANIFEST_KEYS = (
    "created_utc",
    "files",
    "fingerprint",
    "format",
    "format_version",
    "foundry_version",
    "manifest_sha256",
    "meta",
)
_ENTRY_KEYS = ("sha256", "size")
_ENCODED_ENTRY_KEYS = ("encoding", "sha256", "size")
# What a compressed member's ``encoding`` may declare (the chunking itself is in codec.py).
ENCODING_KIND = "zlib-chunks"
_MIN_CHUNK, _MAX_CHUNK = 1 << 12, 1 << 26
_MAX_RAW_SIZE = 1 << 40
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_RELPATH_BYTES = 1024
_MAX_COMPONENT_BYTES = 255


def check_relpath(relpath: Any) -> str:
    """Validate an archive member name; return it unchanged or raise :class:`ArchiveError`.

    A member name is a relative POSIX path in normal form: components separated by single ``/``,
    none empty, ``.`` or ``..``, no backslash, NUL or control character, valid UTF-8, at most
    1024 bytes (255 per component), and not ``manifest.json`` itself.
    """
    if not isinstance(relpath, str):
        raise ArchiveError(f"archive member name must be a string, got {type(relpath).__name__}")
    shown = _one_line(repr(relpath), 120)
    try:
        encoded = relpath.encode("utf-8")
    except UnicodeEncodeError:
        raise ArchiveError(f"archive member name {shown} is not valid UTF-8") from None
    if not relpath:
        raise ArchiveError("archive member name is empty")
    if len(encoded) > _MAX_RELPATH_BYTES:
        raise ArchiveError(f"archive member name {shown} is longer than {_MAX_RELPATH_BYTES} bytes")
    if relpath.startswith("/"):
        raise ArchiveError(f"archive member name {shown} is absolute; only relative paths are allowed")
    if any(ord(c) < 0x20 or c in "\x7f\\" for c in relpath):
        raise ArchiveError(f"archive member name {shown} contains a backslash or control character")
    for part in relpath.split("/"):
        if part in ("", ".", ".."):
            raise ArchiveError(
                f"archive member name {shown} is not a normalized relative path (no '', '.', '..')"
            )
        if len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES:
            raise ArchiveError(
                f"archive member name {shown} has a component longer than {_MAX_COMPONENT_BYTES} bytes"
            )
    if relpath == MANIFEST_NAME:
        raise ArchiveError(f"archive member name {MANIFEST_NAME!r} is reserved for the manifest")
    return relpath


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


def _json_data(value: Any, where: str) -> Any:
    try:
        return canonical_json_value(value, where)
    except ValueError as e:
        raise ArchiveError(_one_line(str(e))) from None
    except RecursionError:
        raise ArchiveError(f"{where}: nested too deeply to store") from None


def _dumps(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(data: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; ValueError/RecursionError on failure."""
    return json.loads(
        data.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
    )


def _entry(size: int, sha: str, encoding: dict | None) -> dict:
    entry: dict[str, Any] = {"size": size, "sha256": sha}
    if encoding is not None:
        entry["encoding"] = encoding
    return entry


def _manifest_bytes(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode() + b"\n"


def _self_checksum(manifest: dict) -> str:
    """sha256 of the manifest as written, minus its ``manifest_sha256`` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(_manifest_bytes(body)).hexdigest()


def _self_checksum_matches(raw: bytes, manifest: dict) -> bool:
    """Whether ``manifest_sha256`` matches the rest of the manifest.

    Fast path: a manifest as SAVE wrote it is the canonical text of the checksummed body with the
    ``manifest_sha256`` line added, so hashing the file with that one line cut out is enough. Any
    other layout of the same JSON (reformatted by a tool) is checked the slow way, by writing the
    body out canonically (json's pure-Python indenting encoder: tens of ms on a large manifest).
    """
    stored = manifest["manifest_sha256"]
    line = b'\n "manifest_sha256": "' + stored.encode("ascii", "replace") + b'",'
    at = raw.find(line)
    if at >= 0 and hashlib.sha256(raw[:at] + raw[at + len(line) :]).hexdigest() == stored:
        return True
    return stored == _self_checksum(manifest)


def _check_manifest(m: Any, where: str) -> dict:
    """Strict schema check of a parsed manifest; version checks come first so a newer format is
    reported as such rather than as a schema error."""
    if not isinstance(m, dict):
        raise ArchiveError(f"{where}: manifest.json must hold a JSON object, got {type(m).__name__}")
    fmt = m.get("format", MISSING)
    if fmt is MISSING:
        raise ArchiveError(f"{where}: manifest.json has no 'format' field; this is not a Foundry archive")
    if not isinstance(fmt, str) or fmt != FORMAT:
        raise ArchiveError(
            f"{where}: manifest.json field 'format' is {_one_line(repr(fmt), 80)}, expected {FORMAT!r}; "
            "this is not a Foundry archive"
        )
    ver = m.get("format_version", MISSING)
    if ver is MISSING:
        raise ArchiveError(f"{where}: manifest.json has no 'format_version' field")
    if isinstance(ver, bool) or not isinstance(ver, int):
        raise ArchiveError(
            f"{where}: manifest.json field 'format_version' must be an integer, got {_one_line(repr(ver), 80)}"
        )
    if ver > FORMAT_VERSION:
        raise ArchiveError(
            f"{where}: archive format version {ver} is newer than this Foundry reads ({FORMAT_VERSION}): "
            "upgrade Foundry or SAVE again"
        )
    if ver < MIN_FORMAT_VERSION:
        raise ArchiveError(
            f"{where}: archive format version {ver} is older than this Foundry reads "
            f"({MIN_FORMAT_VERSION}..{FORMAT_VERSION}): SAVE again"
        )
    for key in _MANIFEST_KEYS:
        if key not in m:
            raise ArchiveError(f"{where}: manifest.json has no {key!r} field")
    extra = sorted(set(m) - set(_MANIFEST_KEYS))
    if extra:
        raise ArchiveError(f"{where}: manifest.json has unknown field {_one_line(repr(extra[0]), 80)}")
    ms = m["manifest_sha256"]
    if not isinstance(ms, str) or not _HEX64.fullmatch(ms):
        raise ArchiveError(
            f"{where}: manifest.json field 'manifest_sha256' must be 64 lowercase hex characters"
        )
    fv = m["foundry_version"]
    if not isinstance(fv, str) or not fv:
        raise ArchiveError(f"{where}: manifest.json field 'foundry_version' must be a non-empty string")
    cu = m["created_utc"]
    if not isinstance(cu, str):
        raise ArchiveError(f"{where}: manifest.json field 'created_utc' must be an ISO-8601 string")
    try:
        when = _dt.datetime.fromisoformat(cu)
    except ValueError:
        raise ArchiveError(
            f"{where}: manifest.json field 'created_utc' is not an ISO-8601 time: {_one_line(repr(cu), 60)}"
        ) from None
    if when.utcoffset() != _dt.timedelta(0):
        raise ArchiveError(f"{where}: manifest.json field 'created_utc' must be in UTC (+00:00)")
    for key in ("fingerprint", "meta"):
        if not isinstance(m[key], dict):
            raise ArchiveError(
                f"{where}: manifest.json field {key!r} must be an object, got {type(m[key]).__name__}"
            )
    files = m["files"]
    if not isinstance(files, dict):
        raise ArchiveError(
            f"{where}: manifest.json field 'files' must be an object, got {type(files).__name__}"
        )
    for rel, entry in files.items():
        try:
            check_relpath(rel)
        except ArchiveError as e:
            raise ArchiveError(f"{where}: manifest.json lists a bad file: {e}") from None
        shown = _one_line(repr(rel), 120)
        allowed = [list(_ENTRY_KEYS)] + ([list(_ENCODED_ENTRY_KEYS)] if ver >= 2 else [])
        if not isinstance(entry, dict) or sorted(entry) not in allowed:
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} must be an object with exactly 'size' and 'sha256'"
                + (" (and optionally 'encoding')" if ver >= 2 else "")
            )
        size, sha = entry["size"], entry["sha256"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} has a bad size {_one_line(repr(size), 40)}"
            )
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise ArchiveError(
                f"{where}: manifest.json entry for {shown} has a bad sha256 (need 64 lowercase hex)"
            )
        if "encoding" in entry:
            _check_encoding(entry["encoding"], size, f"{where}: manifest.json entry for {shown}")
    # A name that is both a file and a directory prefix of another file cannot exist on disk.
    names = set(files)
    for rel in files:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                raise ArchiveError(
                    f"{where}: manifest.json lists {'/'.join(parts[:i])!r} both as a file and a directory"
                )
    return m


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_encoding(enc: Any, size: int, what: str) -> None:
    """A compressed member's ``encoding``: the chunk layout must add up exactly."""
    if not isinstance(enc, dict) or sorted(enc) != ["chunk_size", "chunks", "kind", "raw_size"]:
        raise ArchiveError(f"{what} has a bad 'encoding' (need kind, raw_size, chunk_size, chunks)")
    if enc["kind"] != ENCODING_KIND:
        raise ArchiveError(
            f"{what} uses encoding {_one_line(repr(enc['kind']), 40)}, this Foundry reads {ENCODING_KIND!r}"
        )
    raw, chunk, chunks = enc["raw_size"], enc["chunk_size"], enc["chunks"]
    if not _is_count(raw) or raw > _MAX_RAW_SIZE:
        raise ArchiveError(f"{what} has a bad encoding raw_size {_one_line(repr(raw), 40)}")
    if not _is_count(chunk) or not _MIN_CHUNK <= chunk <= _MAX_CHUNK:
        raise ArchiveError(f"{what} has a bad encoding chunk_size {_one_line(repr(chunk), 40)}")
    if (
        not isinstance(chunks, list)
        or len(chunks) != -(-raw // chunk)
        or not all(_is_count(c) and c > 0 for c in chunks)
        or sum(chunks) != size
    ):
        raise ArchiveError(f"{what} has an encoding whose chunks do not add up to its size and raw_size")
