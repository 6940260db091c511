"""Helpers shared by the SGLang session, decode-backend, capture-hook and auto-mode tests: the argv
every launch starts from, a rank's archive marked complete, and a stand-in region (the ``cfg``
fixture is in conftest.py)."""

from __future__ import annotations

from foundry_sglang_plugin import archive

BASE_ARGV = ["--cuda-graph-backend-prefill", "disabled"]


def mark_complete(sa, cfg, rank, fingerprint=None):
    """Write rank ``rank``'s plugin record as a finished SAVE leaves it (``decide_mode`` reads it)."""
    fp = fingerprint if fingerprint is not None else archive.fingerprint(sa, cfg)
    archive.write_sidecar(cfg, rank, {"fingerprint": fp, "slots": {}, "outputs": {}})


class FakeRegion:
    """Counts the end-of-setup marks a session makes (no device memory)."""

    def __init__(self):
        self.setup_marks = 0

    def end_setup(self):
        self.setup_marks += 1
