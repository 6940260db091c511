"""The SGLang plugin's Session on the CPU: pool sizing recorded at SAVE and imposed at LOAD, the
archive's presence, the session report, a SAVE that cannot be written, the rebuild started ahead
at LOAD and a restore that fails at the capture."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types

import pytest
from foundry_sglang_testutil import BASE_ARGV, mark_complete

from foundry_sglang_plugin import archive
from foundry_sglang_plugin.session import FoundrySessionError, Session

pytestmark = pytest.mark.sglang


# --- session: pool sizing and archive presence ----------------------------------------------------


def test_load_without_archive_refuses_before_gpu_work(parse, cfg):
    with pytest.raises(FoundrySessionError, match="no Foundry archive for this configuration"):
        Session(parse(*BASE_ARGV), cfg, "load", rank=0, gpu_id=0)


def test_save_invalidates_the_previous_archive_first(parse, cfg):
    sa = parse(*BASE_ARGV)
    mark_complete(sa, cfg, 0)
    Session(sa, cfg, "save", rank=0, gpu_id=0)
    assert archive.read_sidecar(cfg, 0) is None


def test_pool_sizing_saved_then_restored_without_profiling(parse, cfg):
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    sa = parse(*BASE_ARGV)
    saver = Session(sa, cfg, "save", rank=0, gpu_id=0)
    profiled = MemoryPoolConfig(max_total_num_tokens=123456, max_running_requests=48, mem_fraction_static=0.3)
    assert saver.pool_config(lambda: profiled, MemoryPoolConfig) is profiled
    mark_complete(sa, cfg, 0)
    side = archive.read_sidecar(cfg, 0)
    side["slots"] = saver.slots
    archive.write_sidecar(cfg, 0, side)

    loader = Session(sa, cfg, "load", rank=0, gpu_id=0)

    def must_not_profile():
        raise AssertionError("LOAD profiled GPU memory")

    restored = loader.pool_config(must_not_profile, MemoryPoolConfig)
    assert restored == profiled


def test_hybrid_state_pool_sizing_is_recorded_at_save_and_imposed_at_load(parse, cfg, monkeypatch):
    """A hybrid (Mamba / linear-attention) model's state pool: the size SGLang's memory profiling
    resolves into its schedule config at SAVE is recorded, and LOAD puts it back into that config
    without profiling (SGLang's real config bags)."""
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_context, get_schedule, publish

    ctx = get_context()
    for attr in ("_server_args", "_config_bags", "_publish_role"):  # published below; put back after
        monkeypatch.setattr(ctx, attr, getattr(ctx, attr, None), raising=False)
    profiled = MemoryPoolConfig(max_total_num_tokens=65536, max_running_requests=48, mem_fraction_static=0.3)

    def profile():  # what SGLang's resolution does for a hybrid model: sizes the state pool too
        get_context().override("test.profiling", max_mamba_cache_size=2048)
        return profiled

    sa = parse(*BASE_ARGV)
    publish(sa, role="test")
    saver = Session(sa, cfg, "save", rank=0, gpu_id=0)
    saver.pool_config(profile, MemoryPoolConfig)
    assert saver.slots["max_mamba_cache_size"] == 2048
    mark_complete(sa, cfg, 0)
    side = archive.read_sidecar(cfg, 0)
    side["slots"] = saver.slots
    archive.write_sidecar(cfg, 0, side)

    publish(sa, role="test")  # a new process: its schedule holds no resolved size yet
    assert get_schedule().max_mamba_cache_size is None
    loader = Session(sa, cfg, "load", rank=0, gpu_id=0)

    def must_not_profile():
        raise AssertionError("LOAD profiled GPU memory")

    assert loader.pool_config(must_not_profile, MemoryPoolConfig) == profiled
    assert get_schedule().max_mamba_cache_size == 2048


def test_save_without_pool_sizing_refuses(parse, cfg):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError, match="memory-pool sizing was not recorded"):
        session.finish()


def test_session_end_detaches_cupti_even_when_it_fails(parse, cfg, monkeypatch, logged):
    """finish() and abort() stop module recording whatever happened; a failing stop is logged only."""
    import foundry_core as fc

    calls = []
    monkeypatch.setattr(fc, "stop_recording", lambda: calls.append("stop"))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError):
        session.finish()
    session.abort(RuntimeError("x"))
    assert calls == ["stop", "stop"]

    def broken():
        raise fc.ModuleError("cuptiFinalize failed")

    monkeypatch.setattr(fc, "stop_recording", broken)
    session.abort(RuntimeError("y"))  # does not raise
    seen = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert any("cannot stop CUDA module recording: cuptiFinalize failed" in m for m in seen), seen


# --- the session report (read by benchmarks from outside the scheduler process) -------------------


def test_report_is_written_where_the_environment_says(parse, cfg, monkeypatch, tmp_path):
    import json

    from foundry_sglang_plugin.session import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "report"))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    with pytest.raises(FoundrySessionError):
        session.finish()  # nothing recorded: refused, and the report says why
    report = json.loads((tmp_path / "report" / "rank0.json").read_text())
    assert report["mode"] == "save" and report["ok"] is False
    assert "memory-pool sizing was not recorded" in report["error"]


