"""Issue 19, without a GPU: the disk fills up during a SAVE (graph archive, record, carried caches) or a
file size limit stops its writes: one line, nothing partial (model: save_model.py)."""

from __future__ import annotations

import errno
import logging
import os

import pytest
from save_model import (
    ENGINE,
    FLAVORS,
    LINUX_ONLY,
    archive_entries,
    cfg_for,
    engine_save,
    fill_caches,
    helper_json,
    one_line,
    record_suffix,
    record_tag,
    write_graph_archive,
    write_record,
)

from foundry_core.archive import (
    ArchiveError,
    ArchiveNotFound,
    open_archive,
)
from foundry_core.engine import decide

pytestmark = LINUX_ONLY


def _enospc_on(monkeypatch, wanted) -> list[str]:
    """``os.write`` fails with ENOSPC for the files whose path ``wanted(path)`` accepts."""
    real_write = os.write
    hits: list[str] = []

    def write(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if wanted(path):
            hits.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    return hits


FULL_AT = {
    "member": (lambda p: p.endswith("memory/00003.bin"), False),
    "compressed member": (lambda p: p.endswith("memory/00003.bin"), True),
    "manifest": (lambda p: p.endswith("/manifest.json"), False),
}


@pytest.mark.parametrize("previous", [True, False], ids=["replacing", "first"])
@pytest.mark.parametrize("where", list(FULL_AT))
def test_a_full_disk_fails_the_save_in_one_line_and_leaves_nothing_partial(
    tmp_path, monkeypatch, log_records, where, previous
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    if previous:
        old = write_graph_archive(path, "old")
    before = archive_entries(path) if previous else {".rank0.lock"}
    wanted, compress = FULL_AT[where]
    hits = _enospc_on(monkeypatch, wanted)
    with pytest.raises(ArchiveError) as err:
        write_graph_archive(path, "new", compress=compress)
    monkeypatch.undo()
    assert hits, "the full disk was never hit"
    message = str(err.value)
    assert one_line(message) and message.endswith(": No space left on device")
    assert str(path.parent) in message
    # Nothing partial: the previous archive as it was (or still none), no scratch directory.
    assert archive_entries(path) == before
    if previous:
        assert open_archive(path).digest == old
    else:
        with pytest.raises(ArchiveNotFound):
            open_archive(path)

    # The plugins' policy for that error: auto serves on with one warning line; save stops.
    records = log_records("faults.test", logging.WARNING)
    decide.save_failed(cfg, 0, err.value, logging.getLogger("faults.test"))
    (warning,) = [r.getMessage() for r in records]
    assert one_line(warning) and f"SAVE failed ({message})" in warning
    with pytest.raises(ArchiveError) as again:
        decide.save_failed(cfg_for(cfg.archive_dir, "save"), 0, err.value)
    assert again.value is err.value


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_full_disk_while_writing_the_record_keeps_the_previous_record(
    tmp_path, monkeypatch, full_disk_at_flush, flavor
):
    cfg = cfg_for(tmp_path / "archive")
    write_record(cfg, flavor, "old")
    full_disk_at_flush()
    with pytest.raises(OSError) as err:
        write_record(cfg, flavor, "new")
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert record_tag(cfg, flavor) == "old"
    assert sorted(p.name for p in cfg.archive_dir.iterdir()) == [f"rank0{record_suffix(flavor)}"]


def test_a_full_disk_while_packing_the_carried_caches_leaves_no_caches_archive(
    tmp_path, caches_machine, monkeypatch, log_records
):
    from foundry_core.engine import CacheHandover

    records = log_records("faults.test", logging.WARNING)
    cfg = cfg_for(tmp_path / "archive")
    saver = CacheHandover(cfg, 0, ["triton"], ENGINE, log=logging.getLogger("faults.test"))
    saver.begin()
    fill_caches(saver.dirs)
    hits = _enospc_on(monkeypatch, lambda p: "/caches/triton/" in p)
    assert saver.save(device=0) is None  # the graphs are saved; the caches are not
    monkeypatch.undo()
    assert hits
    assert saver.report["error"].endswith("No space left on device") and one_line(saver.report["error"])
    (warning,) = [r.getMessage() for r in records]
    assert "compile caches not saved" in warning and "No space left on device" in warning
    caches_path = cfg.rank_caches_dir(0)
    assert archive_entries(caches_path) == {f".{caches_path.name}.lock"}
    with pytest.raises(ArchiveNotFound):
        open_archive(caches_path)


def test_a_file_size_limit_fails_the_save_and_the_record_cleanly(tmp_path):
    """The kernel refuses the writes (RLIMIT_FSIZE, as a full disk would): not a stand-in os.write."""
    pytest.importorskip("resource")
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    old = engine_save(cfg, "vllm", "old")
    before = sorted(os.listdir(cfg.archive_dir))
    got = helper_json("fsize", cfg.archive_dir, 64 << 10)
    assert one_line(got["archive_error"]) and got["archive_error"].endswith(": File too large")
    assert got["record_errno"] == errno.EFBIG
    assert sorted(os.listdir(cfg.archive_dir)) == before  # no scratch directory, no temporary record
    assert open_archive(path).digest == old and record_tag(cfg, "vllm") == "old"
