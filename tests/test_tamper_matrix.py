"""The tamper matrix of issue 4: nothing wrong ever loads, and every refusal says why in one line.

A Foundry-shaped archive (a code image, a graph description, a memory snapshot, meta of kind
``foundry-graphs`` and a realistic engine fingerprint) is built on the CPU for every row
(tests/tamper_archive.py builds it and holds the changes the rows make to it). Each row
first proves the untouched archive goes through (``open_archive`` returns it, and ``foundry_core.load``
gets past every check to its first GPU step), then applies one change (to the files, to what this
machine or engine reports, or to the trust settings) and asserts the refusal: the exception type and
the words a user needs (the file or field and both values).

``foundry_core.load`` runs for real up to its first GPU step: a stand-in region raises
``ReachedGPU`` from ``restore_layout`` (mapping device memory, before any module is loaded or graph
rebuilt, long before a kernel runs), and this machine's fingerprint is a stub. A refusal that
surfaces as ``ArchiveError`` rather than ``ReachedGPU`` was therefore made before touching the GPU.

``MATRIX`` at the end lists (case, outcome); docs/reliability.md mirrors it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from unittest import mock

import pytest

from foundry_core import __version__
from foundry_core import archive as archive_mod
from foundry_core.archive import (
    ArchiveError,
    FingerprintMismatch,
    open_archive,
)
from foundry_core.trust import ArchiveLocationError, WritableArchiveWarning, world_writable
from tamper_archive import (
    CUBIN,
    CUBIN_REL,
    CUBIN_SHA,
    EVIL_CUBIN,
    GRAPH_REL,
    MEMORY,
    MEMORY_REL,
    META,
    MODEL,
    PACKED,
    PACKED_REL,
    REPO,
    Ctx,
    ReachedGPU,
    assert_goes_through,
    build,
    edit_manifest,
    flip,
    flip_in_manifest,
    forge_outside,
    resave_with_pin,
    set_layout,
    set_machine,
    set_model,
    swap_symlink_outside,
    truncate,
    write_archive,
)

# ------------------------------------------------------------------------------------------------ the rows


@dataclasses.dataclass
class Row:
    case: str
    mutate: Callable[[Ctx], None]
    exc: type
    words: Callable[[Ctx], list[str]]  # what the one-line message must contain
    outcome: str
    early: bool = False  # refused before a single member file is opened
    location_only: bool = False  # open_archive alone does not check the location; only LOAD does
    load_warns: Callable[[Ctx], str] | None = None  # the one WritableArchiveWarning LOAD gives first


def _fp(field, saved, current):
    return lambda ctx: [
        f"archive was saved for {field}={saved!r}, this machine has {current!r}",
        "SAVE again",
    ]


def _file(rel, what, remedy="SAVE again"):
    return lambda ctx: [str(ctx.path), f"file {rel!r}", what, remedy]


def _damaged(ctx: Ctx) -> list[str]:
    return [
        f"archive {ctx.path}: manifest.json is damaged: its content does not match its own checksum "
        "(manifest_sha256); SAVE again"
    ]


def _fields(ctx: Ctx) -> dict:
    return json.loads((ctx.path / "manifest.json").read_bytes())["files"]


def _edit_encoding(ctx: Ctx, **changes) -> None:
    edit_manifest(ctx, lambda m: m["files"][PACKED_REL]["encoding"].update(changes))


def _claim_4_gib(ctx: Ctx) -> None:
    """Keep the stored bytes and their checksum, but claim 4 GiB of content in 64 chunks of 64 MiB,
    all but one of them a single stored byte: refused before anything that size is allocated."""
    size = _fields(ctx)[PACKED_REL]["size"]
    _edit_encoding(ctx, chunk_size=1 << 26, raw_size=1 << 32, chunks=[size - 63] + [1] * 63)


def _damage_packed_consistently(ctx: Ctx) -> None:
    """Flip a byte inside the compressed stream and give the manifest the new sha256: the checksums
    agree, the content does not inflate."""
    stored = ctx.real / PACKED_REL
    flip(stored, 40)
    sha = hashlib.sha256(stored.read_bytes()).hexdigest()
    edit_manifest(ctx, lambda m: m["files"][PACKED_REL].update(sha256=sha))


OTHER_CUBIN_REL = f"modules/{'0' * 64}.cubin"
MLP = "model.layers.0.mlp.gate_up_proj.weight"
_first_digit = next(i for i, ch in enumerate(CUBIN_SHA) if ch in "0123456789")


def _ms_digit(ctx: Ctx) -> int:
    """Index of the first decimal digit of manifest_sha256 (a flipped digit stays a hex digit)."""
    ms = json.loads((ctx.real / "manifest.json").read_bytes())["manifest_sha256"]
    return next(i for i, ch in enumerate(ms) if ch in "0123456789")


REFUSED = "refused: ArchiveError"
REFUSED_FP = "refused: FingerprintMismatch"

ROWS = [
    # -- files: truncated, one flipped byte, missing, extra --------------------------------------------
    Row("truncated manifest.json", lambda c: truncate(c.real / "manifest.json"), ArchiveError,
        lambda c: ["manifest.json is not valid JSON (truncated or damaged?)", "SAVE again"], REFUSED),
    Row("truncated modules/<sha>.cubin", lambda c: truncate(c.real / CUBIN_REL), ArchiveError,
        _file(CUBIN_REL, f"is {len(CUBIN) // 2} bytes, the manifest lists {len(CUBIN)}"), REFUSED),
    Row("truncated graphs/0000.json", lambda c: truncate(c.real / GRAPH_REL), ArchiveError,
        lambda c: _file(GRAPH_REL, f"the manifest lists {_fields(c)[GRAPH_REL]['size']}")(c), REFUSED),
    Row("truncated memory/00004.bin", lambda c: truncate(c.real / MEMORY_REL), ArchiveError,
        _file(MEMORY_REL, f"is {len(MEMORY) // 2} bytes, the manifest lists {len(MEMORY)}"), REFUSED),
    Row("flipped byte in modules/<sha>.cubin", lambda c: flip(c.real / CUBIN_REL), ArchiveError,
        _file(CUBIN_REL, "fails its sha256 check"), REFUSED),
    Row("flipped byte in graphs/0000.json", lambda c: flip(c.real / GRAPH_REL), ArchiveError,
        _file(GRAPH_REL, "fails its sha256 check"), REFUSED),
    Row("flipped byte in memory/00004.bin", lambda c: flip(c.real / MEMORY_REL), ArchiveError,
        _file(MEMORY_REL, "fails its sha256 check"), REFUSED),
    Row("flipped byte in manifest.json: a member's sha256",
        lambda c: flip_in_manifest(c, f'"sha256": "{CUBIN_SHA}"'.encode(), len('"sha256": "') + _first_digit),
        ArchiveError, _damaged, REFUSED, early=True),
    Row("flipped byte in manifest.json: a member's size",
        lambda c: flip_in_manifest(c, b'"size": 65536', skip=len('"size": 6553')), ArchiveError,
        _damaged, REFUSED, early=True),
    Row("flipped byte in manifest.json: a field name", lambda c: flip_in_manifest(c, b'"created_utc"', 1),
        ArchiveError, lambda c: ["manifest.json has no 'created_utc' field"], REFUSED, early=True),
    Row("flipped byte in manifest.json: the fingerprint", lambda c: flip_in_manifest(c, b"NVIDIA H200", 10),
        ArchiveError, _damaged, REFUSED, early=True),
    Row("flipped byte in manifest.json: meta, digest pinned",
        lambda c: (setattr(c, "pin", c.digest), flip_in_manifest(c, b"decode_bs8", 7)), ArchiveError,
        _damaged, REFUSED, early=True),
    Row("flipped byte in manifest.json: its own checksum (manifest_sha256)",
        lambda c: flip_in_manifest(c, b'"manifest_sha256": "', len('"manifest_sha256": "') + _ms_digit(c)),
        ArchiveError, _damaged, REFUSED, early=True),
    Row("missing manifest.json", lambda c: (c.real / "manifest.json").unlink(), ArchiveError,
        lambda c: ["manifest.json is missing (an interrupted SAVE?); SAVE again"], REFUSED),
    Row("missing modules/<sha>.cubin", lambda c: (c.real / CUBIN_REL).unlink(), ArchiveError,
        _file(CUBIN_REL, "listed in the manifest is missing"), REFUSED),
    Row("missing memory/00004.bin", lambda c: (c.real / MEMORY_REL).unlink(), ArchiveError,
        _file(MEMORY_REL, "listed in the manifest is missing"), REFUSED),
    Row("extra file modules/<other>.cubin", lambda c: (c.real / OTHER_CUBIN_REL).write_bytes(CUBIN),
        ArchiveError,
        _file(OTHER_CUBIN_REL, "is not listed in the manifest", "refusing extra content"), REFUSED),
    Row("extra file at the top (an engine sidecar)", lambda c: (c.real / "sglang.json").write_text("{}"),
        ArchiveError, lambda c: ["file 'sglang.json' is not listed in the manifest"], REFUSED),
    Row("member replaced by a symlink to the same bytes",
        lambda c: ((c.root / "copy.bin").write_bytes(MEMORY), (c.real / MEMORY_REL).unlink(),
                   (c.real / MEMORY_REL).symlink_to(c.root / "copy.bin")),
        ArchiveError, lambda c: [f"{MEMORY_REL!r} is a symlink; archives never contain symlinks"], REFUSED),
    # -- format versions --------------------------------------------------------------------------------
    Row("future archive format version", lambda c: edit_manifest(c, lambda m: m.update(format_version=3)),
        ArchiveError, lambda c: ["archive format version 3 is newer than this Foundry reads (2)",
                                 "upgrade Foundry or SAVE again"], REFUSED, early=True),
    Row("compressed member in a format-1 manifest",
        lambda c: edit_manifest(c, lambda m: m.update(format_version=1)), ArchiveError,
        lambda c: [f"manifest.json entry for {PACKED_REL!r}", "exactly 'size' and 'sha256'"], REFUSED, early=True),
    # -- compressed members (format 2) ------------------------------------------------------------------
    Row("flipped byte in a compressed member", lambda c: flip(c.real / PACKED_REL), ArchiveError,
        _file(PACKED_REL, "fails its sha256 check"), REFUSED),
    Row("compressed member damaged, its sha256 recomputed", _damage_packed_consistently, ArchiveError,
        _file(PACKED_REL, "does not decompress; it is damaged"), REFUSED),
    Row("compressed member claims a smaller raw_size", lambda c: _edit_encoding(c, raw_size=len(PACKED) - 1),
        ArchiveError, _file(PACKED_REL, "does not decompress; it is damaged"), REFUSED),
    Row("compressed member claims 4 GiB of content", _claim_4_gib, ArchiveError,
        _file(PACKED_REL, "does not decompress; it is damaged"), REFUSED),
    Row("compressed member's chunks do not add up", lambda c: _edit_encoding(c, chunks=[1, 2]), ArchiveError,
        lambda c: [f"entry for {PACKED_REL!r}", "chunks do not add up to its size and raw_size"], REFUSED,
        early=True),
    Row("compressed member with an unknown encoding", lambda c: _edit_encoding(c, kind="zstd-chunks"),
        ArchiveError, lambda c: [f"entry for {PACKED_REL!r}", "uses encoding 'zstd-chunks'"], REFUSED,
        early=True),
    Row("future fingerprint scheme",
        lambda c: edit_manifest(c, lambda m: m["fingerprint"].update(fingerprint_format=2)),
        FingerprintMismatch, _fp("fingerprint_format", 2, 1), REFUSED_FP, early=True),
    # -- machine ------------------------------------------------------------------------------------------
    Row("other GPU model", set_machine(gpu_name="NVIDIA H100 80GB HBM3"), FingerprintMismatch,
        _fp("gpu_name", "NVIDIA H200", "NVIDIA H100 80GB HBM3"), REFUSED_FP, early=True),
    Row("other compute capability", set_machine(compute_capability="10.0"), FingerprintMismatch,
        _fp("compute_capability", "9.0", "10.0"), REFUSED_FP, early=True),
    Row("other SM count (same name, e.g. a MIG slice or a cut-down part)", set_machine(sm_count=114),
        FingerprintMismatch, _fp("sm_count", 132, 114), REFUSED_FP, early=True),
    Row("other driver (CUDA driver API version)", set_machine(driver_version="12.8"), FingerprintMismatch,
        _fp("driver_version", "13.0", "12.8"), REFUSED_FP, early=True),
    Row("other CUDA runtime", set_machine(cuda_version="12.9"), FingerprintMismatch,
        _fp("cuda_version", "13.0", "12.9"), REFUSED_FP, early=True),
    Row("other torch", set_machine(torch_version="2.10.0+cu130"), FingerprintMismatch,
        _fp("torch_version", "2.11.0+cu130", "2.10.0+cu130"), REFUSED_FP, early=True),
    Row("other Foundry", set_machine(foundry_version="0.2.0"), FingerprintMismatch,
        _fp("foundry_version", __version__, "0.2.0"), REFUSED_FP, early=True),
    # -- engine and model (the caller's `model` dict) -------------------------------------------------------
    Row("other engine version", set_model("engine_version", "0.11.1"), FingerprintMismatch,
        _fp("model.engine_version", "0.11.0", "0.11.1"), REFUSED_FP, early=True),
    Row("other engine", set_model("engine", "sglang"), FingerprintMismatch,
        _fp("model.engine", "vllm", "sglang"), REFUSED_FP, early=True),
    Row("other model revision", set_model("revision", "main"), FingerprintMismatch,
        _fp("model.revision", MODEL["revision"], "main"), REFUSED_FP, early=True),
    Row("other weight shape", set_model(f"weight_shapes/{MLP}", [12288, 2048]), FingerprintMismatch,
        _fp(f"model.weight_shapes.{MLP}[0]", 6144, 12288), REFUSED_FP, early=True),
    Row("weight missing from the model", lambda c: c.model["weight_shapes"].pop("model.embed_tokens.weight"),
        FingerprintMismatch,
        lambda c: ["archive was saved for model.weight_shapes.model.embed_tokens.weight=[151936, 2048], this "
                   "machine has no model.weight_shapes.model.embed_tokens.weight"], REFUSED_FP, early=True),
    Row("other dtype", set_model("dtype", "float16"), FingerprintMismatch,
        _fp("model.dtype", "bfloat16", "float16"), REFUSED_FP, early=True),
    Row("other weight dtype", set_model("weight_dtypes/model.embed_tokens.weight", "float8_e4m3fn"),
        FingerprintMismatch,
        _fp("model.weight_dtypes.model.embed_tokens.weight", "bfloat16", "float8_e4m3fn"),
        REFUSED_FP, early=True),
    Row("other capture sizes", set_model("capture_sizes", [1, 2, 4, 8, 16, 32]), FingerprintMismatch,
        _fp("model.capture_sizes[5]", 24, 32), REFUSED_FP, early=True),
    Row("other engine setting", set_model("settings/max_num_seqs", 128), FingerprintMismatch,
        _fp("model.settings.max_num_seqs", 256, 128), REFUSED_FP, early=True),
    Row("other memory setting", set_model("settings/gpu_memory_utilization", 0.85), FingerprintMismatch,
        _fp("model.settings.gpu_memory_utilization", 0.9, 0.85), REFUSED_FP, early=True),
    # -- parallel layout ------------------------------------------------------------------------------------
    Row("archive of another rank", set_layout(1, 2), FingerprintMismatch, _fp("rank", 0, 1), REFUSED_FP,
        early=True),
    Row("other world size", set_layout(0, 4, tp=4), FingerprintMismatch, _fp("world_size", 2, 4), REFUSED_FP,
        early=True),
    Row("same world size, other TP/DP split", set_layout(0, 2, tp=1, dp=2), FingerprintMismatch,
        _fp("model.dp", 1, 2), REFUSED_FP, early=True),
    # -- trust ----------------------------------------------------------------------------------------------
    Row("digest pinned, archive re-SAVEd since", resave_with_pin, ArchiveError,
        lambda c: ["archive digest", f"does not match the pinned trust.archive_digest {c.digest}"], REFUSED,
        early=True),
    Row("symlink swapped to a consistent archive outside the trusted directory", swap_symlink_outside,
        ArchiveLocationError,
        lambda c: [f"archive {c.path} resolves to", f"outside the configured directory {c.root.resolve()}",
                   "refusing to load it"], "refused: ArchiveLocationError", location_only=True),
]  # fmt: skip


def attempt(row: Row, ctx: Ctx) -> str:
    """Apply ``row`` to a verified archive; return the message of the refusal (asserting its shape)."""
    assert_goes_through(ctx)
    row.mutate(ctx)
    messages = []
    entries = [ctx.load] if row.location_only else [ctx.open, ctx.load]
    for entry in entries:
        guard = (
            mock.patch.object(archive_mod, "_open_member", side_effect=AssertionError("a member was opened"))
            if row.early
            else contextlib.nullcontext()
        )
        expect_warning = row.load_warns is not None and entry == ctx.load
        with guard, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("error")
            if expect_warning:
                warnings.simplefilter("always", WritableArchiveWarning)
            with pytest.raises(row.exc) as info:
                entry()
        shown = [str(w.message) for w in caught]
        if expect_warning:
            assert len(shown) == 1 and shown[0].startswith(row.load_warns(ctx)), shown
        else:
            assert not shown, shown
        messages.append(str(info.value))
    msg = messages[-1]
    assert all(m == msg for m in messages), messages  # open_archive and load say the same thing
    assert msg and "\n" not in msg, msg
    for words in row.words(ctx):
        assert words in msg, (words, msg)
    if isinstance(info.value, FingerprintMismatch):
        assert info.value.field in msg
    return msg


@pytest.mark.parametrize("row", ROWS, ids=[r.case for r in ROWS])
def test_tamper_matrix(row: Row, tmp_path):
    attempt(row, build(tmp_path))


def test_world_writable_archive_loads_with_a_warning(tmp_path):
    ctx = build(tmp_path)
    assert_goes_through(ctx)
    os.chmod(ctx.real, 0o777)
    try:
        with pytest.warns(WritableArchiveWarning) as record, pytest.raises(ReachedGPU):
            ctx.load()
    finally:
        os.chmod(ctx.real, 0o755)
    (msg,) = [str(w.message) for w in record]
    assert f"{ctx.real} is writable by every user" in msg
    assert "chmod o-w, or pin trust.archive_digest" in msg


# -------------------------------------------------- meta without a pin, permissions inside, long lists


def test_flipped_meta_byte_without_a_pin_is_refused(tmp_path):
    """meta holds tensor addresses, snapshot chunks, kernel attributes: no member checksum covers it,
    the manifest's own checksum does."""
    ctx = build(tmp_path)
    assert_goes_through(ctx)
    # "decode_bs8" -> "decode_bs9": a tensor name; a digit of a tensor address is refused just the same.
    flip_in_manifest(ctx, b"decode_bs8", 9)
    assert ctx.pin is None
    guard = mock.patch.object(archive_mod, "_open_member", side_effect=AssertionError("a member was opened"))
    for entry in (ctx.open, ctx.load):
        with guard, pytest.raises(ArchiveError) as info:
            entry()
        assert str(info.value) == _damaged(ctx)[0]


