"""The SGLang plugin's worker hooks around the decode capture, on the CPU: SGLang's warmup runs as
setup in both modes and is skipped after the capture began only at LOAD, the end of setup is marked
before the capture, the capture loop's garbage collections are skipped where nothing is captured,
and draft runners are left alone."""

from __future__ import annotations

import pytest
from foundry_sglang_testutil import BASE_ARGV, FakeRegion, mark_complete

from foundry_sglang_plugin.session import Session

pytestmark = pytest.mark.sglang


# --- worker hooks around the decode capture -------------------------------------------------------


class _Runner:
    def __init__(self, draft=False):
        self.model_runner = type("MR", (), {"is_draft_worker": draft})()


@pytest.fixture
def hooks_with(monkeypatch):
    from foundry_sglang_plugin import hooks

    def install(session):
        monkeypatch.setattr(hooks, "_session", session)
        return hooks

    return install


@pytest.mark.parametrize("mode", ["save", "load"])
def test_warmup_before_the_capture_is_setup_and_runs_in_both_modes(parse, cfg, hooks_with, mode):
    sa = parse(*BASE_ARGV)
    if mode == "load":
        mark_complete(sa, cfg, 0)
    hooks = hooks_with(Session(sa, cfg, mode, rank=0, gpu_id=0))
    ran = []
    hooks.around_runner_warmup(lambda self: ran.append(self), _Runner())
    assert len(ran) == 1


def test_warmup_after_the_capture_began_is_skipped_only_at_load(parse, cfg, hooks_with):
    sa = parse(*BASE_ARGV)
    for mode, expected in (("save", 1), ("load", 0)):
        mark_complete(sa, cfg, 0)  # (a SAVE session drops it)
        session = Session(sa, cfg, mode, rank=0, gpu_id=0)
        session.capture_started = True
        hooks = hooks_with(session)
        ran = []
        hooks.around_runner_warmup(lambda self, ran=ran: ran.append(self), _Runner())
        assert len(ran) == expected, mode


def test_decode_capture_hook_marks_setup_then_times_the_capture(parse, cfg, hooks_with):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = FakeRegion()
    hooks = hooks_with(session)
    seen = []

    def capture(runner):
        seen.append(session.region.setup_marks)  # setup was marked before the runner's capture ran
        return "captured"

    assert hooks.around_decode_capture(capture, _Runner()) == "captured"
    assert seen == [1] and session.capture_started
    assert session.report["capture_s"] >= 0


@pytest.mark.parametrize("mode", ["save", "load"])
def test_capture_loop_collects_garbage_only_where_it_captures(parse, cfg, hooks_with, monkeypatch, mode):
    """SGLang's freeze_gc runs gc.collect() around its capture loop; a LOAD's loop captures nothing,
    so there (and only there) the collections are skipped. Outside the decode capture the context
    is SGLang's own in both modes."""
    import gc

    from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc

    sa = parse(*BASE_ARGV)
    if mode == "load":
        mark_complete(sa, cfg, 0)
    session = Session(sa, cfg, mode, rank=0, gpu_id=0)
    session.region = FakeRegion()
    session.restored = object()  # LOAD: the archive counts as restored (no fc.load on CPU)
    hooks = hooks_with(session)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)

    def capture(runner):
        with hooks.around_freeze_gc(freeze_gc, False):
            pass

    hooks.around_decode_capture(capture, _Runner())
    assert len(collected) == (0 if mode == "load" else 2)
    collected.clear()
    with hooks.around_freeze_gc(freeze_gc, False):  # e.g. a prefill runner's capture
        pass
    assert len(collected) == 2


def test_draft_runners_are_left_alone(parse, cfg, hooks_with):
    session = Session(parse(*BASE_ARGV), cfg, "save", rank=0, gpu_id=0)
    session.region = FakeRegion()
    hooks = hooks_with(session)
    hooks.around_decode_capture(lambda runner: None, _Runner(draft=True))
    assert session.region.setup_marks == 0 and not session.capture_started
