"""Property tests: whatever happens to an archive on disk, open_archive raises ArchiveError (and nothing
else) or returns exactly what was saved.

A small valid archive is built once; every example copies it, damages the copy (manifest bytes, manifest
structure, member bytes and lengths, the directory tree) and opens it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from foundry_core.archive import ArchiveError, ArchiveWriter, open_archive
from sample_archive import fp

FP = fp(model={"name": "fuzz", "capture_sizes": [1, 2, 4]})
CONTENTS = {
    "modules/0f.cubin": b"\x7fELF" + bytes(range(200)),
    "graphs/0000.bin": b"graph" * 30,
    "graphs/0001.bin": b"",
    # compressible, over the threshold: stored as a format-2 compressed member (two zlib chunks)
    "modules/1a.cubin": b"\x7fELF" + (bytes(range(256)) * 3 + b"\x00" * 256) * 1100,
    "layout.json": json.dumps(
        {"base": 1 << 44, "cursor": 4096}, sort_keys=True, separators=(",", ":")
    ).encode(),
}
META = {"graphs": [{"id": 0, "file": "graphs/0000.bin"}], "slots": {"kv_pages": 10}}
COMPRESSED = {"modules/1a.cubin"}

SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "base"
    with ArchiveWriter(path) as w:
        for rel, data in CONTENTS.items():
            w.add_bytes(rel, data, compress=rel in COMPRESSED)
        digest = w.commit(fingerprint=FP, meta=META)
    files = json.loads((Path(os.path.realpath(path)) / "manifest.json").read_bytes())["files"]
    assert all(("encoding" in files[rel]) == (rel in COMPRESSED) for rel in CONTENTS)
    src = Path(os.path.realpath(path))
    return src, digest, (src / "manifest.json").read_bytes()


class Copy:
    """A fresh copy of the base archive directory, removed afterwards."""

    def __init__(self, base):
        self.src, self.digest, self.manifest = base

    def __enter__(self) -> Path:
        self._tmp = tempfile.mkdtemp(prefix="foundry-fuzz-")
        self.path = Path(self._tmp) / "a"
        shutil.copytree(self.src, self.path)
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self._tmp, ignore_errors=True)


def open_or_error(path: Path, **kw):
    """open_archive must raise ArchiveError or return an archive; any other exception fails the test."""
    try:
        return open_archive(path, **kw)
    except ArchiveError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        return None


def assert_saved_content(ar) -> None:
    """A returned archive's members are exactly the saved ones, byte for byte."""
    assert ar.files == {rel: len(data) for rel, data in CONTENTS.items()}
    for rel, data in CONTENTS.items():
        assert ar.read_bytes(rel) == data


# ---------------------------------------------------------------------------------------------- manifest bytes

byte_edits = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]),
        st.integers(min_value=0, max_value=1 << 16),
        st.integers(min_value=0, max_value=255),
    ),
    min_size=1,
    max_size=4,
)


def edit_bytes(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for kind, pos, val in edits:
        i = pos % (len(b) + 1)
        if kind == "flip" and i < len(b):
            b[i] ^= 1 << (val % 8)
        elif kind == "set" and i < len(b):
            b[i] = val
        elif kind == "insert":
            b[i:i] = bytes([val])
        elif kind == "delete" and i < len(b):
            del b[i]
        elif kind == "truncate":
            del b[i:]
        elif kind == "dup":
            b[i:i] = b[i : i + val]
    return bytes(b)


@settings(max_examples=700, **SETTINGS)
@given(edits=byte_edits)
def test_manifest_byte_damage(base, edits):
    with Copy(base) as path:
        original = (path / "manifest.json").read_bytes()
        damaged = edit_bytes(original, edits)
        (path / "manifest.json").write_bytes(damaged)
        ar = open_or_error(path)
        if ar is not None:
            # Unauthenticated manifest text (meta, timestamps) may change; member bytes never.
            assert_saved_content(ar)
            assert ar.digest == hashlib.sha256(damaged).hexdigest()
        pinned = open_or_error(path, expected_digest=base[1])
        if damaged != original:
            assert pinned is None
        else:
            assert_saved_content(pinned)


# ---------------------------------------------------------------------------------------------- manifest structure


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=700, **SETTINGS)
@given(data=st.data())
def test_manifest_structure_damage(base, data):
    with Copy(base) as path:
        manifest = json.loads(base[2])
        paths = list(_paths(manifest))
        target = data.draw(st.sampled_from(paths), label="target")
        action = data.draw(st.sampled_from(["replace", "delete", "add", "rename"]), label="action")
        value = data.draw(json_values, label="value")
        if not target:
            manifest = value
        else:
            parent = manifest
            for k in target[:-1]:
                parent = parent[k]
            last = target[-1]
            if action == "replace" or isinstance(parent, list):
                parent[last] = value
            elif action == "delete":
                del parent[last]
            elif action == "add":
                parent[data.draw(st.text(max_size=12), label="new key")] = value
            else:
                parent[data.draw(st.text(max_size=12), label="new name")] = parent.pop(last)
        raw = json.dumps(manifest, sort_keys=True, indent=1).encode()
        (path / "manifest.json").write_bytes(raw)
        ar = open_or_error(path)
        if ar is not None:
            assert_saved_content(ar)
            assert ar.manifest == manifest
        pinned = open_or_error(path, expected_digest=base[1])
        assert pinned is None or raw == base[2]