def test_flipped_tensor_address_digit_without_a_pin_is_refused(tmp_path):
    ctx = build(tmp_path)
    assert_goes_through(ctx)
    addr = str(META["tensors"]["decode_bs8.out"]["addr"]).encode()
    flip_in_manifest(ctx, b'"addr": ' + addr, len('"addr": ') + len(addr) - 1)
    with pytest.raises(ArchiveError) as info:
        ctx.load()
    assert str(info.value) == _damaged(ctx)[0]


def test_world_writable_manifest_in_a_private_directory_warns(tmp_path):
    ctx = build(tmp_path)
    assert_goes_through(ctx)
    inside = [
        ctx.real / "manifest.json",
        *(ctx.real / d / f for d in ("modules", "graphs", "memory") for f in os.listdir(ctx.real / d)),
    ]
    for p in inside:
        os.chmod(p, 0o666)  # anyone may rewrite manifest and members in place: a consistent forgery
    assert sorted(world_writable(ctx.path, stop_at=ctx.root)) == sorted(inside)
    with pytest.warns(WritableArchiveWarning) as record, pytest.raises(ReachedGPU):
        ctx.load()
    (msg,) = [str(w.message) for w in record]
    assert f"Foundry archive {ctx.path}: {ctx.real / 'manifest.json'} is writable by every user" in msg
    assert "chmod o-w, or pin trust.archive_digest" in msg


