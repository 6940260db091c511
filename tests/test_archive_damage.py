"""foundry_core.archive: damaged archives (flipped, truncated, missing or extra files; a manifest that
fails its own checksum) are refused, naming what is wrong; the digest pin (CPU only)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest

from foundry_core.archive import (
    MAX_MANIFEST_BYTES,
    ArchiveError,
    open_archive,
)
from sample_archive import (
    CUBIN,
    GRAPH,
    canonical,
    fp,
    manifest_of,
    real,
    save,
    seal,
)

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


# --- the manifest's own checksum, read fast or re-laid-out ---------------------------------------


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
