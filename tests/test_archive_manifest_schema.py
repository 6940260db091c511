"""foundry_core.archive: the manifest's format version, field types and member names are checked
before anything is read; docs/archive-format.md matches the code (CPU only)."""

from __future__ import annotations

import hashlib
import json

import pytest

from foundry_core.archive import (
    FORMAT_VERSION,
    MISSING,
    ArchiveError,
    ArchiveWriter,
    open_archive,
)
from foundry_core.fingerprint import (
    FINGERPRINT_FIELDS,
)
from sample_archive import (
    REPO,
    manifest_of,
    real,
    write_manifest,
)

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