def test_world_writable_member_directory_warns(tmp_path):
    ctx = build(tmp_path)
    os.chmod(ctx.real / "memory", 0o777)
    assert world_writable(ctx.path, stop_at=ctx.root) == [ctx.real / "memory"]
    with (
        pytest.warns(WritableArchiveWarning, match="memory is writable by every user"),
        pytest.raises(ReachedGPU),
    ):
        ctx.load()


def test_long_capture_size_lists_show_their_difference(tmp_path):
    sizes = [1, 2, 4] + list(range(8, 513, 8))  # vLLM's default: 67 sizes up to 512
    ctx = build(tmp_path)
    write_archive(ctx.path, model={**MODEL, "capture_sizes": sizes})
    ctx.model["capture_sizes"] = sizes[:-1]  # max_num_seqs 504: the last size is gone
    with pytest.raises(FingerprintMismatch) as info:
        ctx.open()
    e = info.value
    assert (e.field, e.saved, e.current) == ("model.capture_sizes[66:]", [512], [])
    assert str(e) == (
        "archive was saved for model.capture_sizes[66:]=[512], this machine has []; SAVE again on this setup"
    )
    ctx.model["capture_sizes"] = sizes[:40] + [300] + sizes[41:]  # one size changed in the middle
    with pytest.raises(FingerprintMismatch) as info:
        ctx.open()
    assert "archive was saved for model.capture_sizes[40]=304, this machine has 300;" in str(info.value)


