"""Issue 19 fault cases in the vLLM plugin's front end and worker session (real vLLM, no GPU).

``fc.verify`` and ``fc.save`` are stood in for (they need the GPU); the engine configuration, the
session, its manifest and the real archive writer are not.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
import pathlib

import pytest

import foundry_core
from foundry_core.archive import ANY_VERSION, ArchiveWriter, FingerprintMismatch, open_archive
from foundry_vllm_plugin import archive, session
from foundry_vllm_plugin.session import FoundrySession
from foundry_vllm_plugin.support import FOUNDRY_WORKER

pytestmark = pytest.mark.vllm

FP = {"config_hash": "abc", "device": {"name": "NVIDIA H200"}}
SIZING = {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}


@pytest.fixture
def environment_back():
    """The compile-cache variables a Foundry engine config points elsewhere, put back afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Adapter:
    kind = "v2"

    def __init__(self, tag: str = "G1"):
        self.tag = tag

    def collect(self):
        return {"decode/g1": self.tag}, {}, [{"name": "decode/g1"}]


def _session(base_vllm_config, tmp_path, mode="auto") -> FoundrySession:
    s = FoundrySession(base_vllm_config)
    s.cfg = dataclasses.replace(s.cfg, mode=mode, archive_dir=tmp_path / "archive")
    s.fingerprint = dict(FP)
    s.region, s.kv_cache_memory_bytes, s.num_gpu_blocks = object(), 1 << 30, 4096
    return s


@pytest.mark.parametrize("mode", ["save", "auto"])
def test_an_archive_dir_that_cannot_be_written_at_startup(
    engine_args_factory, tmp_path, environment_back, mode
):
    # Below a regular file nothing can be created, also for root (a read-only mount acts alike).
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    toml = tmp_path / "foundry.toml"
    toml.write_text(f'mode = "{mode}"\narchive_dir = "{blocker / "archive"}"\n')
    args = engine_args_factory(additional_config={"foundry": {"config": str(toml)}})
    if mode == "save":  # refused while the config is built: before any worker or GPU work
        with pytest.raises(SystemExit) as err:
            args.create_engine_config()
        line = str(err.value.code)
        assert "\n" not in line
        assert line.startswith(f"error: Foundry: archive_dir {blocker / 'archive'} is not writable (")
        assert line.endswith("; mode = save cannot go on")
    else:  # auto decides per rank in the worker, whose failed SAVE serves on (next test)
        assert args.create_engine_config().parallel_config.worker_cls == FOUNDRY_WORKER


def test_auto_with_a_read_only_archive_dir_and_a_refused_archive_serves_on(
    base_vllm_config, tmp_path, monkeypatch, warnings_logged
):
    s = _session(base_vllm_config, tmp_path)
    archive.core_archive_dir(s.cfg, 0).mkdir(parents=True)
    archive.write_manifest(archive.manifest_path(s.cfg, 0), FP, SIZING, [])  # an older SAVE

    def refuse(path, **kwargs):  # e.g. the driver was upgraded since that SAVE
        raise FingerprintMismatch("archive saved on driver 570.1, this machine has 580.2", "driver", 1, 2)

    monkeypatch.setattr(foundry_core, "verify", refuse)
    monkeypatch.setattr(session, "count_captures_only", lambda: pytest.fail("a refused archive is no LOAD"))
    real_unlink = pathlib.Path.unlink

    def read_only(self, *args, **kwargs):  # root ignores file modes: fail as a read-only mount does
        if s.cfg.archive_dir in self.parents:
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    monkeypatch.setattr(foundry_core, "save", lambda *a, **k: pytest.fail("nothing can be written"))
    s.decide_mode(0)
    assert s.mode == "save"
    s.save(Adapter())  # does not raise: the engine serves with the graphs it captured
    s.publish(0)
    assert s.report["saved"] is False and "Read-only file system" in s.report["save_error"]
    messages = [r.getMessage() for r in warnings_logged]
    assert any("refused (archive saved on driver 570.1" in m for m in messages)
    assert any("SAVE failed" in m and "Read-only file system" in m for m in messages)
    assert archive.read_manifest(archive.manifest_path(s.cfg, 0))["sizing"] == SIZING  # left as it was


def test_auto_deciding_save_in_an_unwritable_archive_dir_warns_at_once_and_skips_the_save(
    base_vllm_config, tmp_path, monkeypatch, warnings_logged
):
    """On the H200 (8d3f0b9) such a start warned only after its capture, when the SAVE failed."""
    blocker = tmp_path / "not-a-dir"  # below a regular file nothing can be created, also for root
    blocker.write_text("")
    s = FoundrySession(base_vllm_config)
    s.cfg = dataclasses.replace(s.cfg, mode="auto", archive_dir=blocker / "archive")
    s.fingerprint = dict(FP)
    s.region, s.kv_cache_memory_bytes, s.num_gpu_blocks = object(), 1 << 30, 4096
    s.decide_mode(0)
    assert s.mode == "save"  # the graphs are captured as a SAVE would, the engine serves with them
    messages = [r.getMessage() for r in warnings_logged]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert f"archive_dir {blocker / 'archive'} is not writable (" in messages[0]
    assert messages[0].endswith("auto mode serves with the graphs it captures and saves nothing this time")
    monkeypatch.setattr(foundry_core, "save", lambda *a, **k: pytest.fail("a blocked SAVE does no work"))
    monkeypatch.setattr(Adapter, "collect", lambda self: pytest.fail("nothing is collected either"))
    s.save(Adapter())
    s.publish(0)
    assert s.report["saved"] is False and "is not writable" in s.report["save_error"]
    assert len(warnings_logged) == 1  # no second warning after the capture


