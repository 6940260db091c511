"""foundry_core.archive: compressed members (format 2), format-1 archives, both inflate paths and
what ``foundry inspect`` reports of them (CPU only)."""

from __future__ import annotations

import hashlib
import os
import random
import re

import pytest

from foundry_core.archive import (
    ArchiveError,
    ArchiveWriter,
    open_archive,
)
from sample_archive import (
    CUBIN,
    fp,
    manifest_of,
    real,
    save,
)

# --- compressed members (format 2) ----------------------------------------------------------------


def _code_like(n: int) -> bytes:
    """Compressible like a code image: repeated instruction-ish patterns with some noise."""
    rng = random.Random(n)
    block = bytes(range(256)) * 3 + rng.randbytes(256)
    return (block * (n // len(block) + 1))[:n]


def test_compressed_members_round_trip_in_chunks(tmp_path):
    from foundry_core.archive import COMPRESS_CHUNK, ENCODING_KIND

    big = _code_like(3 * COMPRESS_CHUNK + 12345)  # four chunks, the last one short
    small = _code_like(COMPRESS_CHUNK // 2)
    noise = random.Random(1).randbytes(200_000)  # does not compress: stored as it is
    tiny = b"\x7fELF" * 10  # under the threshold: stored as it is
    with ArchiveWriter(tmp_path / "a") as w:
        w.add_bytes("modules/big.cubin", big, compress=True)
        w.add_bytes("modules/small.cubin", small, compress=True)
        w.add_bytes("memory/00001.bin", noise, compress=True)
        w.add_bytes("memory/00002.bin", tiny, compress=True)
        w.add_bytes("graphs/0000.bin", big)  # compress=False: as it is
        w.commit(fingerprint=fp(), meta={})
    files = manifest_of(tmp_path / "a")["files"]
    enc = files["modules/big.cubin"]["encoding"]
    assert enc["kind"] == ENCODING_KIND and enc["raw_size"] == len(big) and len(enc["chunks"]) == 4
    assert sum(enc["chunks"]) == files["modules/big.cubin"]["size"] < len(big) // 4
    assert "encoding" in files["modules/small.cubin"]
    for rel in ("memory/00001.bin", "memory/00002.bin", "graphs/0000.bin"):
        assert "encoding" not in files[rel], rel
    on_disk = real(tmp_path / "a") / "modules" / "big.cubin"
    assert on_disk.stat().st_size == files["modules/big.cubin"]["size"]
    assert hashlib.sha256(on_disk.read_bytes()).hexdigest() == files["modules/big.cubin"]["sha256"]
    ar = open_archive(tmp_path / "a")
    assert ar.read_bytes("modules/big.cubin") == big
    assert ar.read_bytes("modules/small.cubin") == small
    # Where opening it went, for start reports: every step timed, the stored (compressed) bytes and
    # what they inflate to counted.
    split = ar.open_timings
    assert set(split) == {
        "manifest_s",
        "tree_s",
        "read_s",
        "hash_s",
        "inflate_s",
        "stored_bytes",
        "content_bytes",
    }
    assert all(v >= 0 for v in split.values())
    assert split["stored_bytes"] == sum(f["size"] for f in files.values())
    assert split["content_bytes"] == len(big) * 2 + len(small) + len(noise) + len(tiny)
    assert ar.read_bytes("memory/00001.bin") == noise
    assert ar.read_bytes("memory/00002.bin") == tiny
    assert ar.read_bytes("graphs/0000.bin") == big


def test_interrupted_save_with_compression_pending_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="stop"):
        with ArchiveWriter(tmp_path / "a") as w:
            w.add_bytes("modules/big.cubin", _code_like(5 << 20), compress=True)
            raise RuntimeError("stop")
    assert not os.path.lexists(tmp_path / "a")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_version_1_archives_still_open(tmp_path):
    """An archive written before compressed members existed (format 1) reads as before."""
    import foundry_core.archive as archive_mod

    save(tmp_path / "a")
    m = manifest_of(tmp_path / "a")
    assert all("encoding" not in e for e in m["files"].values())
    m["format_version"] = 1
    m.pop("manifest_sha256")
    m["manifest_sha256"] = hashlib.sha256(archive_mod._manifest_bytes(m)).hexdigest()
    (real(tmp_path / "a") / "manifest.json").write_bytes(archive_mod._manifest_bytes(m))
    ar = open_archive(tmp_path / "a")
    assert ar.format_version == 1 and ar.read_bytes("modules/abc.cubin") == CUBIN


@pytest.mark.parametrize(
    "encoding,needle",
    [
        ({"kind": "zlib-chunks", "raw_size": 10, "chunk_size": 1 << 20, "chunks": [1]}, "do not add up"),
        (
            {"kind": "zlib-chunks", "raw_size": 10, "chunk_size": 100, "chunks": [5]},
            "bad encoding chunk_size",
        ),
        (
            {"kind": "zlib-chunks", "raw_size": -1, "chunk_size": 1 << 20, "chunks": [5]},
            "bad encoding raw_size",
        ),
        (
            {"kind": "zlib-chunks", "raw_size": True, "chunk_size": 1 << 20, "chunks": [5]},
            "bad encoding raw_size",
        ),
        ({"kind": "zlib-chunks", "raw_size": 10, "chunk_size": 1 << 20}, "bad 'encoding'"),
        ({"kind": "lz4", "raw_size": 10, "chunk_size": 1 << 20, "chunks": [5]}, "uses encoding 'lz4'"),
        ("zlib", "bad 'encoding'"),
    ],
)
def test_bad_encodings_are_refused_before_reading(tmp_path, encoding, needle):
    from foundry_core.archive import _check_encoding

    with pytest.raises(ArchiveError, match=re.escape(needle)):
        _check_encoding(encoding, 5, "entry")


def test_inflate_refuses_trailing_or_short_streams():
    import zlib

    from foundry_core.archive import _inflate

    good = zlib.compress(b"x" * 1000)
    assert _inflate(good, 0, len(good), 1000) == b"x" * 1000
    assert _inflate(good, 0, len(good), 999) is None  # more than claimed: never inflated past +1
    assert _inflate(good, 0, len(good), 1001) is None  # less than claimed
    assert _inflate(good + b"junk", 0, len(good) + 4, 1000) is None  # trailing bytes
    assert _inflate(good[:-3], 0, len(good) - 3, 1000) is None  # cut short
    assert _inflate(b"not zlib at all", 0, 15, 10) is None


def _native_inflate():
    from foundry_core import _native

    fn = _native.inflate_fn()
    if fn is None:
        pytest.skip("the native library has no inflate (or libz is missing): pip install -e .")
    return fn


def test_native_inflate_refuses_trailing_or_short_streams():
    """The in-place inflate (native/inflate.c) accepts exactly what the Python one accepts."""
    import ctypes
    import zlib

    inflate = _native_inflate()

    def run(src: bytes, expected: int) -> bytes | None:
        dst = ctypes.create_string_buffer(expected + 8)  # room past the end: must stay untouched
        ctypes.memset(ctypes.addressof(dst) + expected, 0xAB, 8)
        rc = inflate(src, len(src), dst, expected)
        assert dst.raw[expected:] == b"\xab" * 8, "wrote past the end of its buffer"
        return dst.raw[:expected] if rc == 0 else None

    payload = _code_like(300_000)
    good = zlib.compress(payload)
    assert run(good, len(payload)) == payload
    assert run(good, len(payload) - 1) is None  # more than claimed
    assert run(good, len(payload) + 1) is None  # less than claimed
    assert run(good + b"junk", len(payload)) is None  # trailing bytes
    assert run(good[:-3], len(payload)) is None  # cut short
    assert run(b"not zlib at all", 10) is None
    assert run(zlib.compress(b""), 0) == b""


def _forge_first_chunk(archive, rel: str, bad: bytes) -> None:
    """Replace the first chunk of compressed member ``rel`` by ``bad`` and make every checksum
    consistent again: only inflating can find it out."""
    from foundry_core import archive as archive_mod

    m = manifest_of(archive)
    entry = m["files"][rel]
    member = real(archive) / rel
    stored = member.read_bytes()
    first = entry["encoding"]["chunks"][0]
    member.write_bytes(bad + stored[first:])
    entry["encoding"]["chunks"][0] = len(bad)
    entry["size"] = len(bad) + len(stored) - first
    entry["sha256"] = hashlib.sha256(member.read_bytes()).hexdigest()
    del m["manifest_sha256"]
    m["manifest_sha256"] = archive_mod._self_checksum(m)
    (real(archive) / "manifest.json").write_bytes(archive_mod._manifest_bytes(m))


@pytest.mark.parametrize("path", ["native", "python"])
def test_both_inflate_paths_give_the_content_and_refuse_damage(tmp_path, monkeypatch, path):
    import zlib

    from foundry_core import _native
    from foundry_core import archive as archive_mod

    if path == "native":
        _native_inflate()
    else:
        monkeypatch.setattr(_native, "inflate_fn", lambda: None)
    big = _code_like(5 * archive_mod.COMPRESS_CHUNK + 777)
    with ArchiveWriter(tmp_path / "a") as w:
        w.add_bytes("modules/big.cubin", big, compress=True)
        w.add_bytes("graphs/0000.bin", _code_like(70_000), compress=True)
        w.commit(fingerprint=fp(), meta={})
    ar = open_archive(tmp_path / "a")
    assert type(ar.read_bytes("modules/big.cubin")) is bytes
    assert ar.read_bytes("modules/big.cubin") == big
    assert ar.read_bytes("graphs/0000.bin") == _code_like(70_000)
    # Now a chunk that inflates to something else, with its checksums made consistent again:
    # refused naming the member, on either path.
    one_byte_short = zlib.compress(b"\0" * (archive_mod.COMPRESS_CHUNK - 1))
    _forge_first_chunk(tmp_path / "a", "modules/big.cubin", one_byte_short)
    with pytest.raises(ArchiveError, match=r"modules/big.cubin.*does not decompress"):
        open_archive(tmp_path / "a")


def test_inspect_reports_content_and_on_disk_sizes(tmp_path, capsys):
    from foundry_core.cli import main

    with ArchiveWriter(tmp_path / "a") as w:
        w.add_bytes("modules/big.cubin", _code_like(2 << 20), compress=True)
        w.add_bytes("layout.json", b"{}")
        w.commit(fingerprint=fp(), meta={})
    assert main(["inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("files"))
    assert "files     2, 2.0 MiB" in line and "on disk, 1 compressed)" in line, line


def test_inflating_can_wait_until_every_check_passed(tmp_path, monkeypatch):
    """open_archive(inflate=False) checks everything but inflates nothing; members inflate on first
    read or on the inflate-ahead thread, and one that does not decompress is refused where it is read."""
    import zlib

    from foundry_core import archive as archive_mod

    big = _code_like(3 * archive_mod.COMPRESS_CHUNK + 5)
    small = _code_like(archive_mod.COMPRESS_CHUNK // 2)
    with ArchiveWriter(tmp_path / "a") as w:
        w.add_bytes("modules/big.cubin", big, compress=True)
        w.add_bytes("modules/small.cubin", small, compress=True)
        w.add_bytes("graphs/0000.bin", b"as it is")
        w.commit(fingerprint=fp(), meta={})
    ar = open_archive(tmp_path / "a", inflate=False)
    assert ar.open_timings["inflate_s"] < 0.05 and ar.inflate_s == 0.0
    assert ar.files == {
        "modules/big.cubin": len(big),
        "modules/small.cubin": len(small),
        "graphs/0000.bin": 8,
    }
    assert ar.read_bytes("modules/small.cubin") == small  # inflated on first read, that one alone
    assert ar._pending == {"modules/big.cubin"}
    from foundry_core.archive import codec

    threads_asked = []
    real_map = codec._map_on_threads

    def counting_map(fn, items, threads, name, sizes=None):
        threads_asked.append(threads)
        return real_map(fn, items, threads, name, sizes)

    monkeypatch.setattr(codec, "_map_on_threads", counting_map)
    ar.inflate_ahead().join(30)
    monkeypatch.undo()
    # In the background it leaves half the cores to the work it overlaps (prewarm's docstring).
    assert threads_asked == [codec.BACKGROUND_THREADS]
    assert 1 <= codec.BACKGROUND_THREADS <= max(1, (os.cpu_count() or 1) // 2)
    assert ar.read_bytes("modules/big.cubin") == big and ar.inflate_s > 0 and ar.inflate_ahead() is None

    # A member whose stored bytes pass their checksum but do not inflate (checksums made consistent)
    _forge_first_chunk(tmp_path / "a", "modules/big.cubin", zlib.compress(b"\0" * 10))
    ar = open_archive(tmp_path / "a", inflate=False)  # every check passes: the stored bytes are as listed
    ar.inflate_ahead().join(30)  # the thread keeps the error to itself
    assert ar.read_bytes("modules/small.cubin") == small  # the other member inflated
    for _ in range(2):  # refused where it is read, every time
        with pytest.raises(ArchiveError, match=r"modules/big.cubin.*does not decompress"):
            ar.read_bytes("modules/big.cubin")
