"""Issue 19, without a GPU: two replicas SAVE at the same moment on one empty archive directory, and an
archive is replaced while a process holds the old one (model: save_model.py)."""

from __future__ import annotations

import json
import os

import pytest
from save_model import (
    FLAVORS,
    LINUX_ONLY,
    MEMBERS,
    MODEL,
    archive_entries,
    blob,
    cfg_for,
    engine_save,
    helper,
    machine_fingerprint,
    next_auto_start,
)

import foundry_core.api as api
from foundry_core.archive import (
    open_archive,
)
from foundry_core.engine import decide

pytestmark = LINUX_ONLY


# --- two replicas start at the same moment on one empty archive directory ---------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_two_replicas_saving_at_the_same_moment_publish_exactly_one_archive(tmp_path, cpu_machine, flavor):
    cfg = cfg_for(tmp_path / "archive")
    go = tmp_path / "go"
    procs = {tag: helper("replica", cfg.archive_dir, flavor, tag, go) for tag in ("a", "b")}
    try:
        for proc in procs.values():  # both decided SAVE on the empty directory before either saved
            assert proc.stdout.readline().split() == ["decided", "save"]
        go.touch()
        outs = {tag: proc.communicate(timeout=60) for tag, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for tag, proc in procs.items():
        assert proc.returncode == 0, outs[tag][1][-3000:]  # both serve
    events = {tag: outs[tag][0].split(maxsplit=1) for tag in procs}
    published = [tag for tag, (event, _) in events.items() if event == "published"]
    kept = [tag for tag, (event, _) in events.items() if event == "kept"]
    # The second waited for the first one's lock, found its archive and kept it, with no warning.
    assert len(published) == 1 and len(kept) == 1, events
    (winner,), (loser,) = published, kept
    assert json.loads(events[loser][1]) == []
    digest = events[winner][1].strip()
    # One archive, the winner's, whole; its record beside it; nothing left of the refused SAVE.
    assert open_archive(cfg.rank_archive_dir(0)).digest == digest
    assert next_auto_start(cfg, flavor) == ("load", winner)
    assert archive_entries(cfg.rank_archive_dir(0)) == {"rank0", ".rank0.lock", f".rank0.{digest[:16]}"}


# --- the archive is replaced while a process holds the old one --------------------------------------


def test_a_held_archive_is_unaffected_by_a_newer_save_and_the_next_start_loads_the_new_one(
    tmp_path, cpu_machine
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    first = engine_save(cfg, "vllm", "v1")
    held, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert reason is None and held.digest == first
    # Where the check's time went, for the start report: open_archive's steps and the rest of it
    assert {"read_s", "hash_s", "inflate_s", "location_s", "fingerprint_s"} <= set(held.open_timings)
    held_version = path.parent / os.readlink(path)

    second = engine_save(cfg, "vllm", "v2")  # another replica, or a later mode = save start
    assert second != first and not held_version.exists()  # the files the holder read are gone
    # The holder goes on with what it verified: the same bytes, and fc.load(archive=held) accepts it.
    assert held.digest == first and held.meta["tag"] == "v1"
    assert all(held.read_bytes(f"memory/{i:05d}.bin") == blob("v1", i) for i in range(MEMBERS))
    api._check_verified(held, path, machine_fingerprint(0, MODEL), None)
    api._check_verified(held, path, machine_fingerprint(0, MODEL), first)  # pinned to what it holds
    # The next start loads the new one.
    assert next_auto_start(cfg, "vllm") == ("load", "v2")
    fresh, _ = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert fresh.digest == second and fresh.read_bytes("memory/00000.bin") == blob("v2", 0)
