"""Fixtures of the save_faults tests (save_model.py holds what they share besides)."""

from __future__ import annotations

import pytest
from save_model import machine_fingerprint

import foundry_core.api as api
from foundry_sglang_plugin import _view as sglang_view


@pytest.fixture(autouse=True)
def plain_server_args(monkeypatch):
    """SGLANG_ARGS is a plain namespace, read with getattr: SGLang's resolver (which imports SGLang
    where it is installed, seconds per subprocess) is not asked, here or in the helpers."""
    monkeypatch.setattr(sglang_view, "_resolution_result", lambda: None)


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(api, "current_fingerprint", machine_fingerprint)
