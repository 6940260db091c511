"""The sample archive the tests/test_archive_*.py modules share: its contents, a fingerprint, a
SAVE of it, and the manifest tools they edit it with (the ``arch`` fixture is in conftest.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from foundry_core.archive import ArchiveWriter
from foundry_core.fingerprint import make_fingerprint

REPO = Path(__file__).resolve().parents[1]
CUBIN = bytes(range(256)) * 3 + b"\x7fELF tail"
LAYOUT = {"region_base": 0x600000000000, "cursor": 123456, "pools": [1, 2, 3]}
GRAPH = b"\x00graph-bytes\xff" * 10


def fp(**over):
    fields = dict(
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        driver_version="13.0",
        cuda_version="13.0",
        torch_version="2.13.0",
        model={"name": "Qwen3-1.7B", "capture_sizes": [1, 2, 4, 8], "dtype": "bfloat16"},
    )
    fields.update(over)
    return make_fingerprint(**fields)


def save(path, files=None, meta=None, fingerprint=None, **kw) -> str:
    if files is None:
        files = {"modules/abc.cubin": CUBIN, "graphs/0003.bin": GRAPH, "layout.json": LAYOUT}
    with ArchiveWriter(path, **kw) as w:
        for rel, data in files.items():
            if isinstance(data, (bytes, bytearray)):
                w.add_bytes(rel, data)
            else:
                w.add_json(rel, data)
        return w.commit(fingerprint=fingerprint or fp(), meta={"graphs": 1} if meta is None else meta)


def real(path) -> Path:
    return Path(os.path.realpath(path))


def manifest_of(path) -> dict:
    return json.loads((real(path) / "manifest.json").read_bytes())


def write_manifest(path, manifest) -> None:
    (real(path) / "manifest.json").write_text(json.dumps(manifest))


def canonical(manifest: dict) -> bytes:
    """A manifest laid out as the writer does (docs/archive-format.md, section 2)."""
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode() + b"\n"


def seal(manifest: dict) -> dict:
    """Recompute manifest_sha256, independently of the archive module, as a consistent writer would."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return {**body, "manifest_sha256": hashlib.sha256(canonical(body)).hexdigest()}


def entries(parent: Path) -> set[str]:
    return set(os.listdir(parent))
