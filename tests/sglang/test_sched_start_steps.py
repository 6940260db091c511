"""A scheduler's start report times each of Foundry's critical-path steps (the launcher's included)
and says how the scheduler was started. ``fc.verify`` and ``fc.start_recording`` are stood in for
(no GPU, no native library), as in test_sglang_archive_fallback."""

from __future__ import annotations

import json

import pytest

import foundry_core
from foundry_core.engine import start_method, startsteps
from foundry_sglang_plugin import archive, settings
from foundry_sglang_plugin.session import Session

HINT = {"gpu_id": 0, "tp_rank": 0, "dp_rank": None}
SLOTS = {"memory_pool_config": {"max_total_num_tokens": 1024}, "max_mamba_cache_size": None}


@pytest.fixture
def load_start(parse, tmp_path, monkeypatch):
    toml = tmp_path / "foundry.toml"
    toml.write_text(f'mode = "auto"\narchive_dir = "{tmp_path / "archive"}"\n')
    sa = parse("--cuda-graph-backend-prefill", "disabled", foundry=False)
    settings.attach(sa, True, toml)
    cfg = settings.load(sa)
    archive.write_sidecar(
        cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": SLOTS, "outputs": {}}
    )
    monkeypatch.setattr(foundry_core, "verify", lambda path, **kw: None)
    monkeypatch.setattr(foundry_core, "start_recording", lambda keep_images=True: None)
    return sa


def test_the_start_report_times_every_foundry_step(load_start, monkeypatch):
    monkeypatch.setenv(startsteps.LAUNCH_ENV, json.dumps({"launcher.settle": 0.04}))
    env: dict[str, str] = {}
    start_method.export(start_method.Choice("fork", "clean launcher"), env)
    monkeypatch.setenv(start_method.CHOSEN_ENV, env[start_method.CHOSEN_ENV])
    session = Session.begin(load_start, HINT)
    assert session.mode == "load"
    report = session.report
    steps = report[startsteps.STEPS_KEY]
    assert set(steps) == {"launcher.settle", "session", "recording", "check_archive", "caches", "threads"}
    assert all(isinstance(v, float) and v >= 0 for v in steps.values())
    assert report[startsteps.TOTAL_KEY] == pytest.approx(sum(steps.values()), abs=1e-3)
    assert report["foundry_budget_s"] == startsteps.BUDGET_S
    assert report["scheduler_start"] == {"method": "fork", "reason": "clean launcher"}
    skipped = {r["step"] for r in report["start_work"] if r["action"] == "skipped"}
    assert "decode-graph warmup and capture" in skipped


def test_background_threads_start_after_the_steps(load_start, monkeypatch):
    """The archive's inflate and Triton's key run on threads begun once the check and the caches
    hand-over are done (beside them they slowed the steps: prewarm's docstring), with the checked
    archive handed over, not read again."""
    from foundry_core.engine import handover, prewarm

    events: list = []
    verified = object.__new__(foundry_core.Archive)
    verified.meta = {"slots": SLOTS}

    def verify(path, **kw):
        events.append(("check", kw["inflate"]))
        return verified

    monkeypatch.setattr(foundry_core, "verify", verify)
    monkeypatch.setattr(handover.CacheHandover, "restore", lambda self, device: events.append(("caches",)))
    monkeypatch.setattr(prewarm, "start", lambda log=None, archive=None: events.append(("threads", archive)))
    session = Session.begin(load_start, HINT)
    assert session.mode == "load"
    assert events == [("check", False), ("caches",), ("threads", verified)]


def test_a_scheduler_started_without_a_choice_says_so(load_start, monkeypatch):
    monkeypatch.delenv(start_method.CHOSEN_ENV, raising=False)
    report = Session.begin(load_start, HINT).report
    assert report["scheduler_start"] is None and "launcher.settle" not in report[startsteps.STEPS_KEY]
