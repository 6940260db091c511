"""The SGLang plugin's archive fingerprint and its auto mode, on the CPU: what the fingerprint
covers and ignores, and when auto SAVEs or LOADs (per rank, per data-parallel replica, per
parallel layout)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from foundry_sglang_testutil import BASE_ARGV, mark_complete

from foundry_sglang_plugin import archive

pytestmark = pytest.mark.sglang


# --- fingerprint and auto mode --------------------------------------------------------------------


def test_fingerprint_is_the_same_in_the_scheduler(parse, cfg):
    sa = parse(*BASE_ARGV)
    getattr(sa, "resolve_once", lambda: None)()  # 0.5.20+ resolves lazily; older records are resolved
    child = pickle.loads(pickle.dumps(sa))  # how the record reaches a scheduler process
    assert archive.fingerprint(child, cfg) == archive.fingerprint(sa, cfg)


def test_fingerprint_ignores_serving_settings_and_sees_graph_settings(parse, cfg):
    base = archive.fingerprint(parse(*BASE_ARGV), cfg)
    assert archive.fingerprint(parse(*BASE_ARGV, "--port", "31000", "--log-level", "debug"), cfg) == base
    assert archive.fingerprint(parse(*BASE_ARGV, "--cuda-graph-max-bs-decode", "16"), cfg) != base
    assert archive.fingerprint(parse(*BASE_ARGV, "--kv-cache-dtype", "fp8_e4m3"), cfg) != base
    other_region = dataclasses.replace(cfg, region_base=cfg.region_base * 2)
    assert archive.fingerprint(parse(*BASE_ARGV), other_region) != base


def test_fingerprint_covers_the_model_config(parse, cfg, model_dir):
    sa = parse(*BASE_ARGV)
    fp = archive.fingerprint(sa, cfg)
    digest = fp["model_config_sha256"]
    assert digest and len(digest) == 64


def test_auto_saves_without_an_archive(parse, cfg):
    assert archive.decide_mode(parse(*BASE_ARGV), cfg) == "save"


def test_auto_loads_a_complete_matching_archive(parse, cfg):
    sa = parse(*BASE_ARGV)
    mark_complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "load"


def test_auto_saves_when_the_configuration_changed(parse, cfg):
    mark_complete(parse(*BASE_ARGV), cfg, 0)
    assert archive.decide_mode(parse(*BASE_ARGV, "--cuda-graph-max-bs-decode", "4"), cfg) == "save"


def test_auto_saves_when_one_rank_is_missing(parse, cfg):
    argv = [*BASE_ARGV, "--tp-size", "2"]
    sa = parse(*argv)
    mark_complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save"
    mark_complete(sa, cfg, 1)
    assert archive.decide_mode(sa, cfg) == "load"


@pytest.mark.parametrize("mode", ["save", "load"])
def test_explicit_modes_are_kept(parse, cfg, mode):
    assert archive.decide_mode(parse(*BASE_ARGV), dataclasses.replace(cfg, mode=mode)) == mode


# --- fingerprint: launch-to-launch stability ------------------------------------------------------


def test_fingerprint_ignores_the_random_seed(parse, cfg):
    # SGLang before 0.5.20 resolves an unset seed to a new random number at every launch.
    base = archive.fingerprint(parse(*BASE_ARGV, "--random-seed", "1"), cfg)
    assert archive.fingerprint(parse(*BASE_ARGV, "--random-seed", "2"), cfg) == base
    assert "random_seed" not in base["server_args"]


# --- auto mode per data-parallel replica and parallel layout --------------------------------------


def test_auto_decides_each_data_parallel_replica_on_its_own_archives(parse, cfg):
    """One replica's archive lost (or never finished) does not make the others SAVE again: each
    replica restores alone from its own archives; tensor-parallel ranks of a replica go together."""
    sa = parse(*BASE_ARGV, "--dp-size", "2", "--tp-size", "2")
    assert archive.decide_mode(sa, cfg) == "save"
    mark_complete(sa, cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save", "replica 0 lacks its second rank"
    mark_complete(sa, cfg, 1)
    assert archive.decide_mode(sa, cfg) == "load,save"
    mark_complete(sa, cfg, 3)
    assert archive.decide_mode(sa, cfg) == "load,save", "replica 1 lacks its first rank"
    mark_complete(sa, cfg, 2)
    assert archive.decide_mode(sa, cfg) == "load"
    archive.drop_sidecar(cfg, 0)
    assert archive.decide_mode(sa, cfg) == "save,load"
    assert [archive.replica_mode("save,load", r) for r in (0, 1)] == ["save", "load"]
    assert archive.replica_mode("load", 1) == archive.replica_mode("load", None) == "load"
    with pytest.raises(ValueError, match="no mode for data-parallel replica 2"):
        archive.replica_mode("save,load", 2)
    assert archive.is_mode("load,save") and archive.is_mode("save") and not archive.is_mode("auto,load")


def test_an_archive_of_another_parallel_layout_is_not_loaded(parse, cfg):
    """Two ranks saved under TP=2 are not two DP=2 replicas (nor the reverse): the layout is in the
    fingerprint, so auto SAVEs and mode=load is refused (``settle``)."""
    tp2, dp2 = parse(*BASE_ARGV, "--tp-size", "2"), parse(*BASE_ARGV, "--dp-size", "2")
    for rank in (0, 1):
        mark_complete(tp2, cfg, rank)
    assert archive.decide_mode(tp2, cfg) == "load"
    assert archive.decide_mode(dp2, cfg) == "save" and not archive.complete(dp2, cfg)
    saved, now = archive.fingerprint(tp2, cfg)["server_args"], archive.fingerprint(dp2, cfg)["server_args"]
    assert {"tp_size", "dp_size"} <= {k for k in saved if saved[k] != now.get(k)}
