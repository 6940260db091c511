"""FOUNDRY_PROFILE_DIR: the scheduler's start runs under cProfile (for finding where a LOAD's time
goes), through the hook SGLang calls around ``Scheduler.__init__``."""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.sglang


def test_the_scheduler_start_is_profiled_when_asked(tmp_path, monkeypatch):
    pytest.importorskip("sglang", reason="the real SGLang package is needed (see .ci/sglang.sh)")
    from foundry_sglang_plugin import hooks

    session = types.SimpleNamespace(mode="load", rank=0, report={})
    monkeypatch.setattr(hooks, "_session", session)
    calls = []

    def scheduler_init(self, server_args=None):
        calls.append(server_args)
        return "started"

    monkeypatch.delenv("FOUNDRY_PROFILE_DIR", raising=False)
    assert hooks.around_scheduler_init(scheduler_init, object(), server_args="sa") == "started"
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("FOUNDRY_PROFILE_DIR", str(tmp_path))
    assert hooks.around_scheduler_init(scheduler_init, object(), server_args="sa") == "started"
    assert calls == ["sa", "sa"]
    assert "scheduler_init" in (tmp_path / "sglang-scheduler-start-load-rank0.txt").read_text()
