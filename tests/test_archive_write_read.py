"""foundry_core.archive: an archive written and read back, its layout on disk and digest, and reads
bounded by the sizes the manifest declares (CPU only)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from foundry_core import __version__
from foundry_core.archive import (
    FORMAT_VERSION,
    ArchiveError,
    ArchiveWriter,
    FingerprintMismatch,
    open_archive,
)
from sample_archive import (
    CUBIN,
    GRAPH,
    LAYOUT,
    entries,
    fp,
    manifest_of,
    real,
    save,
)

# ---------------------------------------------------------------------------------------------- basics


def test_round_trip(tmp_path):
    path = tmp_path / "a" / "rank0"  # the parent is created
    files = {
        "modules/abc.cubin": CUBIN,
        "graphs/0003.bin": GRAPH,
        "deep/er/still/x.bin": b"x",
        "empty.bin": b"",
        "layout.json": LAYOUT,
    }
    meta = {
        "graph_index": [{"id": 3, "file": "graphs/0003.bin"}],
        "rng": {"seed": 7, "offset": 12},
        "t": (1, 2),
    }
    digest = save(path, files, meta)
    ar = open_archive(path, expected_fingerprint=fp())
    assert ar.digest == digest
    assert ar.path == path
    assert ar.meta == {**meta, "t": [1, 2]}  # JSON form: tuples come back as lists
    assert ar.fingerprint == fp()
    assert ar.format_version == FORMAT_VERSION
    assert ar.files == {
        "deep/er/still/x.bin": 1,
        "empty.bin": 0,
        "graphs/0003.bin": len(GRAPH),
        "layout.json": len(ar.read_bytes("layout.json")),
        "modules/abc.cubin": len(CUBIN),
    }
    assert ar.read_bytes("modules/abc.cubin") == CUBIN
    assert ar.read_bytes("empty.bin") == b""
    assert ar.read_json("layout.json") == LAYOUT
    m = ar.manifest
    assert m["format"] == "foundry-archive" and m["format_version"] == FORMAT_VERSION
    assert m["foundry_version"] == __version__
    assert m["files"]["modules/abc.cubin"] == {
        "size": len(CUBIN),
        "sha256": hashlib.sha256(CUBIN).hexdigest(),
    }
    assert set(m["files"]) == set(files)
    with pytest.raises(ArchiveError, match="has no file 'nope.bin'"):
        ar.read_bytes("nope.bin")
    with pytest.raises(ArchiveError, match="not valid JSON"):
        ar.read_json("modules/abc.cubin")


def test_layout_on_disk(arch):
    path, digest = arch
    assert path.is_symlink()
    assert os.readlink(path) == f".rank0.{digest[:16]}"
    assert entries(path.parent) == {"rank0", f".rank0.{digest[:16]}", ".rank0.lock"}
    # The manifest lists every other file: nothing on disk is unaccounted for.
    on_disk = {str(p.relative_to(real(path))) for p in real(path).rglob("*") if p.is_file()}
    assert on_disk - {"manifest.json"} == set(manifest_of(path)["files"])


def test_digest_is_sha256_of_manifest_and_stable(arch):
    path, digest = arch
    raw = (path / "manifest.json").read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest()
    assert open_archive(path).digest == digest
    assert open_archive(path).digest == digest
    assert open_archive(path, expected_digest=digest).digest == digest
    assert open_archive(path, expected_digest=digest.upper()).digest == digest
    # The manifest is canonical: re-encoding the parsed manifest the same way gives the same bytes.
    m = json.loads(raw)
    assert json.dumps(m, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n" == raw


def test_dedup_with_has(tmp_path):
    images = [b"kernel-a", b"kernel-b", b"kernel-a", b"kernel-a"]
    with ArchiveWriter(tmp_path / "x") as w:
        added = 0
        for img in images:
            rel = f"modules/{hashlib.sha256(img).hexdigest()}.cubin"
            if not w.has(rel):
                w.add_bytes(rel, img)
                added += 1
        assert added == 2
        assert w.has(rel) and not w.has("modules/other.cubin")
        with pytest.raises(ArchiveError, match="already added; check has"):
            w.add_bytes(rel, b"kernel-a")
        w.commit(fingerprint=fp(), meta={})
    assert len(open_archive(tmp_path / "x").files) == 2


def test_add_bytes_accepts_buffers(tmp_path):
    import array

    with ArchiveWriter(tmp_path / "x") as w:
        w.add_bytes("a", bytearray(b"abc"))
        w.add_bytes("b", memoryview(b"0123456789")[2:5])
        w.add_bytes("c", array.array("i", [1, 2]))
        with pytest.raises(ArchiveError, match="expected bytes"):
            w.add_bytes("d", "text")
        with pytest.raises(ArchiveError, match="contiguous"):
            w.add_bytes("e", memoryview(b"0123456789")[::2])
        w.commit(fingerprint=fp(), meta={})
    ar = open_archive(tmp_path / "x")
    assert ar.read_bytes("a") == b"abc" and ar.read_bytes("b") == b"234"
    assert ar.read_bytes("c") == array.array("i", [1, 2]).tobytes()


# ---------------------------------------------------------------------------------------------- bounded reads


def test_verified_bytes_are_kept_no_reread(arch):
    path, _ = arch
    ar = open_archive(path)
    (real(path) / "modules/abc.cubin").write_bytes(b"swapped after verification")
    shutil.rmtree(real(path) / "graphs")
    assert ar.read_bytes("modules/abc.cubin") == CUBIN
    assert ar.read_bytes("graphs/0003.bin") == GRAPH


@pytest.fixture
def os_reads(monkeypatch):
    """Every ``os.read`` from here on, as (bytes asked, bytes got): os.read itself, since each
    archive submodule calls it."""
    requested = []
    real_read = os.read

    def spy(fd, n):
        data = real_read(fd, n)
        requested.append((n, len(data)))
        return data

    monkeypatch.setattr(os, "read", spy)
    return requested


def test_reads_are_bounded_by_the_declared_size(tmp_path, os_reads):
    from foundry_core import archive

    f = tmp_path / "f"
    for content, declared, ok in [
        (b"abcd", 4, True),
        (b"abcd", 3, False),
        (b"abcd", 5, False),
        (b"", 0, True),
    ]:
        f.write_bytes(content)
        os_reads.clear()
        fd = os.open(f, os.O_RDONLY)
        try:
            if ok:
                assert archive._read_exact(fd, declared, "f") == content
            else:
                with pytest.raises(ArchiveError, match="(shorter|longer) than the expected"):
                    archive._read_exact(fd, declared, "f")
        finally:
            os.close(fd)
        # no single allocation above declared + 1, and no more than declared + 1 bytes taken in all
        assert max(n for n, _ in os_reads) <= declared + 1
        assert sum(got for _, got in os_reads) <= declared + 1


def test_open_reads_each_member_once_within_bounds(arch, os_reads):
    path, _ = arch
    ar = open_archive(path)
    manifest_size = (real(path) / "manifest.json").stat().st_size
    sizes = [manifest_size, *ar.files.values()]
    assert sum(got for _, got in os_reads) == sum(sizes)  # each file read exactly once
    assert max(n for n, _ in os_reads) <= max(sizes) + 1


# --- load(archive=...): what verify() read is reused, but still checked -------------------------


def test_verified_archive_reused_only_for_its_own_path_digest_and_fingerprint(tmp_path):
    from foundry_core.api import _check_verified

    digest = save(tmp_path / "a")
    save(tmp_path / "b", fingerprint=fp(gpu_name="NVIDIA H100"))
    verified = open_archive(tmp_path / "a")
    _check_verified(verified, tmp_path / "a", fp(), None)
    _check_verified(verified, tmp_path / "a", fp(), digest.upper())
    with pytest.raises(ArchiveError, match="was verified at"):
        _check_verified(verified, tmp_path / "b", fp(), None)
    with pytest.raises(ArchiveError, match="does not match the pinned digest"):
        _check_verified(verified, tmp_path / "a", fp(), "0" * 64)
    with pytest.raises(FingerprintMismatch):
        _check_verified(verified, tmp_path / "a", fp(gpu_name="NVIDIA H100"), None)
    with pytest.raises(ArchiveError, match="takes what verify"):
        _check_verified({"meta": {}}, tmp_path / "a", fp(), None)