# -------------------------------------------------------------------------------------- whole-manifest sweep


def _sweep_reason(msg: str) -> str:
    if "manifest.json is not valid JSON" in msg:
        return "JSON"
    if "does not match its own checksum (manifest_sha256)" in msg:
        return "self-checksum"
    if "field 'manifest_sha256' must be 64 lowercase hex characters" in msg:
        return "malformed manifest_sha256"
    if "manifest.json" in msg or "archive format version" in msg:
        return "schema"
    raise AssertionError(f"refused for a reason other than the manifest: {msg}")


def test_every_flipped_manifest_byte(tmp_path):
    """Flip bit 0 of each manifest byte in turn. Every flip is refused before a member is read, with a
    pinned digest and without one: what the JSON and the schema let through, the manifest's own checksum
    (manifest_sha256) refuses, whether the flip lands in meta, the fingerprint, a file entry or the
    checksum itself."""
    ctx = build(tmp_path)
    manifest = ctx.real / "manifest.json"
    original = manifest.read_bytes()
    expected = ctx.expected()
    guard = mock.patch.object(archive_mod, "_open_member", side_effect=AssertionError("member opened"))
    reasons: collections.Counter = collections.Counter()
    fd = os.open(manifest, os.O_WRONLY)
    try:
        for i in range(len(original)):
            os.pwrite(fd, bytes([original[i] ^ 0x01]), i)
            with guard, pytest.raises(ArchiveError):
                open_archive(ctx.path, expected_fingerprint=expected, expected_digest=ctx.digest)
            with guard, pytest.raises(ArchiveError) as info:
                open_archive(ctx.path, expected_fingerprint=expected)
            msg = str(info.value)
            assert "\n" not in msg and not isinstance(info.value, FingerprintMismatch), msg
            reasons[_sweep_reason(msg)] += 1
            os.pwrite(fd, original[i : i + 1], i)
    finally:
        os.close(fd)
    assert manifest.read_bytes() == original
    assert (
        open_archive(ctx.path, expected_fingerprint=expected, expected_digest=ctx.digest).digest == ctx.digest
    )
    # Every flip refused without a pin; the counts per reason are in docs/reliability.md.
    assert sum(reasons.values()) == len(original), reasons
    assert all(reasons[r] > 0 for r in ("JSON", "schema", "self-checksum", "malformed manifest_sha256")), (
        reasons
    )


