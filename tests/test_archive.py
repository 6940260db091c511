"""Contract tests for foundry_core.archive and foundry_core.fingerprint (CPU only)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from foundry_core import __version__
from foundry_core.archive import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MISSING,
    ArchiveError,
    ArchiveNotFound,
    ArchiveSuperseded,
    ArchiveWriter,
    FingerprintMismatch,
    compare_fingerprint,
    open_archive,
    published_version,
    remove_archive,
)
from foundry_core.fingerprint import (
    FINGERPRINT_FIELDS,
    FINGERPRINT_FORMAT,
    current_fingerprint,
    format_driver_version,
    make_fingerprint,
)

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


@pytest.fixture
def arch(tmp_path):
    path = tmp_path / "rank0"
    digest = save(path)
    return path, digest


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


# ---------------------------------------------------------------------------------------------- damage


@pytest.mark.parametrize("rel", ["modules/abc.cubin", "graphs/0003.bin", "layout.json"])
@pytest.mark.parametrize("where", [0, "middle", -1])
def test_flipped_byte_in_member_is_refused_naming_it(arch, rel, where):
    path, _ = arch
    f = real(path) / rel
    data = bytearray(f.read_bytes())
    i = len(data) // 2 if where == "middle" else where
    data[i] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=f"file '{rel}' fails its sha256 check"):
        open_archive(path)


def test_every_flipped_manifest_byte_is_refused_with_a_pinned_digest(arch):
    path, digest = arch
    mpath = real(path) / "manifest.json"
    raw = mpath.read_bytes()
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x20 if i % 2 else 0x01
        mpath.write_bytes(bytes(bad))
        with pytest.raises(ArchiveError) as ei:
            open_archive(path, expected_digest=digest)
        assert "\n" not in str(ei.value)
    mpath.write_bytes(raw)
    assert open_archive(path, expected_digest=digest).digest == digest


def test_flipped_manifest_byte_without_pin_never_changes_file_contents(arch):
    path, _ = arch
    original = open_archive(path)
    mpath = real(path) / "manifest.json"
    raw = mpath.read_bytes()
    refused = 0
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        mpath.write_bytes(bytes(bad))
        try:
            ar = open_archive(path)
        except ArchiveError as e:
            assert "\n" not in str(e)
            refused += 1
            continue
        for rel in ar.files:
            assert hashlib.sha256(ar.read_bytes(rel)).hexdigest() == ar.manifest["files"][rel]["sha256"]
            assert ar.read_bytes(rel) == original.read_bytes(rel)
    # What the JSON and the schema let through, the manifest's own checksum (manifest_sha256) refuses.
    assert refused == len(raw)


def test_flipped_structural_manifest_byte_names_the_manifest(arch):
    path, _ = arch
    mpath = real(path) / "manifest.json"
    raw = mpath.read_bytes()
    mpath.write_bytes(raw.replace(b'"files"', b'"fil\xe5s"', 1))
    with pytest.raises(ArchiveError, match="manifest.json is not valid JSON"):
        open_archive(path)
    mpath.write_bytes(raw.replace(b'"files"', b'"filds"', 1))
    with pytest.raises(ArchiveError, match="manifest.json has no 'files' field"):
        open_archive(path)
    sha = hashlib.sha256(CUBIN).hexdigest()
    other = ("0" if sha[0] != "0" else "1") + sha[1:]
    mpath.write_bytes(raw.replace(sha.encode(), other.encode()))
    with pytest.raises(
        ArchiveError,
        match=r"manifest.json is damaged: its content does not match its own checksum \(manifest_sha256\); "
        "SAVE again",
    ):
        open_archive(path)
    # With the manifest's own checksum recomputed (a consistent writer), the member check names the file.
    mpath.write_bytes(canonical(seal(json.loads(raw.replace(sha.encode(), other.encode())))))
    with pytest.raises(ArchiveError, match="'modules/abc.cubin' fails its sha256 check"):
        open_archive(path)


DAMAGED = (
    r"manifest.json is damaged: its content does not match its own checksum \(manifest_sha256\); SAVE again"
)


def test_manifest_sha256_is_the_checksum_of_the_manifest_without_it(arch):
    path, _ = arch
    raw = (real(path) / "manifest.json").read_bytes()
    m = json.loads(raw)
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    assert m["manifest_sha256"] == hashlib.sha256(canonical(body)).hexdigest()
    assert canonical(seal(m)) == raw


def _checksum(value):
    def change(m):
        m["manifest_sha256"] = value(m["manifest_sha256"]) if callable(value) else value

    return change


MALFORMED = "manifest.json field 'manifest_sha256' must be 64 lowercase hex characters"
CHECKSUM_CASES = {
    "zeros": (_checksum("0" * 64), DAMAGED),
    "sha256-of-nothing": (_checksum(hashlib.sha256(b"").hexdigest()), DAMAGED),
    "of-another-manifest": (
        lambda m: m.update(manifest_sha256=seal({**m, "created_utc": "2020-01-01T00:00:00+00:00"})[
            "manifest_sha256"]),
        DAMAGED,
    ),
    "missing": (lambda m: m.pop("manifest_sha256"), "manifest.json has no 'manifest_sha256' field"),
    "upper": (_checksum(str.upper), MALFORMED),
    "short": (_checksum(lambda v: v[:63]), MALFORMED),
    "long": (_checksum(lambda v: v + "0"), MALFORMED),
    "not-hex": (_checksum("g" * 64), MALFORMED),
    "empty": (_checksum(""), MALFORMED),
    "null": (_checksum(None), MALFORMED),
    "int": (_checksum(lambda v: int(v, 16)), MALFORMED),
    "list": (_checksum(lambda v: [v]), MALFORMED),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHECKSUM_CASES))
def test_wrong_missing_or_malformed_manifest_sha256_is_refused(arch, case):
    change, message = CHECKSUM_CASES[case]
    path, _ = arch
    m = manifest_of(path)
    change(m)
    (real(path) / "manifest.json").write_bytes(canonical(m))  # only the checksum differs from the writer's
    for pin in (None, hashlib.sha256(canonical(m)).hexdigest()):  # pinning the damaged bytes does not help
        with pytest.raises(ArchiveError) as ei:
            open_archive(path, expected_fingerprint=fp(), expected_digest=pin)
        msg = str(ei.value)
        assert msg.startswith(f"archive {path}: ") and "\n" not in msg, msg
        assert re.search(message, msg) if message is DAMAGED else message in msg, msg


def test_flipped_meta_byte_without_a_pin_is_refused(arch):
    path, _ = arch
    mpath = real(path) / "manifest.json"
    raw = mpath.read_bytes()
    at = raw.index(b'"graphs": 1') + len(b'"graphs": ')
    bad = bytearray(raw)
    bad[at] ^= 0x01  # meta.graphs 1 -> 0: valid JSON, valid schema, no member checksum covers it
    assert json.loads(bytes(bad))["meta"] == {"graphs": 0}
    mpath.write_bytes(bytes(bad))
    with pytest.raises(ArchiveError, match=DAMAGED):
        open_archive(path)
    with pytest.raises(ArchiveError, match=DAMAGED):
        open_archive(path, expected_fingerprint=fp())
    # The same change made by a writer that recomputes the checksum opens: integrity, not authenticity.
    mpath.write_bytes(canonical(seal(json.loads(bytes(bad)))))
    assert open_archive(path, expected_fingerprint=fp()).meta == {"graphs": 0}


@pytest.mark.parametrize("keep", [0, 1, 10, 100, "half", -1])
def test_truncated_manifest_is_refused(arch, keep):
    path, _ = arch
    mpath = real(path) / "manifest.json"
    raw = mpath.read_bytes()
    n = len(raw) // 2 if keep == "half" else (len(raw) - 2 if keep == -1 else keep)
    mpath.write_bytes(raw[:n])
    with pytest.raises(ArchiveError, match=r"manifest.json (is not valid JSON|must hold)"):
        open_archive(path)


def test_truncated_or_grown_member_is_refused(arch):
    path, _ = arch
    f = real(path) / "graphs/0003.bin"
    f.write_bytes(GRAPH[:-1])
    with pytest.raises(
        ArchiveError, match=rf"'graphs/0003.bin' is {len(GRAPH) - 1} bytes, the manifest lists"
    ):
        open_archive(path)
    f.write_bytes(GRAPH + b"!")
    with pytest.raises(ArchiveError, match="'graphs/0003.bin' is .* bytes, the manifest lists"):
        open_archive(path)


def test_missing_manifest_is_refused(arch):
    path, _ = arch
    (real(path) / "manifest.json").unlink()
    with pytest.raises(ArchiveError, match="manifest.json is missing"):
        open_archive(path)


def test_oversized_manifest_is_refused_without_reading_it(arch):
    path, _ = arch
    with open(real(path) / "manifest.json", "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: cheap on disk
    with pytest.raises(ArchiveError, match="over the 67108864-byte limit"):
        open_archive(path)


@pytest.mark.parametrize("rel", ["modules/abc.cubin", "layout.json"])
def test_missing_member_is_refused(arch, rel):
    path, _ = arch
    (real(path) / rel).unlink()
    with pytest.raises(ArchiveError, match=f"file '{rel}' listed in the manifest is missing"):
        open_archive(path)


@pytest.mark.parametrize("rel", ["extra.bin", "modules/extra.cubin", "new/dir/x"])
def test_extra_file_is_refused(arch, rel):
    path, _ = arch
    f = real(path) / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(b"sneaky")
    with pytest.raises(ArchiveError, match=f"file '{rel}' is not listed in the manifest"):
        open_archive(path)


def test_empty_extra_directory_is_tolerated(arch):
    path, digest = arch
    (real(path) / "empty_dir").mkdir()
    assert open_archive(path).digest == digest


def test_symlinks_inside_are_refused(arch, tmp_path):
    path, _ = arch
    outside = tmp_path / "outside.bin"
    outside.write_bytes(CUBIN)  # same bytes: the checksum alone would pass
    f = real(path) / "modules/abc.cubin"
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(ArchiveError, match="'modules/abc.cubin' is a symlink"):
        open_archive(path)


def test_symlinked_directory_inside_is_refused(arch, tmp_path):
    path, _ = arch
    moved = tmp_path / "elsewhere"
    shutil.move(str(real(path) / "modules"), moved)
    (real(path) / "modules").symlink_to(moved)
    with pytest.raises(ArchiveError, match="'modules' is a symlink"):
        open_archive(path)


def test_fifo_inside_is_refused_without_hanging(arch):
    path, _ = arch
    f = real(path) / "graphs/0003.bin"
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(ArchiveError, match="'graphs/0003.bin' is not a regular file"):
        open_archive(path)


# ---------------------------------------------------------------------------------------------- schema


def test_future_format_version_is_refused(arch):
    path, _ = arch
    m = manifest_of(path)
    m["format_version"] = FORMAT_VERSION + 1
    m["something_new"] = {"x": 1}  # a newer format may change the schema: the version message wins
    del m["files"]
    write_manifest(path, m)
    with pytest.raises(ArchiveError) as ei:
        open_archive(path)
    assert str(ei.value).endswith(
        f"archive format version {FORMAT_VERSION + 1} is newer than this Foundry reads ({FORMAT_VERSION}): "
        "upgrade Foundry or SAVE again"
    )


def test_older_format_version_is_refused(arch):
    path, _ = arch
    m = manifest_of(path)
    m["format_version"] = 0
    write_manifest(path, m)
    with pytest.raises(ArchiveError, match="archive format version 0 is older than this Foundry reads"):
        open_archive(path)


def _set(key, value):
    def mutate(m):
        m[key] = value

    return mutate


def _drop(key):
    def mutate(m):
        del m[key]

    return mutate


def _entry(key, value):
    def mutate(m):
        e = m["files"]["layout.json"]
        if value is MISSING:
            del e[key]
        else:
            e[key] = value

    return mutate


SCHEMA_CASES = {
    "format-int": (_set("format", 1), "'format' is 1, expected 'foundry-archive'"),
    "format-other": (_set("format", "tarball"), "'format' is 'tarball'"),
    "format-missing": (_drop("format"), "no 'format' field"),
    "version-str": (_set("format_version", "1"), "'format_version' must be an integer"),
    "version-bool": (_set("format_version", True), "'format_version' must be an integer"),
    "version-float": (_set("format_version", 1.0), "'format_version' must be an integer"),
    "version-missing": (_drop("format_version"), "no 'format_version' field"),
    "foundry-version-int": (_set("foundry_version", 1), "'foundry_version' must be a non-empty string"),
    "foundry-version-empty": (_set("foundry_version", ""), "'foundry_version' must be a non-empty string"),
    "created-int": (_set("created_utc", 5), "'created_utc' must be an ISO-8601 string"),
    "created-garbage": (_set("created_utc", "yesterday"), "'created_utc' is not an ISO-8601 time"),
    "created-naive": (_set("created_utc", "2026-01-01T00:00:00"), "'created_utc' must be in UTC"),
    "created-missing": (_drop("created_utc"), "no 'created_utc' field"),
    "fingerprint-list": (_set("fingerprint", []), "'fingerprint' must be an object"),
    "meta-str": (_set("meta", "x"), "'meta' must be an object"),
    "meta-null": (_set("meta", None), "'meta' must be an object"),
    "meta-missing": (_drop("meta"), "no 'meta' field"),
    "files-list": (_set("files", ["layout.json"]), "'files' must be an object"),
    "unknown-field": (_set("extra", 1), "unknown field 'extra'"),
    "size-str": (_entry("size", "3"), "entry for 'layout.json' has a bad size"),
    "size-negative": (_entry("size", -1), "entry for 'layout.json' has a bad size"),
    "size-bool": (_entry("size", True), "entry for 'layout.json' has a bad size"),
    "size-float": (_entry("size", 11.0), "entry for 'layout.json' has a bad size"),
    "size-missing": (_entry("size", MISSING), "must be an object with exactly 'size' and 'sha256'"),
    "sha-upper": (lambda m: m["files"]["layout.json"].update(sha256="A" * 64), "bad sha256"),
    "sha-short": (_entry("sha256", "ab"), "bad sha256"),
    "sha-int": (_entry("sha256", 5), "bad sha256"),
    "entry-extra-key": (_entry("mode", 0o644), "exactly 'size' and 'sha256'"),
    "entry-list": (lambda m: m["files"].update({"layout.json": [1, "x"]}), "exactly 'size' and 'sha256'"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_wrong_manifest_types_are_refused(arch, case):
    path, _ = arch
    mutate, message = SCHEMA_CASES[case]
    m = manifest_of(path)
    mutate(m)
    write_manifest(path, m)
    with pytest.raises(ArchiveError, match=message.replace("(", r"\(").replace(")", r"\)")) as ei:
        open_archive(path)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("doc", [b"[]", b'"x"', b"null", b"1", b"{}"])
def test_manifest_not_an_archive_object(arch, doc):
    path, _ = arch
    (real(path) / "manifest.json").write_bytes(doc)
    with pytest.raises(ArchiveError, match="manifest.json (must hold a JSON object|has no 'format')"):
        open_archive(path)


@pytest.mark.parametrize(
    "raw,message",
    [
        (b'{"format": "foundry-archive", "format": "foundry-archive"}', "duplicate key"),
        (b'{"format": NaN}', "non-standard JSON constant NaN"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (b'{"format": "\xff"}', "not valid JSON"),
        (b'{"format": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    ],
)
def test_hostile_manifest_json(arch, raw, message):
    path, _ = arch
    (real(path) / "manifest.json").write_bytes(raw)
    with pytest.raises(ArchiveError, match=message):
        open_archive(path)


BAD_NAMES = [
    "../x",
    "../../etc/passwd",
    "/etc/passwd",
    "a/../b",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "",
    ".",
    "..",
    "manifest.json",
    "a\\b",
    "a\x00b",
    "a\nb",
    "x" * 256,
    "a/" * 600 + "b",
    "\udcff",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:30])
def test_path_traversal_entries_are_refused(arch, name):
    path, _ = arch
    m = manifest_of(path)
    m["files"][name] = {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}
    (real(path) / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArchiveError, match="manifest.json lists a bad file") as ei:
        open_archive(path)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:30])
def test_writer_refuses_bad_names(tmp_path, name):
    with ArchiveWriter(tmp_path / "x") as w:
        with pytest.raises(ArchiveError, match="archive member name"):
            w.add_bytes(name, b"abc")
    assert not (tmp_path / "x").exists()
    assert not (tmp_path / "etc").exists()


def test_file_and_directory_with_one_name(tmp_path, arch):
    with ArchiveWriter(tmp_path / "x") as w:
        w.add_bytes("a/b", b"1")
        with pytest.raises(ArchiveError, match="already used as a directory"):
            w.add_bytes("a", b"2")
        w.add_bytes("c", b"1")
        with pytest.raises(ArchiveError, match="needs 'c' as a directory"):
            w.add_bytes("c/d", b"2")
    path, _ = arch
    m = manifest_of(path)
    m["files"]["layout.json/x"] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    write_manifest(path, m)
    with pytest.raises(ArchiveError, match="both as a file and a directory"):
        open_archive(path)


# ---------------------------------------------------------------------------------------------- fingerprint


FIELD_CHANGES = {
    "fingerprint_format": FINGERPRINT_FORMAT + 1,
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "compute_capability": "10.0",
    "sm_count": 114,
    "driver_version": "12.8",
    "cuda_version": "12.8",
    "torch_version": "2.11.0",
    "foundry_version": "0.0.2",
    "rank": 1,
    "world_size": 4,
    "model": {"name": "Qwen3-8B", "capture_sizes": [1, 2, 4, 8], "dtype": "bfloat16"},
}


def test_field_changes_cover_every_field():
    assert set(FIELD_CHANGES) == set(FINGERPRINT_FIELDS)


@pytest.mark.parametrize("field", FINGERPRINT_FIELDS)
def test_every_fingerprint_field_mismatch_is_named(arch, field):
    path, _ = arch
    current = dict(fp())
    current[field] = FIELD_CHANGES[field]
    if field == "rank":
        current["world_size"] = 2  # keep the layout valid; rank is compared first
    with pytest.raises(FingerprintMismatch) as ei:
        open_archive(path, expected_fingerprint=current)
    err = ei.value
    want = "model.name" if field == "model" else field
    assert err.field == want
    assert f"archive was saved for {want}=" in str(err)
    assert "\n" not in str(err)
    assert isinstance(err, ArchiveError)


def test_fingerprint_message_reads_well():
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(fp(gpu_name="NVIDIA H100 80GB HBM3"), fp())
    assert str(ei.value).startswith(
        "archive was saved for gpu_name='NVIDIA H100 80GB HBM3', this machine has 'NVIDIA H200'"
    )
    assert (ei.value.saved, ei.value.current) == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def test_fingerprint_first_field_in_order_wins():
    saved = fp()
    current = fp(gpu_name="other", sm_count=1, torch_version="0.1", model={"x": 1})
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.field == "gpu_name"
    current = fp(driver_version="1.0", cuda_version="1.0", model={"x": 1}, rank=1, world_size=2)
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.field == "driver_version"
    order = list(FINGERPRINT_FIELDS)
    assert order[0] == "fingerprint_format" and order[-1] == "model"
    assert order.index("gpu_name") < order.index("driver_version") < order.index("cuda_version")
    assert order.index("cuda_version") < order.index("torch_version") < order.index("foundry_version")
    assert order.index("foundry_version") < order.index("rank") < order.index("world_size")


def test_model_keys_are_compared_one_by_one():
    saved = fp(model={"name": "m", "capture_sizes": [1, 2, 4], "pools": {"kv": 10, "mamba": 3}})
    # lists element by element: a length difference names the extra elements, on the side that has them
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[2:\]=\[4\], this machine has \[\]; SAVE again"
    ) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2], "pools": {"kv": 10, "mamba": 3}})
        )
    assert (ei.value.field, ei.value.saved, ei.value.current) == ("model.capture_sizes[2:]", [4], [])
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[3:\]=\[\], this machine has \[8\]; SAVE again"
    ):
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2, 4, 8], "pools": {"kv": 10, "mamba": 3}})
        )
    # a differing element is named by its index, with both values
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[1\]=2, this machine has 3; SAVE again"
    ) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 3, 4], "pools": {"kv": 10, "mamba": 3}})
        )
    assert (ei.value.field, ei.value.saved, ei.value.current) == ("model.capture_sizes[1]", 2, 3)
    # nested lists and objects inside lists: the full path to the first difference
    with pytest.raises(FingerprintMismatch, match=r"model.shapes\[1\]\[0\]=4, this machine has 5;"):
        compare_fingerprint(fp(model={"shapes": [[1, 2], [4, 8]]}), fp(model={"shapes": [[1, 2], [5, 8]]}))
    with pytest.raises(FingerprintMismatch, match=r"model.pools\[0\].kv=1, this machine has 2;"):
        compare_fingerprint(fp(model={"pools": [{"kv": 1}]}), fp(model={"pools": [{"kv": 2}]}))
    # JSON types still count inside a list: true is not 1
    with pytest.raises(FingerprintMismatch, match=r"model.flags\[0\]=1, this machine has True;"):
        compare_fingerprint(fp(model={"flags": [1]}), fp(model={"flags": [True]}))
    # a list is not an object, nor a string
    with pytest.raises(FingerprintMismatch, match=r"model.capture_sizes="):
        compare_fingerprint(fp(model={"capture_sizes": [1]}), fp(model={"capture_sizes": {"0": 1}}))
    with pytest.raises(FingerprintMismatch, match=r"model.capture_sizes="):
        compare_fingerprint(fp(model={"capture_sizes": ["1"]}), fp(model={"capture_sizes": "1"}))
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2, 4], "pools": {"kv": 10, "mamba": 4}})
        )
    assert ei.value.field == "model.pools.mamba"
    # tuples equal lists (JSON), but a bool is not an int and an int is not a float
    compare_fingerprint(
        saved, dict(fp(), model={"name": "m", "capture_sizes": (1, 2, 4), "pools": {"mamba": 3, "kv": 10}})
    )
    with pytest.raises(FingerprintMismatch, match="model.flag"):
        compare_fingerprint(fp(model={"flag": 1}), fp(model={"flag": True}))
    with pytest.raises(FingerprintMismatch, match="model.scale"):
        compare_fingerprint(fp(model={"scale": 1}), fp(model={"scale": 1.0}))


def test_missing_keys_on_either_side_mismatch():
    saved, current = fp(), fp()
    del saved["torch_version"]
    with pytest.raises(
        FingerprintMismatch, match="archive was saved without torch_version, this machine has '2.13.0'"
    ) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.saved is MISSING
    with pytest.raises(
        FingerprintMismatch,
        match="archive was saved for torch_version='2.13.0', this machine has no torch_version",
    ) as ei:
        compare_fingerprint(current, saved)
    assert ei.value.current is MISSING
    with pytest.raises(FingerprintMismatch, match="model.kv_pool"):
        compare_fingerprint(fp(model={"kv_pool": 5}), fp(model={}))
    with pytest.raises(FingerprintMismatch, match="model.kv_pool"):
        compare_fingerprint(fp(model={}), fp(model={"kv_pool": 5}))
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(dict(fp(), hostname="a"), fp())
    assert ei.value.field == "hostname"
    with pytest.raises(FingerprintMismatch, match="saved for model="):
        compare_fingerprint(fp(), dict(fp(), model="m"))
    with pytest.raises(ArchiveError, match="must be dicts"):
        compare_fingerprint(fp(), None)


def test_equal_fingerprints_pass(arch):
    path, _ = arch
    compare_fingerprint(fp(), fp())
    saved = open_archive(path).fingerprint
    compare_fingerprint(saved, fp())
    open_archive(path, expected_fingerprint=fp())


def test_make_fingerprint():
    f = fp(driver_version=12080)
    assert list(f) == list(FINGERPRINT_FIELDS)
    assert f["driver_version"] == "12.8" and f["foundry_version"] == __version__
    assert f["fingerprint_format"] == FINGERPRINT_FORMAT and f["rank"] == 0 and f["world_size"] == 1
    assert fp(model={"s": (1, 2)})["model"] == {"s": [1, 2]}
    assert fp(cuda_version=None)["cuda_version"] is None
    assert format_driver_version(13000) == "13.0" and format_driver_version(12090) == "12.9"
    bad = [
        ({"gpu_nmae": "x"}, "unknown fingerprint field 'gpu_nmae'"),
        ({"sm_count": 0}, "'sm_count'"),
        ({"sm_count": True}, "'sm_count'"),
        ({"compute_capability": "sm90"}, "'compute_capability'"),
        ({"gpu_name": ""}, "'gpu_name'"),
        ({"rank": 2, "world_size": 2}, "outside world_size"),
        ({"world_size": 0}, "'world_size'"),
        ({"model": [1]}, "'model'"),
        ({"model": {1: 2}}, "key 1 is not a string"),
        ({"model": {"x": float("nan")}}, "non-finite"),
        ({"model": {"x": {1, 2}}}, "type set"),
        ({"driver_version": -5}, "driver_version"),
    ]
    for over, message in bad:
        with pytest.raises(ValueError, match=message):
            fp(**over)
    with pytest.raises(ValueError, match="'gpu_name' is required"):
        make_fingerprint(compute_capability="9.0")


def test_current_fingerprint_with_stub_torch(monkeypatch):
    import types

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    torch = types.ModuleType("torch")
    torch.__version__ = "2.13.0+cu130"
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, get_device_properties=lambda d: Props)
    cuda_pkg = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    driver.cuDriverGetVersion = lambda: (0, 13000)
    cuda_pkg.bindings, bindings.driver = bindings, driver
    for name, mod in {
        "torch": torch,
        "cuda": cuda_pkg,
        "cuda.bindings": bindings,
        "cuda.bindings.driver": driver,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    f = current_fingerprint(0, model={"name": "m"}, rank=1, world_size=2)
    assert f == make_fingerprint(
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        driver_version="13.0",
        cuda_version="13.0",
        torch_version="2.13.0+cu130",
        rank=1,
        world_size=2,
        model={"name": "m"},
    )
    torch.cuda.is_available = lambda: False
    with pytest.raises(RuntimeError, match="no CUDA device"):
        current_fingerprint()


def test_archive_imports_without_torch():
    code = "import sys, foundry_core.archive, foundry_core.fingerprint; assert 'torch' not in sys.modules, 'torch'"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---------------------------------------------------------------------------------------------- digest pin


def test_expected_digest_mismatch_is_refused(arch):
    path, digest = arch
    other = ("0" if digest[0] != "0" else "1") + digest[1:]
    with pytest.raises(
        ArchiveError, match=f"archive digest {digest} does not match the pinned trust.archive_digest {other}"
    ):
        open_archive(path, expected_digest=other)
    for bad in ["abc", "g" * 64, 5]:
        with pytest.raises(ArchiveError, match="64 hex characters"):
            open_archive(path, expected_digest=bad)


def test_digest_pin_survives_only_identical_resave(arch):
    path, digest = arch
    new = save(path)
    assert new != digest  # created_utc differs: every SAVE is its own archive
    with pytest.raises(ArchiveError, match="does not match the pinned"):
        open_archive(path, expected_digest=digest)


# ---------------------------------------------------------------------------------------------- publishing


def test_replacing_an_existing_archive(arch):
    path, old_digest = arch
    new_digest = save(path, {"only.bin": b"new"}, meta={"v": 2})
    ar = open_archive(path, expected_digest=new_digest)
    assert ar.files == {"only.bin": 3} and ar.meta == {"v": 2}
    assert entries(path.parent) == {"rank0", f".rank0.{new_digest[:16]}", ".rank0.lock"}
    assert not (path.parent / f".rank0.{old_digest[:16]}").exists()


def test_replacing_a_plain_directory_archive(arch, tmp_path):
    path, digest = arch
    plain = tmp_path / "plain"
    shutil.copytree(real(path), plain)  # e.g. copied with cp -rL
    assert open_archive(plain).digest == digest
    new = save(plain, {"x": b"1"})
    assert plain.is_symlink() and open_archive(plain).digest == new
    assert entries(tmp_path) >= {"plain", f".plain.{new[:16]}", ".plain.lock"}
    assert not any(
        e.startswith(".plain.") and e not in (f".plain.{new[:16]}", ".plain.lock") for e in entries(tmp_path)
    )


def test_replacing_an_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    digest = save(tmp_path / "x")
    assert open_archive(tmp_path / "x").digest == digest


def test_replacing_a_symlink_to_a_foreign_archive_keeps_it(arch, tmp_path):
    path, digest = arch
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(real(path), elsewhere)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    new = save(link, {"x": b"1"})
    assert open_archive(link).digest == new
    assert open_archive(elsewhere).digest == digest  # not ours to delete


def test_dangling_symlink_is_replaced(tmp_path):
    link = tmp_path / "x"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ArchiveError, match="dangling symlink"):
        open_archive(link)
    digest = save(link)
    assert open_archive(link).digest == digest


def test_refusing_to_clobber_a_non_archive_directory(tmp_path):
    user = tmp_path / "data"
    user.mkdir()
    (user / "precious.txt").write_text("do not delete")
    with pytest.raises(
        ArchiveError,
        match=f"refusing to replace {user}: it is a non-empty directory that is not a Foundry archive",
    ):
        save(user)
    assert (user / "precious.txt").read_text() == "do not delete"
    assert entries(tmp_path) == {"data", ".data.lock"}
    with pytest.raises(ArchiveError, match="manifest.json is missing"):
        open_archive(user)
    with pytest.raises(ArchiveError, match="not a Foundry archive"):
        remove_archive(user)
    assert (user / "precious.txt").exists()


def test_refusing_to_clobber_a_file_or_foreign_symlink(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ArchiveError, match="it is a file"):
        save(f)
    with pytest.raises(ArchiveError, match="is not a directory"):
        open_archive(f)
    user = tmp_path / "data"
    user.mkdir()
    (user / "x").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(user)
    with pytest.raises(ArchiveError, match="is a symlink to .* which is not a Foundry archive"):
        save(link)
    assert f.read_text() == "x" and (user / "x").exists() and link.is_symlink()


def test_directory_appearing_during_save_is_not_clobbered(tmp_path):
    path = tmp_path / "x"
    with pytest.raises(ArchiveError, match="refusing to replace"):
        with ArchiveWriter(path) as w:
            w.add_bytes("a", b"1")
            path.mkdir()
            (path / "user.txt").write_text("mine")
            w.commit(fingerprint=fp(), meta={})
    assert (path / "user.txt").read_text() == "mine"
    assert entries(tmp_path) == {"x", ".x.lock"}


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_leaving_with_block_by_exception_leaves_nothing(tmp_path, exc):
    path = tmp_path / "x"
    with pytest.raises(exc):
        with ArchiveWriter(path) as w:
            w.add_bytes("modules/a.cubin", CUBIN)
            raise exc("boom")
    assert not os.path.lexists(path)
    assert entries(tmp_path) == {".x.lock"}


def test_failed_resave_keeps_the_old_archive(arch):
    path, digest = arch
    before = entries(path.parent)
    with pytest.raises(RuntimeError):
        with ArchiveWriter(path) as w:
            w.add_bytes("modules/other.cubin", b"1")
            raise RuntimeError("capture failed")
    assert open_archive(path).digest == digest
    assert entries(path.parent) == before


def test_leaving_without_commit_leaves_nothing(tmp_path):
    with ArchiveWriter(tmp_path / "x") as w:
        w.add_bytes("a", b"1")
    assert entries(tmp_path) == {".x.lock"}


def test_writer_misuse(tmp_path):
    w = ArchiveWriter(tmp_path / "x")
    with pytest.raises(ArchiveError, match="use ArchiveWriter as a context manager"):
        w.add_bytes("a", b"1")
    with w:
        with pytest.raises(ArchiveError, match="meta.s: cannot store a value of type set"):
            w.commit(fingerprint=fp(), meta={"s": {1}})
        with pytest.raises(ArchiveError, match="non-finite"):
            w.commit(fingerprint=fp(), meta={"x": float("inf")})
        with pytest.raises(ArchiveError, match="key 3 is not a string"):
            w.commit(fingerprint=fp(), meta={3: "x"})
        with pytest.raises(ArchiveError, match="meta must be a dict"):
            w.commit(fingerprint=fp(), meta=[])
        with pytest.raises(ArchiveError, match="fingerprint must be a dict"):
            w.commit(fingerprint=None, meta={})
        with pytest.raises(ArchiveError, match="layout.json.x: cannot store"):
            w.add_json("layout.json", {"x": object()})
        digest = w.commit(fingerprint=fp(), meta={"ok": True})  # earlier refusals left it usable
        assert w.digest == digest
        with pytest.raises(ArchiveError, match="already committed"):
            w.add_bytes("b", b"2")
        with pytest.raises(ArchiveError, match="already committed"):
            w.commit(fingerprint=fp(), meta={})
    with pytest.raises(ArchiveError, match="cannot be entered twice"):
        w.__enter__()
    assert open_archive(tmp_path / "x").meta == {"ok": True}


def test_stale_leftovers_are_cleaned_by_the_next_commit(arch):
    path, digest = arch
    parent = path.parent
    stale = [".rank0.tmp-99999-deadbeef", ".rank0.link-1-00000000", ".rank0.0123456789abcdef"]
    for name in stale[:1] + stale[2:]:
        (parent / name).mkdir()
        (parent / name / "junk").write_bytes(b"x")
    (parent / stale[1]).symlink_to(".rank0.0123456789abcdef")
    unrelated = [".rank00.0123456789abcdef", ".rank0.tmp-notours", "rank1", ".rank0.lock.bak"]
    for name in unrelated:
        (parent / name).mkdir()
    new = save(path)
    assert entries(parent) == {"rank0", f".rank0.{new[:16]}", ".rank0.lock", *unrelated}


def test_remove_archive(arch):
    path, digest = arch
    remove_archive(path)
    assert not os.path.lexists(path)
    assert entries(path.parent) == {".rank0.lock"}
    remove_archive(path)  # nothing there is fine
    with pytest.raises(ArchiveNotFound, match="no Foundry archive at .*run SAVE first"):
        open_archive(path)


def test_ranks_do_not_interfere(tmp_path):
    d0 = save(tmp_path / "rank1")
    d1 = save(tmp_path / "rank10")
    d2 = save(tmp_path / "rank1")
    assert open_archive(tmp_path / "rank10").digest == d1
    assert open_archive(tmp_path / "rank1").digest == d2 != d0


# ---------------------------------------------------------------------------------------------- locking


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "x"
    with ArchiveWriter(path) as w:
        with pytest.raises(ArchiveError, match=rf"another SAVE \(pid {os.getpid()}\) holds .*\.x\.lock"):
            with ArchiveWriter(path):
                pass
        with pytest.raises(ArchiveError, match="timed out after 0.2s"):
            with ArchiveWriter(path, lock_timeout=0.2):
                pass
        with pytest.raises(ArchiveError, match="cannot remove"):
            remove_archive(path)
        w.add_bytes("a", b"1")
        w.commit(fingerprint=fp(), meta={"by": "first"})
    assert open_archive(path).meta == {"by": "first"}


def test_second_writer_waits_with_a_timeout(tmp_path):
    path = tmp_path / "x"
    released = []

    def first():
        with ArchiveWriter(path) as w:
            started.set()
            time.sleep(0.3)
            w.add_bytes("a", b"first")
            w.commit(fingerprint=fp(), meta={"by": "first"})
            released.append(time.monotonic())

    started = threading.Event()
    t = threading.Thread(target=first)
    t.start()
    started.wait()
    with ArchiveWriter(path, lock_timeout=10) as w:
        got = time.monotonic()
        w.add_bytes("a", b"second")
        w.commit(fingerprint=fp(), meta={"by": "second"})
    t.join()
    assert released and got >= released[0]
    ar = open_archive(path)
    assert ar.meta == {"by": "second"} and ar.read_bytes("a") == b"second"


# ------------------------------------------------------------------------------- expected_version


def test_published_version_names_each_publication(tmp_path):
    path = tmp_path / "x"
    assert published_version(path) is None
    save(path, meta={"by": "first"})
    first = published_version(path)
    assert first is not None and published_version(path) == first
    save(path, meta={"by": "second"})
    assert published_version(path) not in (None, first)
    remove_archive(path)
    assert published_version(path) is None


def test_a_save_expecting_no_archive_keeps_one_published_meanwhile(tmp_path):
    path = tmp_path / "x"
    expected = published_version(path)  # both replicas decide on an empty directory
    save(path, meta={"by": "first"}, expected_version=expected)
    before = entries(tmp_path)
    with pytest.raises(ArchiveSuperseded, match="another SAVE published it since"):
        save(path, meta={"by": "second"}, expected_version=expected)
    assert open_archive(path).meta == {"by": "first"}
    assert entries(tmp_path) == before  # no scratch directory left, the lock released:
    save(path, meta={"by": "third"})  # a later SAVE (default: replace) takes the lock at once
    assert open_archive(path).meta == {"by": "third"}


def test_a_save_expecting_the_archive_it_saw_replaces_it(tmp_path):
    path = tmp_path / "x"
    save(path, meta={"by": "old"})  # an archive this start refused (another configuration)
    seen = published_version(path)
    save(path, meta={"by": "new"}, expected_version=seen)
    assert open_archive(path).meta == {"by": "new"}
    with pytest.raises(ArchiveSuperseded):  # what it saw is gone now
        save(path, meta={"by": "late"}, expected_version=seen)


def test_the_version_is_checked_under_the_lock(tmp_path):
    """The second writer waits for the first one's lock, then finds its publication: of two SAVEs
    that decided at the same moment, exactly one publishes."""
    path = tmp_path / "x"
    expected = published_version(path)
    holding, results = threading.Event(), []

    def first():
        with ArchiveWriter(path, expected_version=expected) as w:
            holding.set()
            time.sleep(0.2)
            w.add_bytes("a", b"first")
            w.commit(fingerprint=fp(), meta={"by": "first"})

    t = threading.Thread(target=first)
    t.start()
    assert holding.wait(10)
    try:
        with ArchiveWriter(path, lock_timeout=10, expected_version=expected) as w:
            results.append("entered")
            w.add_bytes("a", b"second")
            w.commit(fingerprint=fp(), meta={"by": "second"})
    except ArchiveSuperseded:
        results.append("superseded")
    t.join()
    assert results == ["superseded"]
    assert open_archive(path).meta == {"by": "first"}


# ---------------------------------------------------------------------------------------------- docs


def test_docs_match_the_code():
    doc = (REPO / "docs" / "archive-format.md").read_text()
    for key in ["format", "format_version", "foundry_version", "created_utc", "fingerprint", "files", "meta"]:
        assert f"`{key}`" in doc, key
    for field in FINGERPRINT_FIELDS:
        assert f"`{field}`" in doc, field
    assert f"`format_version` = {FORMAT_VERSION}" in doc or f"format_version = {FORMAT_VERSION}" in doc
    for text in [
        "is newer than this Foundry reads",
        "does not match the pinned trust.archive_digest",
        "is not listed in the manifest",
        "fails its sha256 check",
        "listed in the manifest is missing",
        "refusing to replace",
        "holds",
        "64 MiB",
    ]:
        assert text in doc, text


# ---------------------------------------------------------------------------------------------- bounded reads


def test_verified_bytes_are_kept_no_reread(arch):
    path, _ = arch
    ar = open_archive(path)
    (real(path) / "modules/abc.cubin").write_bytes(b"swapped after verification")
    shutil.rmtree(real(path) / "graphs")
    assert ar.read_bytes("modules/abc.cubin") == CUBIN
    assert ar.read_bytes("graphs/0003.bin") == GRAPH


def test_reads_are_bounded_by_the_declared_size(tmp_path, monkeypatch):
    from foundry_core import archive

    requested = []
    real_read = os.read

    def spy(fd, n):
        data = real_read(fd, n)
        requested.append((n, len(data)))
        return data

    monkeypatch.setattr(os, "read", spy)  # os.read itself: each archive submodule calls it
    f = tmp_path / "f"
    for content, declared, ok in [
        (b"abcd", 4, True),
        (b"abcd", 3, False),
        (b"abcd", 5, False),
        (b"", 0, True),
    ]:
        f.write_bytes(content)
        requested.clear()
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
        assert max(n for n, _ in requested) <= declared + 1
        assert sum(got for _, got in requested) <= declared + 1


def test_open_reads_each_member_once_within_bounds(arch, monkeypatch):
    path, _ = arch
    requested = []
    real_read = os.read

    def spy(fd, n):
        data = real_read(fd, n)
        requested.append((n, len(data)))
        return data

    monkeypatch.setattr(os, "read", spy)  # os.read itself: each archive submodule calls it
    ar = open_archive(path)
    manifest_size = (real(path) / "manifest.json").stat().st_size
    sizes = [manifest_size, *ar.files.values()]
    assert sum(got for _, got in requested) == sum(sizes)  # each file read exactly once
    assert max(n for n, _ in requested) <= max(sizes) + 1


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
    m = manifest_of(tmp_path / "a")
    entry = m["files"]["modules/big.cubin"]
    member = real(tmp_path / "a") / "modules" / "big.cubin"
    stored = member.read_bytes()
    first = entry["encoding"]["chunks"][0]
    bad = zlib.compress(b"\0" * (archive_mod.COMPRESS_CHUNK - 1))  # one byte short
    member.write_bytes(bad + stored[first:])
    entry["encoding"]["chunks"][0] = len(bad)
    entry["size"] = len(bad) + len(stored) - first
    entry["sha256"] = hashlib.sha256(member.read_bytes()).hexdigest()
    del m["manifest_sha256"]
    m["manifest_sha256"] = archive_mod._self_checksum(m)
    (real(tmp_path / "a") / "manifest.json").write_bytes(archive_mod._manifest_bytes(m))
    with pytest.raises(ArchiveError, match=r"modules/big.cubin.*does not decompress"):
        open_archive(tmp_path / "a")


def test_manifest_self_checksum_fast_and_reformatted(tmp_path):
    """A manifest as SAVE wrote it passes by hashing its bytes with the checksum line cut out; the
    same JSON laid out differently (a tool re-indented it) still passes, the slow way; a changed
    value fails both ways."""
    from foundry_core import archive as archive_mod

    save(tmp_path / "a", files={"layout.json": b"{}"}, meta={"k": [1, 2, 3]})
    mpath = real(tmp_path / "a") / "manifest.json"
    raw = mpath.read_bytes()
    m = json.loads(raw)
    assert archive_mod._self_checksum_matches(raw, m)
    relaid = json.dumps(m, indent=4).encode()
    assert archive_mod._self_checksum_matches(relaid, m)
    mpath.write_bytes(relaid)
    open_archive(tmp_path / "a")
    changed = dict(m, meta={"k": [1, 2, 4]})
    for text in (raw.replace(b"3\n", b"4\n"), json.dumps(changed, indent=4).encode()):
        assert not archive_mod._self_checksum_matches(text, json.loads(text))


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