def test_auto_deciding_save_in_a_writable_dir_is_not_blocked(base_vllm_config, tmp_path):
    s = _session(base_vllm_config, tmp_path)
    s.decide_mode(0)
    assert s.mode == "save" and s.save_blocked is None and "save_error" not in s.report


@pytest.mark.parametrize("mode", ["auto", "save"])
def test_a_manifest_that_cannot_be_written_after_the_core_archive_serves_on(
    base_vllm_config, tmp_path, monkeypatch, full_disk_at_flush, warnings_logged, mode
):
    """The disk fills up between the core archive and the manifest that marks the SAVE finished."""
    s = _session(base_vllm_config, tmp_path, mode)
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: "digest")
    s.save(Adapter())
    full_disk_at_flush()
    if mode == "save":
        with pytest.raises(OSError, match="No space left on device"):
            s.publish(0)
    else:
        s.publish(0)
        assert s.report["saved"] is False and s.report["save_error"] == "[Errno 28] No space left on device"
        assert any("SAVE failed" in r.getMessage() for r in warnings_logged)
    assert archive.read_manifest(archive.manifest_path(s.cfg, 0)) is None
    assert not list(s.cfg.archive_dir.glob("*.tmp"))


def _archive_writing_save(published: list[str]):
    """An ``fc.save`` that writes a real archive (the graph's value as its tag) through the archive
    layer with fc.save's own lock rule and ``expected_version``."""
    default_timeout = inspect.signature(foundry_core.save).parameters["lock_timeout"].default

    def save(path, *, graphs, lock_timeout=default_timeout, expected_version=ANY_VERSION, **kwargs):
        tag = graphs["decode/g1"]
        with ArchiveWriter(path, lock_timeout=lock_timeout, expected_version=expected_version) as w:
            w.add_bytes("memory/00000.bin", tag.encode())
            digest = w.commit(fingerprint={"gpu_name": "NVIDIA H200"}, meta={"tag": tag})
        published.append(tag)
        return digest

    return save


def test_a_replica_that_decided_to_save_keeps_an_archive_published_meanwhile(
    base_vllm_config, tmp_path, monkeypatch, caplog
):
    published: list[str] = []
    monkeypatch.setattr(foundry_core, "save", _archive_writing_save(published))
    caplog.set_level(logging.INFO, logger="vllm.foundry")
    replicas = {tag: _session(base_vllm_config, tmp_path) for tag in ("a", "b")}
    for s in replicas.values():  # both start on the empty directory
        s.decide_mode(0)
        assert s.mode == "save"
    replicas["a"].save(Adapter("a"))
    replicas["a"].publish(0)  # a's SAVE is finished before b's capture ends
    assert archive.resolve_mode(replicas["a"].cfg, 0, FP)[0] == "load"
    replicas["b"].save(Adapter("b"))
    replicas["b"].publish(0)
    assert published == ["a"]  # exactly one SAVE publishes
    # ... and says so once: a line that only says the graphs were written cannot be read as published
    said = [r.getMessage() for r in caplog.records]
    assert sum("archive published" in m for m in said) == 1, said
    assert not any("saved" in m and "decode graphs" in m for m in said)
    assert open_archive(archive.core_archive_dir(replicas["a"].cfg, 0)).meta["tag"] == "a"


def test_a_replica_keeps_an_archive_written_before_its_own_capture_ended(
    base_vllm_config, tmp_path, monkeypatch, caplog
):
    """b wrote its graph archive (its manifest comes after the compile caches) when a's capture
    ends: a neither writes over b's archive nor removes b's manifest, and b publishes."""
    published: list[str] = []
    monkeypatch.setattr(foundry_core, "save", _archive_writing_save(published))
    caplog.set_level(logging.INFO, logger="vllm.foundry")
    replicas = {tag: _session(base_vllm_config, tmp_path) for tag in ("a", "b")}
    for s in replicas.values():
        s.decide_mode(0)
    replicas["b"].save(Adapter("b"))
    replicas["a"].save(Adapter("a"))
    assert replicas["a"].report["kept_other_save"] is True and replicas["a"].report["saved"] is False
    replicas["b"].publish(0)
    replicas["a"].publish(0)  # nothing pending: a kept b's archive
    assert published == ["b"]
    assert replicas["b"].report["saved"] is True
    assert archive.resolve_mode(replicas["b"].cfg, 0, FP)[0] == "load"
    assert open_archive(archive.core_archive_dir(replicas["b"].cfg, 0)).meta["tag"] == "b"
    said = [r.getMessage() for r in caplog.records]
    assert sum("archive published" in m for m in said) == 1, said
    # a said it kept b's archive, and never that it was writing its own
    assert sum("writing 1 decode graphs" in m for m in said) == 1, said
    assert sum("another process published an archive meanwhile" in m for m in said) == 1, said
