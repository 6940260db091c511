"""foundry_core.archive: publishing an archive (replacing one, refusing to clobber, interrupted SAVE
leaving nothing), the writer's lock and the expected published version (CPU only)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from foundry_core.archive import (
    ArchiveError,
    ArchiveNotFound,
    ArchiveSuperseded,
    ArchiveWriter,
    open_archive,
    published_version,
    remove_archive,
)
from sample_archive import (
    CUBIN,
    entries,
    fp,
    real,
    save,
)

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
