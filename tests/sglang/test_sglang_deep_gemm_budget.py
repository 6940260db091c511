"""Block-FP8 MoE on SGLang 0.5.23: the DeepGEMM layout budget (masked vs compact activations) that
SGLang takes from free device memory before the decode capture is SAVE's at LOAD too. Driven through
the plugin's hooks with SGLang's own budget setter and budget refresh."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

GiB = 1 << 30


@pytest.fixture
def dg(monkeypatch):
    from sglang.srt.layers.moe.moe_runner import deep_gemm

    monkeypatch.setattr(deep_gemm, "_masked_standard_layout_memory_budget_bytes", None)
    return deep_gemm


def _session(monkeypatch, mode, slots):
    from foundry_sglang_plugin import hooks

    session = SimpleNamespace(mode=mode, slots=slots, capture_started=False)
    monkeypatch.setattr(hooks, "_session", session)
    return session


def _start(dg, free_bytes):
    """One scheduler start's two budget steps as SGLang makes them, on a GPU with ``free_bytes`` free:
    the warmup's first eager MoE call (this rank's free memory) and the pre-capture refresh."""
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup

    from foundry_sglang_plugin import hooks

    runner = SimpleNamespace(model_runner=SimpleNamespace(is_draft_worker=False))
    seen = {}

    def warmup(self):
        if dg._masked_standard_layout_memory_budget_bytes is None:  # SGLang's fallback when unset
            dg.set_masked_standard_layout_memory_budget(free_bytes)
        seen["warmup"] = dg._masked_standard_layout_memory_budget_bytes

    def refresh(model_runner, **kwargs):  # its all-rank free-memory reading, then SGLang's setter
        dg.set_masked_standard_layout_memory_budget(free_bytes)

    hooks.around_runner_warmup(warmup, runner)
    hooks.around_refresh_deep_gemm_budget(refresh, runner.model_runner)
    seen["capture"] = dg._masked_standard_layout_memory_budget_bytes
    assert cuda_graph_setup.refresh_deep_gemm_layout_memory_budget  # the step the hook wraps exists
    return seen


def test_load_uses_saves_budget_though_its_free_memory_differs(dg, monkeypatch):
    save = _session(monkeypatch, "save", {})
    at_save = _start(dg, 80 * GiB)
    assert save.slots["deep_gemm_layout_budget"] == at_save
    monkeypatch.setattr(dg, "_masked_standard_layout_memory_budget_bytes", None)  # a fresh process
    _session(monkeypatch, "load", save.slots)
    at_load = _start(dg, 60 * GiB)  # the archive being rebuilt beside the model takes memory
    assert at_load == at_save


def test_the_refresh_after_the_start_is_sglangs_own(dg, monkeypatch):
    from foundry_sglang_plugin import hooks

    _session(monkeypatch, "load", {"deep_gemm_layout_budget": {"warmup": 1, "capture": 2}})
    hooks.around_refresh_deep_gemm_budget(
        lambda mr, **kw: dg.set_masked_standard_layout_memory_budget(10 * GiB),
        SimpleNamespace(is_draft_worker=False),
        only_if_initialized=True,
    )
    assert dg._masked_standard_layout_memory_budget_bytes != 2
