"""The carried-caches hand-over's own paths (foundry_core.engine.caches.unpack and the archive reads
under it): temporary names that are taken, directories reused from one member to the next, work
spread on threads. CPU only; the machine fingerprint is the fixed one of tests/conftest.py."""

import errno
import itertools
import os
import stat
import threading

import pytest

from foundry_core.archive import codec, reader
from foundry_core.engine import caches

ENGINE = {"name": "testengine", "testengine": "1.0"}


@pytest.fixture(autouse=True)
def machine(caches_machine):
    return caches_machine


def test_unpack_steps_around_a_temporary_name_left_by_an_earlier_process(tmp_path, monkeypatch):
    # The first name tried for each file is taken (a crashed process with the same id left it):
    # the file goes through tempfile's random names instead, still gets its recorded mode and
    # time, and the leftovers are not touched.
    saved = caches.CacheDirs.create(["tvm-ffi"], label="save")
    so = saved.path("tvm-ffi") / "mod" / "mod.so"
    so.parent.mkdir()
    so.write_bytes(b"\x7fELF-so" * 100)
    so.chmod(0o755)
    os.utime(so, ns=(1_600_000_000_000_000_000,) * 2)
    (saved.path("tvm-ffi") / "mod" / "build.ninja").write_text("rule cc")
    caches.pack(tmp_path / "rank0.caches", saved, device=0, engine=ENGINE)

    loaded = caches.CacheDirs.create(["tvm-ffi"], label="load")
    folder = loaded.path("tvm-ffi") / "mod"
    folder.mkdir()
    stale = [folder / f".foundry-{os.getpid()}-{i}" for i in range(2)]
    for f in stale:
        f.write_bytes(b"left over")
    monkeypatch.setattr(caches, "_TMP_SEQ", itertools.count())
    caches.unpack(tmp_path / "rank0.caches", loaded, device=0, engine=ENGINE)

    got = folder / "mod.so"
    assert got.read_bytes() == so.read_bytes()
    assert stat.S_IMODE(got.stat().st_mode) == 0o700  # tempfile made it 0o600
    assert got.stat().st_mtime_ns == 1_600_000_000_000_000_000
    assert stat.S_IMODE((folder / "build.ninja").stat().st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["build.ninja", "mod.so", *(f.name for f in stale)]
    )
    assert all(f.read_bytes() == b"left over" for f in stale)
    assert loaded.new_files()["total"] == 0


def test_members_of_a_folder_swapped_for_a_symlink_are_not_read_through_it(tmp_path):
    # Directories are kept open from one member to the next; one not yet opened is still opened
    # without following a symlink, wherever it sits in the chain.
    root = tmp_path / "a"
    for d in ("x/b", "x/c", "elsewhere"):
        (root / d).mkdir(parents=True)
    (root / "x" / "b" / "one").write_bytes(b"1")
    (root / "elsewhere" / "two").write_bytes(b"2")
    os.rmdir(root / "x" / "c")
    (root / "x" / "c").symlink_to(root / "elsewhere")
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    dirs = reader._DirFds(root_fd)
    try:
        fd = reader._open_member(root_fd, "x/b/one", dirs)
        assert os.read(fd, 8) == b"1"
        os.close(fd)
        with pytest.raises(OSError) as e:
            reader._open_member(root_fd, "x/c/two", dirs)
        assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
        fd = reader._open_member(root_fd, "x/b/one", dirs)  # the chain is still usable afterwards
        os.close(fd)
    finally:
        dirs.close()
        os.close(root_fd)
    assert dirs.fds == []


def test_work_on_threads_keeps_order_and_raises_what_a_thread_raised():
    items = list(range(64))
    assert codec._map_on_threads(lambda x: x * x, items, 4, "t", [4 << 20] * 64) == [x * x for x in items]

    def boom(x):
        if x == 37:
            raise ValueError("item 37")
        return x

    with pytest.raises(ValueError, match="item 37"):
        codec._map_on_threads(boom, items, 4, "t", [4 << 20] * 64)
    # Too little work for a thread: all of it on the caller's.
    where = codec._map_on_threads(lambda x: threading.current_thread(), items, 4, "t", [1024] * 64)
    assert set(where) == {threading.current_thread()}