@settings(max_examples=300, **SETTINGS)
@given(doc=json_values, raw=st.binary(max_size=300))
def test_arbitrary_manifest_documents(base, doc, raw):
    with Copy(base) as path:
        for blob in (json.dumps(doc).encode(), raw):
            (path / "manifest.json").write_bytes(blob)
            assert open_or_error(path) is None


@settings(max_examples=300, **SETTINGS)
@given(names=st.lists(st.text(min_size=0, max_size=30), min_size=1, max_size=3), size=st.integers(-5, 10))
def test_arbitrary_member_names(base, names, size):
    with Copy(base) as path:
        manifest = json.loads(base[2])
        for name in names:
            manifest["files"][name] = {
                "size": size,
                "sha256": hashlib.sha256(b"x" * max(size, 0)).hexdigest(),
            }
        (path / "manifest.json").write_text(json.dumps(manifest))
        for name in names:
            try:
                p = path / name
                if name and p.resolve().is_relative_to(path.resolve()) and not p.exists() and size >= 0:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_bytes(b"x" * size)
            except (OSError, ValueError):
                pass
        ar = open_or_error(path)
        if ar is not None:
            # Only a name that really is a clean relative member can have been accepted.
            for name in names:
                assert name in ar.files and ar.read_bytes(name) == b"x" * size
                assert not name.startswith("/") and ".." not in name.split("/")


# ---------------------------------------------------------------------------------------------- members and tree


@settings(max_examples=700, **SETTINGS)
@given(rel=st.sampled_from(sorted(CONTENTS)), edits=byte_edits)
def test_member_byte_damage(base, rel, edits):
    with Copy(base) as path:
        damaged = edit_bytes(CONTENTS[rel], edits)
        assume(damaged != CONTENTS[rel])
        (path / rel).write_bytes(damaged)
        with pytest.raises(ArchiveError) as ei:
            open_archive(path)
        assert repr(rel) in str(ei.value)


@settings(max_examples=300, **SETTINGS)
@given(
    rel=st.sampled_from(sorted(CONTENTS)),
    action=st.sampled_from(["remove", "dir", "symlink", "fifo", "extra", "extra-nested", "hardlink-extra"]),
    extra=st.text(alphabet="abcxyz._-", min_size=1, max_size=8),
)
def test_tree_damage(base, rel, action, extra):
    with Copy(base) as path:
        target = path / rel
        if action == "remove":
            target.unlink()
        elif action == "dir":
            target.unlink()
            target.mkdir()
        elif action == "symlink":
            outside = path.parent / "outside"
            outside.write_bytes(CONTENTS[rel])
            target.unlink()
            target.symlink_to(outside)
        elif action == "fifo":
            target.unlink()
            os.mkfifo(target)
        else:
            name = path / ("graphs" if action == "extra-nested" else ".") / extra
            assume(not name.exists() and extra not in (".", ".."))
            if action == "hardlink-extra":
                os.link(target, name)
            else:
                name.write_bytes(b"extra")
        assert open_or_error(path) is None


# ---------------------------------------------------------------------------------------------- writer round trip

member_names = st.lists(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF), min_size=1, max_size=12).map(
        lambda s: s.strip("/")
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, **SETTINGS)
@given(names=member_names, blobs=st.lists(st.binary(max_size=64), min_size=4, max_size=4), meta=json_values)
def test_whatever_the_writer_accepts_reads_back_identically(names, blobs, meta):
    with tempfile.TemporaryDirectory(prefix="foundry-fuzz-") as tmp:
        path = Path(tmp) / "a"
        written = {}
        with ArchiveWriter(path) as w:
            for name, blob in zip(names, blobs):
                try:
                    w.add_bytes(name, blob)
                    written[name] = blob
                except ArchiveError:
                    pass
            digest = w.commit(fingerprint=FP, meta={"m": meta})
        ar = open_archive(path, expected_digest=digest, expected_fingerprint=FP)
        assert ar.files == {k: len(v) for k, v in written.items()}
        for k, v in written.items():
            assert ar.read_bytes(k) == v
        assert ar.meta == json.loads(json.dumps({"m": meta}))