# ------------------------------------------------------------------------------------------- trust details


def test_consistent_forgery_passes_checksums_but_not_location_or_pin(tmp_path):
    """Checksums are integrity, not authenticity: whoever can write an archive can make it consistent."""
    ctx = build(tmp_path)
    evil = forge_outside(ctx)
    forged = open_archive(evil, expected_fingerprint=ctx.expected())  # every checksum agrees
    assert forged.read_bytes(f"modules/{hashlib.sha256(EVIL_CUBIN).hexdigest()}.cubin") == EVIL_CUBIN
    swap_symlink_outside(ctx, evil)
    assert open_archive(ctx.path, expected_fingerprint=ctx.expected()).digest == forged.digest
    with pytest.raises(ArchiveError, match="does not match the pinned"):
        open_archive(ctx.path, expected_digest=ctx.digest)
    with pytest.raises(ArchiveLocationError):
        ctx.load()


def test_one_digest_pin_cannot_cover_two_ranks(tmp_path):
    """Each rank's manifest carries its rank, so the ranks of one launch have different digests."""
    d0 = write_archive(tmp_path / "rank0", rank=0)
    d1 = write_archive(tmp_path / "rank1", rank=1)
    assert d0 != d1
    with pytest.raises(ArchiveError, match="does not match the pinned"):
        open_archive(tmp_path / "rank1", expected_digest=d0)


