"""The archive the tamper matrix (tests/test_tamper_matrix.py) tampers with, and how it tampers.

``build`` SAVEs a Foundry-shaped archive on the CPU (a code image, a compressed one, a graph
description, a memory snapshot, meta of kind ``foundry-graphs`` and a realistic engine
fingerprint) under a trusted directory, and returns a ``Ctx``: the archive and what this process
expects of it. ``Ctx.load`` runs ``foundry_core.load`` up to its first GPU step, where a stand-in
region raises ``ReachedGPU``. The mutations below change the files, the manifest (consistently or
not), this machine's description or the trust settings.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from foundry_core import __version__, api
from foundry_core.archive import (
    ArchiveWriter,
    open_archive,
)
from foundry_core.fingerprint import make_fingerprint

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ the archive

_rng = random.Random(4)
CUBIN = b"\x7fELF\x02\x01\x01\x33" + _rng.randbytes(4088)  # 4 KiB "code image"
CUBIN_SHA = hashlib.sha256(CUBIN).hexdigest()
CUBIN_REL = f"modules/{CUBIN_SHA}.cubin"
GRAPH_REL = "graphs/0000.json"
MEMORY_REL = "memory/00004.bin"
MEMORY = _rng.randbytes(64 << 10)  # one 64 KiB snapshot chunk of region segment 4
EVIL_CUBIN = b"\x7fELF attacker code" * 64
# A second code image that compresses (as real ones do, ~5-7x): stored as a format-2 compressed
# member of two zlib chunks.
PACKED = b"\x7fELF\x02\x01\x01\x33" + (bytes(range(256)) * 4 + _rng.randbytes(64)) * 1400
PACKED_SHA = hashlib.sha256(PACKED).hexdigest()
PACKED_REL = f"modules/{PACKED_SHA}.cubin"
BASE = 0x600000000000
KERNEL = "_ZN4vllm15rms_norm_kernelIN3c108BFloat16EEEvPT_PKS3_S6_fii"
GRAPH = {
    "nodes": [
        {
            "type": "kernel",
            "image": CUBIN_SHA,
            "name": KERNEL,
            "grid": [8, 1, 1],
            "block": [256, 1, 1],
            "smem": 0,
            "layout": [[0, 8], [8, 8], [16, 8], [24, 4], [28, 4]],
            "params": base64.b64encode(
                (BASE + (2 << 20)).to_bytes(8, "little")
                + BASE.to_bytes(8, "little")
                + (BASE + (6 << 20)).to_bytes(8, "little")
                + (2048).to_bytes(4, "little")
                + (0x3727C5AC).to_bytes(4, "little")
            ).decode(),
            "attrs": {},
        },
        {"type": "memset", "dst": BASE + (8 << 20), "pitch": 0, "value": 0, "element_size": 4,
         "width": 1024, "height": 1},
    ],
    "edges": [[1, 0, 0, 0, 0]],
    "events": 0,
    "rng": None,
}  # fmt: skip
META = {
    "kind": "foundry-graphs",
    "device": 0,
    "layout": {
        "base": BASE,
        "size": 128 << 30,
        "device": 0,
        "cursor": 10 << 20,
        "setup_segments": 3,
        "segments": [
            [BASE, 2 << 20, 1, "weights", "eager"],
            [BASE + (2 << 20), 2 << 20, 1, "kv_cache", "eager"],
            [BASE + (4 << 20), 2 << 20, 1, "static_inputs", "eager"],
            [BASE + (6 << 20), 2 << 20, 1, "capture", "graph"],
            [BASE + (8 << 20), 2 << 20, 1, "workspace", "eager"],
        ],
    },
    "graphs": [{"name": "decode_bs8", "file": GRAPH_REL, "nodes": 2, "rng": False}],
    "kernels": [[CUBIN_SHA, KERNEL, {"max_dynamic_shared_size_bytes": 0}]],
    "images": [CUBIN_SHA, PACKED_SHA],
    "tensors": {
        "decode_bs8.out": {
            "addr": BASE + (6 << 20),
            "shape": [8, 2048],
            "stride": [2048, 1],
            "dtype": "bfloat16",
        }
    },
    "snapshots": [[4, [0]]],
    "slots": {"num_gpu_blocks": 4096, "kv_cache_memory_bytes": 2 << 20},
    "saved_with": __version__,
}
MACHINE = dict(
    gpu_name="NVIDIA H200",
    compute_capability="9.0",
    sm_count=132,
    driver_version="13.0",
    cuda_version="13.0",
    torch_version="2.11.0+cu130",
    foundry_version=__version__,
)
MODEL = {
    "name": "Qwen/Qwen3-1.7B",
    "revision": "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
    "engine": "vllm",
    "engine_version": "0.11.0",
    "dtype": "bfloat16",
    "weight_shapes": {
        "model.embed_tokens.weight": [151936, 2048],
        "model.layers.0.mlp.gate_up_proj.weight": [6144, 2048],
        "model.layers.0.self_attn.qkv_proj.weight": [2560, 2048],
    },
    "weight_dtypes": {
        "model.embed_tokens.weight": "bfloat16",
        "model.layers.0.mlp.gate_up_proj.weight": "bfloat16",
    },
    "capture_sizes": [1, 2, 4, 8, 16, 24, 32],
    "settings": {
        "max_num_seqs": 256,
        "block_size": 16,
        "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9,
    },
    "tp": 2,
    "dp": 1,
}
RANK, WORLD_SIZE = 0, 2  # rank 0 of a tensor-parallel pair


def _copy(value):
    return json.loads(json.dumps(value))


def write_archive(path: Path, *, model=None, rank=RANK, world_size=WORLD_SIZE, cubin=CUBIN) -> str:
    """SAVE the way foundry_core.save lays an archive out, without a GPU."""
    fp = make_fingerprint(
        **MACHINE, model=MODEL if model is None else model, rank=rank, world_size=world_size
    )
    with ArchiveWriter(path) as w:
        w.add_bytes(f"modules/{hashlib.sha256(cubin).hexdigest()}.cubin", cubin)
        w.add_bytes(PACKED_REL, PACKED, compress=True)
        w.add_bytes(MEMORY_REL, MEMORY, compress=True)  # random: stays uncompressed
        w.add_json(GRAPH_REL, GRAPH)
        return w.commit(fingerprint=fp, meta=META)


class ReachedGPU(Exception):
    """foundry_core.load got past every check and asked the region to map device memory."""


class StandInRegion:
    device = 0

    def restore_layout(self, layout):
        raise ReachedGPU


@dataclasses.dataclass
class Ctx:
    """One archive under a trusted directory, and what this process would expect of it."""

    root: Path  # the configured archive_dir: the only place LOAD may read from
    path: Path  # root / "rank0", a symlink to the versioned directory
    digest: str
    machine: dict
    model: dict
    rank: int = RANK
    world_size: int = WORLD_SIZE
    pin: str | None = None

    @property
    def real(self) -> Path:
        return Path(os.path.realpath(self.path))

    def expected(self) -> dict:
        return make_fingerprint(**self.machine, model=self.model, rank=self.rank, world_size=self.world_size)

    def open(self):
        return open_archive(self.path, expected_fingerprint=self.expected(), expected_digest=self.pin)

    def load(self, archive=None):
        """foundry_core.load, up to its first GPU step; this machine is described by ``self.machine``.
        ``archive``: what verify() returned, as the plugins pass it."""

        def this_machine(device=0, *, model=None, rank=0, world_size=1):
            return make_fingerprint(**self.machine, model=model, rank=rank, world_size=world_size)

        # torch is not needed before the first GPU step; leaving it out keeps the matrix fast
        with mock.patch.object(api, "current_fingerprint", this_machine), mock.patch.object(api, "_torch"):
            return api.load(
                self.path,
                region=StandInRegion(),
                fingerprint_model=self.model,
                rank=self.rank,
                world_size=self.world_size,
                expected_digest=self.pin,
                trusted_root=self.root,
                progress=False,
                archive=archive,
            )


def build(tmp_path: Path) -> Ctx:
    root = tmp_path / "archive_dir"
    path = root / "rank0"
    digest = write_archive(path)
    return Ctx(root=root, path=path, digest=digest, machine=dict(MACHINE), model=_copy(MODEL))


def assert_goes_through(ctx: Ctx) -> None:
    """The control: the archive as it is verifies, and LOAD reaches the GPU without a warning."""
    ar = ctx.open()
    assert ar.read_bytes(CUBIN_REL) == CUBIN and ar.read_bytes(MEMORY_REL) == MEMORY
    assert ar.read_bytes(PACKED_REL) == PACKED
    assert ar.read_json(GRAPH_REL) == GRAPH and ar.meta == META
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ReachedGPU):
            ctx.load()


# ------------------------------------------------------------------------------------------------ mutations


def flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def manifest_bytes(m: dict) -> bytes:
    """The manifest as a writer lays it out (docs/archive-format.md, section 2)."""
    return json.dumps(m, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False).encode() + b"\n"


def edit_manifest(ctx: Ctx, change: Callable[[dict], None]) -> None:
    """Change the manifest the way a consistent writer (a newer Foundry, say) would: with a matching
    ``manifest_sha256``, computed here independently of the archive module."""
    m = json.loads((ctx.real / "manifest.json").read_bytes())
    change(m)
    m.pop("manifest_sha256")
    m["manifest_sha256"] = hashlib.sha256(manifest_bytes(m)).hexdigest()
    (ctx.real / "manifest.json").write_bytes(manifest_bytes(m))


def flip_in_manifest(ctx: Ctx, needle: bytes, skip: int = 0) -> None:
    """Flip the lowest bit of the byte ``skip`` bytes into the first occurrence of ``needle``."""
    raw = (ctx.real / "manifest.json").read_bytes()
    at = raw.index(needle)
    flip(ctx.real / "manifest.json", at + skip)


def forge_outside(ctx: Ctx) -> Path:
    """An attacker's archive, consistent in every checksum, outside the configured directory."""
    evil = ctx.root.parent / "elsewhere" / "rank0"
    write_archive(evil, cubin=EVIL_CUBIN)
    return evil


def swap_symlink_outside(ctx: Ctx, evil: Path | None = None) -> None:
    evil = forge_outside(ctx) if evil is None else evil
    tmp = ctx.root / ".swap"
    os.symlink(os.path.realpath(evil), tmp)
    os.replace(tmp, ctx.path)


def set_machine(**changes) -> Callable[[Ctx], None]:
    def mutate(ctx: Ctx) -> None:
        ctx.machine.update(changes)

    return mutate


def set_model(path: str, value) -> Callable[[Ctx], None]:
    def mutate(ctx: Ctx) -> None:
        keys = path.split("/")
        d = ctx.model
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return mutate


def set_layout(rank: int, world_size: int, **model) -> Callable[[Ctx], None]:
    def mutate(ctx: Ctx) -> None:
        ctx.rank, ctx.world_size = rank, world_size
        ctx.model.update(model)

    return mutate


def resave_with_pin(ctx: Ctx) -> None:
    """The operator pinned the digest; then someone SAVEd again (same content, new created_utc)."""
    ctx.pin = ctx.digest
    assert write_archive(ctx.path) != ctx.digest
