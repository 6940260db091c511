"""Issue 19 fault cases in the SGLang scheduler's session (real SGLang, no GPU).

``fc.verify``, ``fc.save``, ``fc.start_recording`` and ``fc.stop_recording`` are stood in for (they
need the GPU or the native library); the session, its records and the real archive writer are not.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
import pathlib
import threading
import time

import pytest

import foundry_core
from foundry_core.archive import ANY_VERSION, ArchiveWriter, FingerprintMismatch, open_archive
from foundry_sglang_plugin import archive, settings
from foundry_sglang_plugin.session import Session

pytestmark = pytest.mark.sglang

BASE_ARGV = ["--cuda-graph-backend-prefill", "disabled"]
HINT = {"gpu_id": 0, "tp_rank": 0, "dp_rank": None}
SLOTS = {"memory_pool_config": {"max_total_num_tokens": 1024}, "max_mamba_cache_size": None}


@pytest.fixture
def cfg(foundry_toml, tmp_path):
    from foundry_core.config import load_config

    return dataclasses.replace(load_config(foundry_toml), archive_dir=tmp_path / "archive")


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(foundry_core, "start_recording", lambda keep_images=True: None)
    monkeypatch.setattr(foundry_core, "stop_recording", lambda: None)


def _warnings(logged) -> list[str]:
    return [r.getMessage() for r in logged if r.levelno == logging.WARNING]


def _read_only(monkeypatch, directory: pathlib.Path) -> None:
    """Removing anything under ``directory`` fails as on a read-only mount (root ignores modes)."""
    real_unlink = pathlib.Path.unlink

    def unlink(self, *args, **kwargs):
        if directory in self.parents:
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)


def test_auto_with_a_read_only_archive_dir_and_a_refused_archive_serves_on(
    parse, tmp_path, monkeypatch, no_native, logged
):
    toml = tmp_path / "foundry.toml"
    toml.write_text(f'mode = "auto"\narchive_dir = "{tmp_path / "archive"}"\n')
    sa = parse(*BASE_ARGV, foundry=False)
    settings.attach(sa, True, toml)
    cfg = settings.load(sa)
    fp = archive.fingerprint(sa, cfg)
    archive.write_sidecar(cfg, 0, {"fingerprint": fp, "slots": SLOTS, "outputs": {}})  # an older SAVE

    def refuse(path, **kwargs):  # e.g. the driver was upgraded since that SAVE
        raise FingerprintMismatch(
            "archive was saved for driver_version=12080, this machine has 13000; SAVE again on this setup",
            "driver_version",
            12080,
            13000,
        )

    monkeypatch.setattr(foundry_core, "verify", refuse)
    _read_only(monkeypatch, cfg.archive_dir)

    session = Session.begin(sa, HINT)  # the launcher settled LOAD: archive_dir_problem was not asked

    # Expected: the refused archive is not used and the start goes on (capturing as usual; its SAVE
    # then fails in the read-only directory, which auto mode survives), with the refusal's warning.
    assert session.mode == "save"
    assert any("refused (archive was saved for driver_version=12080" in m for m in _warnings(logged))


@pytest.mark.parametrize("mode", ["auto", "save"])
def test_a_sidecar_that_cannot_be_written_after_the_core_archive_serves_on(
    parse, cfg, monkeypatch, full_disk_at_flush, no_native, logged, mode
):
    """The disk fills up between the core archive and the sidecar that marks the SAVE finished."""
    cfg = dataclasses.replace(cfg, mode=mode)
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: "digest")
    full_disk_at_flush()
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.slots, session.graphs = SLOTS, {"decode/size=1": object()}
    if mode == "save":
        with pytest.raises(OSError, match="No space left on device"):
            session.finish()
    else:
        session.finish()
        assert session.report["ok"] is True and session.report["saved"] is False
        assert session.report["save_error"] == "[Errno 28] No space left on device"
        assert any("SAVE failed" in m and "No space left" in m for m in _warnings(logged))
    # Nothing marks a finished SAVE, and no half-written sidecar is left.
    assert archive.read_sidecar(cfg, 0) is None
    assert not list(cfg.archive_dir.glob("*.tmp"))


@pytest.mark.parametrize("mode", ["auto", "save"])
def test_a_defect_in_foundrys_save_code_does_not_stop_an_auto_server(parse, cfg, monkeypatch, logged, mode):
    """A SAVE that fails with an error Foundry did not foresee (as cuda.bindings' TypeError once did
    on the GPU) is a failed SAVE like a full disk: auto serves with the captured graphs."""

    def broken_save(path, **kw):
        raise TypeError("an integer is required")

    cfg = dataclasses.replace(cfg, mode=mode)
    monkeypatch.setattr(foundry_core, "save", broken_save)
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.slots, session.graphs = SLOTS, {"decode/size=1": object()}
    if mode == "save":
        with pytest.raises(TypeError):
            session.finish()
    else:
        session.finish()
        assert session.report["ok"] is True and session.report["saved"] is False
        assert session.report["save_error"] == "TypeError: an integer is required"
        assert any("SAVE failed (TypeError: an integer is required)" in m for m in _warnings(logged))
    assert archive.read_sidecar(cfg, 0) is None


def _archive_writing_save(published: list[str], hold=None):
    """An ``fc.save`` that writes a real archive (the first graph's value as its tag) through the
    archive layer with fc.save's own lock rule; ``hold(tag)`` runs while it holds the lock."""
    default_timeout = inspect.signature(foundry_core.save).parameters["lock_timeout"].default

    def save(path, *, graphs, lock_timeout=default_timeout, expected_version=ANY_VERSION, **kwargs):
        tag = next(iter(graphs.values()))
        with ArchiveWriter(path, lock_timeout=lock_timeout, expected_version=expected_version) as w:
            w.add_bytes("memory/00000.bin", tag.encode())
            if hold is not None:
                hold(tag)
            digest = w.commit(fingerprint={"gpu_name": "NVIDIA H200"}, meta={"tag": tag})
        published.append(tag)
        return digest

    return save


def _replicas(parse, cfg):
    """Two schedulers of two replicas that both found the archive directory empty (auto: SAVE)."""
    sa = parse(*BASE_ARGV)
    assert archive.decide_mode(sa, cfg) == "save"
    replicas = {}
    for tag in ("a", "b"):
        replicas[tag] = Session(sa, cfg, "save", rank=0, gpu_id=0)
        replicas[tag].slots, replicas[tag].graphs = SLOTS, {"decode/size=1": tag}
    return replicas


def test_two_replicas_saving_at_the_same_moment_publish_one_archive(parse, cfg, monkeypatch, no_native):
    """a is writing its archive (holding the lock) when b's capture ends: b waits for the lock
    (auto mode's lock_timeout), finds a's archive and keeps it; nothing of b's is written."""
    published: list[str] = []
    a_holds = threading.Event()

    def hold(tag):
        if tag == "a":
            a_holds.set()
            time.sleep(0.5)  # b reaches the lock meanwhile

    monkeypatch.setattr(foundry_core, "save", _archive_writing_save(published, hold))
    replicas = _replicas(parse, cfg)
    first = threading.Thread(target=replicas["a"].finish)
    first.start()
    try:
        assert a_holds.wait(30)
        replicas["b"].finish()
    finally:
        first.join(30)
    assert published == ["a"]
    assert replicas["a"].report["saved"] is True
    assert replicas["b"].report["saved"] is False and replicas["b"].report["kept_other_save"] is True
    assert "save_error" not in replicas["b"].report
    assert open_archive(cfg.rank_archive_dir(0)).meta["tag"] == "a"
    assert archive.complete(parse(*BASE_ARGV), cfg)


def test_a_replica_that_decided_to_save_keeps_an_archive_published_meanwhile(
    parse, cfg, monkeypatch, no_native
):
    published: list[str] = []
    monkeypatch.setattr(foundry_core, "save", _archive_writing_save(published))
    replicas = _replicas(parse, cfg)
    replicas["a"].finish()  # a's SAVE is finished (sidecar written) before b's capture ends
    assert archive.complete(parse(*BASE_ARGV), cfg)
    replicas["b"].finish()
    assert published == ["a"]  # exactly one SAVE publishes
    assert open_archive(cfg.rank_archive_dir(0)).meta["tag"] == "a"


def test_a_replica_keeps_an_archive_published_while_its_own_capture_ended(parse, cfg, monkeypatch, no_native):
    """As on the GPU (2026-12-04, two SGLang servers 0.5 s apart): b's graph archive is published and
    b is saving its compile caches, its sidecar not written yet, when a's capture ends. a must not
    publish over b's archive: exactly one SAVE publishes, and b's SAVE finishes."""
    published: list[str] = []
    monkeypatch.setattr(foundry_core, "save", _archive_writing_save(published))
    replicas = _replicas(parse, cfg)
    b_saves_caches = replicas["b"].caches.save

    def caches_save(device):
        replicas["a"].finish()  # a's capture ends here: b's archive is there, its sidecar is not
        return b_saves_caches(device)

    monkeypatch.setattr(replicas["b"].caches, "save", caches_save)
    replicas["b"].finish()
    assert published == ["b"]
    assert replicas["a"].report["saved"] is False and replicas["a"].report["kept_other_save"] is True
    assert "save_error" not in replicas["a"].report
    assert replicas["b"].report["saved"] is True
    assert open_archive(cfg.rank_archive_dir(0)).meta["tag"] == "b"
    assert archive.complete(parse(*BASE_ARGV), cfg)