# ------------------------------------------------------------------------------------------------ the matrix

MATRIX: list[tuple[str, str]] = [(r.case, r.outcome) for r in ROWS] + [
    ("world-writable archive directory", "loads, with WritableArchiveWarning"),
    ("flipped byte in manifest.json meta, no digest pinned", REFUSED),
    ("world-writable manifest.json and members in a private directory", "loads, with WritableArchiveWarning"),
    ("capture-size lists longer than 120 characters", REFUSED_FP),
]


def test_docs_mirror_the_matrix():
    doc = (REPO / "docs" / "reliability.md").read_text()
    missing = [case for case, _ in MATRIX if f"| {case} |" not in doc]
    assert not missing, f"docs/reliability.md lacks rows for {missing}"


# ------------------------------------------------------------------ NVSHMEM's heap, recorded at SAVE

HEAP = {"base": 0x700000000000, "size": 256 << 30}


def test_a_recorded_nvshmem_heap_needs_the_same_placement_before_the_gpu(tmp_path, monkeypatch):
    """An archive whose graphs were captured with NVSHMEM's heap placed (meta ``nvshmem_heap``) loads
    only where this process placed the heap at the same base and size; refused before the region maps
    anything otherwise, and a damaged record is refused as one."""
    from foundry_core import nvshmem

    ctx = build(tmp_path)
    edit_manifest(ctx, lambda m: m["meta"].update(nvshmem_heap=HEAP))
    monkeypatch.setattr(nvshmem, "_armed", None)
    with pytest.raises(nvshmem.HeapPlacementError) as info:
        ctx.load()
    assert "did not place it: call foundry_core.nvshmem.place_heap(0x700000000000)" in str(info.value)
    # Placed as at SAVE (the shim's record stood in for): LOAD goes on to the GPU.
    placed = {**HEAP, "asked": HEAP["base"], "through_foundry": True}
    monkeypatch.setattr(nvshmem, "_armed", HEAP["base"])
    monkeypatch.setattr(nvshmem, "heap_placement", lambda: placed)
    with pytest.raises(ReachedGPU):
        ctx.load()
    # Half the size (one PE where SAVE had two): refused, naming why.
    monkeypatch.setattr(nvshmem, "heap_placement", lambda: {**placed, "size": HEAP["size"] // 2})
    with pytest.raises(nvshmem.HeapPlacementError, match="allocations in it would land at other offsets"):
        ctx.load()
    edit_manifest(ctx, lambda m: m["meta"].update(nvshmem_heap={"base": "0x7"}))
    with pytest.raises(ArchiveError, match="damaged NVSHMEM heap record"):
        ctx.load()


def test_a_member_inflated_ahead_that_does_not_decompress_is_refused_before_the_gpu(tmp_path):
    """verify(inflate_ahead=True) leaves inflating to a thread; load waits for it and refuses a member
    that does not decompress (its checksum made consistent) before it maps any device memory."""
    import zlib

    ctx = build(tmp_path)
    member = ctx.real / PACKED_REL
    stored, bad = member.read_bytes(), zlib.compress(b"\0" * 10)  # the first chunk inflates short

    def forge(m):
        entry = m["files"][PACKED_REL]
        first = entry["encoding"]["chunks"][0]
        member.write_bytes(bad + stored[first:])
        entry["encoding"]["chunks"][0] = len(bad)
        entry["size"] = len(bad) + len(stored) - first
        entry["sha256"] = hashlib.sha256(member.read_bytes()).hexdigest()

    edit_manifest(ctx, forge)
    ar = open_archive(ctx.path, expected_fingerprint=ctx.expected(), inflate=False)  # every check passes
    ar.inflate_ahead()
    with pytest.raises(ArchiveError, match=r"does not decompress"):  # not ReachedGPU: before any mapping
        ctx.load(archive=ar)
