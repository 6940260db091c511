"""Issue 19, without a GPU: a SAVE SIGKILLed at each of its steps, and what a killed SAVE can leave
beside a record, never loaded (the model of the plugins' SAVE is in save_model.py)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
from save_model import (
    FLAVORS,
    LINUX_ONLY,
    MODEL,
    SGLANG_ARGS,
    VLLM_FP,
    archive_entries,
    archive_tag,
    blob,
    cfg_for,
    engine_save,
    helper,
    next_auto_start,
    one_line,
    record_suffix,
    write_graph_archive,
    write_record,
)

import foundry_core.api as api
from foundry_core.engine import decide
from foundry_sglang_plugin import archive as sglang_records
from foundry_vllm_plugin import archive as vllm_records

pytestmark = LINUX_ONLY


KILL_POINTS = ["capture", "member", "manifest", "rename", "swap", "swapped", "record-temp", "record-done"]
# After a kill at each point, when an older SAVE ("old") had finished: the next auto start of each
# engine, and the archive then at the archive path. Without an older SAVE "old" reads as nothing.
AFTER_KILL = {
    "capture": ({"vllm": ("load", "old"), "sglang": ("save", None)}, "old"),  # SGLang dropped its sidecar
    "member": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),  # persisting
    "manifest": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),
    "rename": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),  # publishing the core archive
    "swap": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),
    "swapped": ({"vllm": ("save", None), "sglang": ("save", None)}, "new"),  # published, no record yet
    "record-temp": ({"vllm": ("save", None), "sglang": ("save", None)}, "new"),  # publishing the record
    "record-done": ({"vllm": ("load", "new"), "sglang": ("load", "new")}, "new"),
}


def kill_at(archive_dir: Path, flavor: str, tag: str, point: str) -> None:
    """Run an engine SAVE in a subprocess, stop it at ``point`` and SIGKILL it there."""
    proc = helper("save", archive_dir, flavor, tag, point)
    try:
        line = proc.stdout.readline()
        assert line.split()[:1] == ["paused"], f"the SAVE never reached {point!r}: {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]


@pytest.mark.parametrize("previous", [True, False], ids=["replacing", "first"])
@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_save_killed_at_any_step_leaves_no_loadable_partial_archive(
    tmp_path, cpu_machine, flavor, point, previous
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    if previous:
        engine_save(cfg, flavor, "old")
    kill_at(cfg.archive_dir, flavor, "new", point)

    starts, on_disk = AFTER_KILL[point]
    want_start = starts[flavor]
    if not previous:
        on_disk = None if on_disk == "old" else on_disk
        want_start = ("save", None) if want_start == ("load", "old") else want_start
    # Never a record beside an archive it does not belong to, nor one whose archive is refused.
    assert next_auto_start(cfg, flavor) == want_start
    assert archive_tag(path) == on_disk  # the previous archive or the new one, complete, or none
    if point == "record-temp":  # a half-written record is a temporary sibling, never the record
        assert [p.name for p in cfg.archive_dir.glob(f"rank0{record_suffix(flavor)}.*.tmp")]

    # The SAVE that follows (auto decided SAVE, or mode = save) goes through and cleans up after the
    # killed one.
    digest = engine_save(cfg, flavor, "final")
    assert next_auto_start(cfg, flavor) == ("load", "final")
    assert archive_entries(path) == {"rank0", ".rank0.lock", f".rank0.{digest[:16]}"}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_later_save_removes_the_temporary_of_a_killed_record_write(tmp_path, cpu_machine, flavor):
    cfg = cfg_for(tmp_path / "archive")
    engine_save(cfg, flavor, "old")
    kill_at(cfg.archive_dir, flavor, "new", "record-temp")
    assert list(cfg.archive_dir.glob("*.tmp"))  # what the killed SAVE left
    engine_save(cfg, flavor, "final")
    assert next_auto_start(cfg, flavor) == ("load", "final")
    assert sorted(p.name for p in cfg.archive_dir.glob("*.tmp")) == []


# What a killed or interrupted SAVE (or a copy of one) can leave at the archive path, beside a record
# that says the SAVE finished; and the reason fc.verify gives for it.
LEFTOVERS = {
    "nothing": "no Foundry archive at",
    "scratch only": "no Foundry archive at",
    "dangling link": "is a dangling symlink to '.rank0.0123456789abcdef'",
    "no manifest": "manifest.json is missing",
    "truncated member": "file 'memory/00001.bin' is 4089 bytes, the manifest lists 4096",
}


def _leave(path: Path, state: str) -> None:
    if state == "scratch only":  # killed while writing: only the scratch directory exists
        (path.parent / ".rank0.tmp-4242-0123abcd" / "memory").mkdir(parents=True)
        (path.parent / ".rank0.tmp-4242-0123abcd" / "memory" / "00000.bin").write_bytes(blob("x", 0))
    elif state == "dangling link":  # the version it pointed to was removed
        path.symlink_to(".rank0.0123456789abcdef")
    elif state == "no manifest":  # members copied, manifest not (or a plain directory filled by hand)
        (path / "memory").mkdir(parents=True)
        (path / "memory" / "00000.bin").write_bytes(blob("x", 0))
    elif state == "truncated member":
        write_graph_archive(path, "old")
        member = Path(os.path.realpath(path)) / "memory" / "00001.bin"
        member.write_bytes(member.read_bytes()[:-7])


@pytest.mark.parametrize("state", list(LEFTOVERS))
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_record_beside_a_missing_or_partial_archive_never_loads(tmp_path, monkeypatch, flavor, state):
    def no_gpu(*args, **kwargs):
        raise AssertionError("the archive was refused only after the machine was queried")

    monkeypatch.setattr(api, "current_fingerprint", no_gpu)
    cfg = cfg_for(tmp_path / "archive")
    write_record(cfg, flavor, "old")
    path = cfg.rank_archive_dir(0)
    _leave(path, state)

    # The plugin's own check first: vLLM looks for the core archive's directory, SGLang trusts the
    # sidecar and leaves the archive to fc.verify.
    if flavor == "vllm":
        mode, _, why = vllm_records.resolve_mode(cfg, 0, VLLM_FP)
        no_directory = state in ("nothing", "scratch only", "dangling link")
        assert mode == ("save" if no_directory else "load")
        if no_directory:
            assert why.endswith(f"has no core archive at {path}")
            with pytest.raises(vllm_records.ArchiveStateError, match="has no core archive") as err:
                vllm_records.resolve_mode(cfg_for(cfg.archive_dir, "load"), 0, VLLM_FP)
            assert one_line(str(err.value))
    else:
        assert sglang_records.decide_mode(SGLANG_ARGS, cfg) == "load"

    # fc.verify, before any memory exists: refused, naming why, without asking the GPU.
    verified, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert verified is None and LEFTOVERS[state] in reason and one_line(reason)
    # auto (one rank): a warning and a fresh SAVE; load: one line, the start stops.
    line = decide.after_refusal(cfg, 0, 1, reason, log=logging.getLogger("faults.test"))
    assert line.endswith(f"({reason}); capturing and saving a fresh one")
    with pytest.raises(decide.ArchiveRefused, match="mode = load cannot go on") as err:
        decide.after_refusal(cfg_for(cfg.archive_dir, "load"), 0, 1, reason)
    assert one_line(str(err.value)) and reason in str(err.value)


def test_an_archive_saved_on_another_device_ordinal_is_refused_before_any_memory(tmp_path, cpu_machine):
    """A second replica on the same machine but another GPU (SGLang's --base-gpu-id 1, a vLLM worker
    on cuda:1) passes the fingerprint (same GPU model); the device check refuses it in fc.verify, so
    an auto start SAVEs as a fresh start does instead of sizing its memory for a LOAD that would fail."""
    cfg = cfg_for(tmp_path / "archive")
    write_graph_archive(cfg.rank_archive_dir(0), "on-cuda0")
    verified, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert reason is None and verified.meta["device"] == 0
    verified, reason = decide.verify_archive(cfg, 0, device=1, fingerprint=MODEL, world_size=1)
    assert verified is None and one_line(reason)
    assert "was saved on cuda:0, this process restores on cuda:1" in reason
    assert "CUDA_VISIBLE_DEVICES" in reason  # says what to do
    line = decide.after_refusal(cfg, 0, 1, reason, log=logging.getLogger("faults.test"))
    assert line.endswith("; capturing and saving a fresh one")
    with pytest.raises(decide.ArchiveRefused, match="mode = load cannot go on"):
        decide.after_refusal(cfg_for(cfg.archive_dir, "load"), 0, 1, reason)