def test_abort_reports_the_error(parse, cfg, monkeypatch, tmp_path):
    import json

    from foundry_sglang_plugin.session import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path))
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.abort(RuntimeError("placement diverged"))
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report == {**report, "ok": False, "error": "RuntimeError: placement diverged"}


def test_no_report_file_without_the_environment(parse, cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["auto", "save"])
def test_a_save_that_cannot_be_written(parse, cfg, monkeypatch, logged, mode):
    """Disk full or read-only at SAVE: auto serves on with the captured graphs (a warning, nothing
    marked saved); mode = save stops the scheduler's start with the error."""
    import foundry_core as fc

    def disk_full(path, **kw):
        raise fc.ArchiveError(f"cannot write {path}: [Errno 28] No space left on device")

    monkeypatch.setattr(fc, "save", disk_full)
    monkeypatch.setattr(fc, "stop_recording", lambda: None)
    cfg = dataclasses.replace(cfg, mode=mode)
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.slots, session.graphs = {"memory_pool_config": {}}, {"decode/size=1": object()}
    if mode == "save":
        with pytest.raises(fc.ArchiveError, match="No space left"):
            session.finish()
        return
    session.finish()
    assert session.report["ok"] is True and session.report["saved"] is False
    assert "No space left" in session.report["save_error"]
    assert archive.read_sidecar(cfg, 0) is None  # nothing marks a finished SAVE
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert any("SAVE failed" in m and "serving with the graphs just captured" in m for m in warnings)


def test_load_rebuilds_ahead_from_the_region_on_and_hands_it_to_fc_load(parse, cfg, monkeypatch):
    """A LOAD starts the engine layer's rebuild as soon as its region is reserved (before weights
    and KV pools) and passes it to fc.load at the decode capture; a SAVE starts none."""

    import foundry_core as fc
    from foundry_core.engine import prepare

    class Region:
        def __init__(self, base, size, device):
            self.device = device

        def routing(self):
            return contextlib.nullcontext()

    started, loaded = [], {}
    monkeypatch.setattr(fc, "Region", Region)
    monkeypatch.setattr(prepare, "start", lambda path, **kw: started.append((path, kw)) or "prepared")

    class Restored:
        digest = "ab" * 32
        slots: dict = {}
        timings = {"prepared_s": 0.3, "prepare_wait_s": 0.0, "prepared_ready": 1.0}
        archive = types.SimpleNamespace(meta={"collectives": {"symm_mem": 3}})

    monkeypatch.setattr(fc, "load", lambda path, **kw: loaded.update(kw, path=path) or Restored())
    sa = parse(*BASE_ARGV)
    archive.write_sidecar(cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {}})
    session = Session(sa, cfg, "load", rank=0, gpu_id=1)
    session.enter_region(1)
    ((path, kw),) = started
    assert path == str(session.path) and kw["device"] == 1 and kw["rank"] == 0 and kw["cfg"] is cfg
    session.restore()
    assert loaded["prepared"] == "prepared" and loaded["path"] == str(session.path)
    assert session.report["prepared"] is True and session.report["prepared_ready"] is True
    assert session.report["collectives"] == {"symm_mem": 3}

    save = Session(sa, cfg, "save", rank=0, gpu_id=1)
    save.enter_region(1)
    assert len(started) == 1  # a SAVE has nothing to rebuild


@pytest.mark.parametrize("mode", ["auto", "load"])
def test_a_restore_failing_at_the_capture_captures_instead_in_auto_mode(parse, cfg, monkeypatch, mode):
    """fc.load accepted the archive at startup but fails when the decode capture begins: auto on one
    rank captures as SGLang would alone (no graph installed, nothing saved, the archive left for the
    next start); load mode stops with one line."""
    import foundry_core as fc

    def failing_load(path, **kw):
        raise fc.PlacementError("allocation #3 diverged: LOAD placed 4096 bytes at 0x600000200000")

    monkeypatch.setattr(fc, "load", failing_load)
    monkeypatch.setattr(fc, "stop_recording", lambda: None)
    cfg = dataclasses.replace(cfg, mode=mode)
    sa = parse(*BASE_ARGV)
    archive.write_sidecar(cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {}})
    session = Session(sa, cfg, "load", rank=0, gpu_id=0)
    session.sidecar = archive.read_sidecar(cfg, 0)
    if mode == "load":
        with pytest.raises(FoundrySessionError, match="failed at the graph phase .*allocation #3 diverged"):
            session.capture_begins()
        return
    session.capture_begins()
    assert session.mode == "capture" and "capturing the graphs as stock would" in session.report["fallback"]
    session.capture_done()
    assert "capture_s" in session.report and "restore_s" not in session.report
    session.finish()  # nothing installed and nothing persisted: no complaint about missing graphs
    assert session.report["ok"] is True and session.report["saved"] is False
    assert archive.read_sidecar(cfg, 0) is not None  # another replica may load it
