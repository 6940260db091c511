"""The start's floor: Foundry's critical-path steps timed in the start report, and the worker
start-method rules."""

from __future__ import annotations

import json
import threading
import time
import types

import pytest

from foundry_core.engine import start_method, startsteps
from foundry_core.engine.handover import CacheHandover


def test_each_step_is_timed_and_summed_against_the_budget(monkeypatch):
    monkeypatch.setenv(startsteps.LAUNCH_ENV, json.dumps({"launcher.settle": 0.05, "bogus": 9}))
    report: dict = {}
    steps = startsteps.StartSteps(report)
    with steps.step("check_archive"):
        time.sleep(0.02)
    steps.add("caches", 0.01)
    steps.add("caches", 0.01)
    assert steps.close(rank=0) == report[startsteps.TOTAL_KEY]
    timed = report[startsteps.STEPS_KEY]
    assert set(timed) == {"launcher.settle", "check_archive", "caches"}
    assert timed["check_archive"] >= 0.02 and timed["caches"] == pytest.approx(0.02)
    assert report["foundry_budget_s"] == startsteps.BUDGET_S
    assert startsteps.OVER_KEY not in report


def test_a_start_over_budget_names_its_slowest_steps(caplog):
    report: dict = {}
    steps = startsteps.StartSteps(report, launch=False)
    steps.add_all({"decide": 0.7, "caches": 0.26, "session": 0.01, "recording": 0.02})
    with caplog.at_level("INFO", logger="foundry.engine"):
        steps.close(rank=3)
    assert report[startsteps.OVER_KEY] == ["decide", "caches", "recording"]
    assert "over the 0.30 s budget" in caplog.text and "rank 3" in caplog.text


def test_launch_steps_travel_through_the_environment():
    env: dict[str, str] = {}
    startsteps.export_launch({"settle": 0.123456}, env)
    assert startsteps.launch_steps(env) == {"launcher.settle": 0.1235}
    assert startsteps.launch_steps({startsteps.LAUNCH_ENV: "not json"}) == {}


def test_the_cache_hand_over_is_timed_whatever_its_outcome(tmp_path):
    cfg = types.SimpleNamespace(
        archive_dir=tmp_path,
        mode="auto",
        carry_caches=True,
        archive_digests=(),
        rank_caches_dir=lambda rank: tmp_path / f"rank{rank}.caches",
        caches_digest_for_rank=lambda rank: None,
    )
    handover = CacheHandover(cfg, 0, ("triton",), {"name": "x", "version": "1"})
    handover.begin()
    assert handover.restore(0) is False  # no caches archive: the engine builds them
    assert handover.report["missing"] is True
    assert isinstance(handover.report["restore_s"], float)


# --- start method ---------------------------------------------------------------------------------


def test_fork_only_in_a_clean_launcher():
    assert start_method.decide(cuda=False, threads=[], environ={}).method == "fork"
    c = start_method.decide(cuda=True, threads=[], environ={})
    assert c.method == "spawn" and "CUDA is initialised" in c.reason
    c = start_method.decide(cuda=False, threads=["zmq-io"], environ={})
    assert c.method == "spawn" and "zmq-io" in c.reason
    c = start_method.decide(blockers=["the memory saver"], cuda=False, threads=[], environ={})
    assert c == start_method.Choice("spawn", "the memory saver")


def test_the_user_asks_for_spawn_or_fork_and_safety_still_wins():
    assert start_method.decide(cuda=False, threads=[], environ={start_method.ENV: "spawn"}).method == "spawn"
    forced = start_method.decide(cuda=False, threads=[], environ={start_method.ENV: "fork"})
    assert forced.method == "fork" and "=fork" in forced.reason
    assert start_method.decide(cuda=True, threads=[], environ={start_method.ENV: "fork"}).method == "spawn"


def test_readahead_threads_do_not_block_a_fork_other_threads_do():
    stop = threading.Event()
    readers = [
        threading.Thread(target=stop.wait, name=n)
        for n in ("foundry-readahead-reader-0", "foundry-readahead-plan")
    ]
    for t in readers:
        t.start()
    try:
        assert start_method.foreign_threads() == ["foundry-readahead-plan"]
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert start_method.foreign_threads() == []


def test_the_choice_reaches_the_workers():
    env: dict[str, str] = {}
    start_method.export(start_method.Choice("spawn", "why"), env)
    assert start_method.chosen(env) == {"method": "spawn", "reason": "why"}
    assert start_method.chosen({start_method.CHOSEN_ENV: "{"}) is None


# --- start work ------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_load_lists_what_it_skips_and_what_it_keeps_with_reasons(engine):
    from foundry_core.engine import startwork

    rows = startwork.listing(engine, "load")
    actions = {r["action"] for r in rows}
    assert actions == {startwork.SKIPPED, startwork.KEPT}
    assert all(r["reason"] for r in rows)
    assert any("capture" in r["step"] and r["action"] == startwork.SKIPPED for r in rows)
    assert all(r["action"] == startwork.KEPT for r in startwork.listing(engine, "save"))
