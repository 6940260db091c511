"""Auto mode: LOAD exactly when a valid archive for this configuration exists, else SAVE."""

from __future__ import annotations

import copy
import json

import pytest
from foundry_vllm_testutil import write_toml

from foundry_core.config import load_config
from foundry_vllm_plugin import archive
from foundry_vllm_plugin.archive import ArchiveStateError
from foundry_vllm_plugin.settings import foundry_config

pytestmark = pytest.mark.vllm

DEVICE = {"name": "NVIDIA H200", "capability": [9, 0], "torch": "x", "cuda": "13.0"}


def _saved(cfg, fingerprint, rank=0, sizing=None):
    archive.core_archive_dir(cfg, rank).mkdir(parents=True)
    return archive.write_manifest(
        archive.manifest_path(cfg, rank),
        fingerprint,
        sizing or {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"},
        [{"name": "decode/num_tokens=1", "key": {"num_tokens": 1}}],
    )


def test_fingerprint_is_json_and_reproducible(base_vllm_config):
    a = archive.engine_fingerprint(base_vllm_config, DEVICE)
    b = archive.engine_fingerprint(copy.deepcopy(base_vllm_config), DEVICE)
    assert a == b == json.loads(json.dumps(a))
    assert a["cudagraph_mode"] == "FULL_DECODE_ONLY" and a["device"]["name"] == "NVIDIA H200"


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda c: setattr(c.scheduler_config, "max_num_seqs", 7), "max_num_seqs"),
        (lambda c: setattr(c.cache_config, "gpu_memory_utilization", 0.5), "gpu_memory_utilization"),
        (lambda c: setattr(c.model_config, "max_model_len", 512), "max_model_len"),
        (
            lambda c: setattr(c.compilation_config, "cudagraph_capture_sizes", [1, 2]),
            "cudagraph_capture_sizes",
        ),
    ],
    ids=["max_num_seqs", "gpu_memory_utilization", "max_model_len", "capture_sizes"],
)
def test_fingerprint_changes_with_the_engine_configuration(base_vllm_config, change, key):
    other = copy.deepcopy(base_vllm_config)
    change(other)
    a = archive.engine_fingerprint(base_vllm_config, DEVICE)
    b = archive.engine_fingerprint(other, DEVICE)
    assert a[key] != b[key]
    assert key in archive.fingerprint_mismatch(a, b) or "config_hash" in archive.fingerprint_mismatch(a, b)


def test_a_hybrid_fingerprint_holds_its_state_cache_settings(base_vllm_config, monkeypatch):
    """A hybrid model's fingerprint adds what shapes its state caches and decode kernels and is not in
    vLLM's config hash: the state dtypes and cache mode, prefix caching, the GDN layout switches."""
    import dataclasses

    assert "hybrid" not in archive.engine_fingerprint(base_vllm_config, DEVICE)  # dense: unchanged
    config = copy.deepcopy(base_vllm_config)
    config.model_config._model_info = dataclasses.replace(config.model_config._model_info, is_hybrid=True)
    config.model_config.hf_config.layer_types = ["full_attention", "linear_attention"]
    config.model_config._architecture = "Qwen3NextForCausalLM"
    for cached in ("architecture", "is_hybrid"):  # cached properties in some releases
        config.model_config.__dict__.pop(cached, None)
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    a = archive.engine_fingerprint(config, DEVICE)
    assert a["hybrid"]["architecture"] == "Qwen3NextForCausalLM"
    assert {"mamba_cache_mode", "mamba_ssm_cache_dtype", "enable_prefix_caching"} <= set(a["hybrid"])
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    b = archive.engine_fingerprint(config, DEVICE)
    assert archive.fingerprint_mismatch(a, b) == "hybrid: archive has " + repr(
        a["hybrid"]
    ) + ", engine has " + repr(b["hybrid"])


def test_fingerprint_changes_with_the_device(base_vllm_config):
    a = archive.engine_fingerprint(base_vllm_config, DEVICE)
    b = archive.engine_fingerprint(base_vllm_config, {**DEVICE, "name": "NVIDIA H100"})
    assert archive.fingerprint_mismatch(a, b).startswith("device:")


def test_auto_saves_when_there_is_no_archive(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    mode, manifest, why = archive.resolve_mode(cfg, 0, {"a": 1})
    assert (mode, manifest) == ("save", None) and "no archive manifest" in why


def test_auto_loads_a_matching_archive(tmp_path, base_vllm_config):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    fp = archive.engine_fingerprint(base_vllm_config, DEVICE)
    written = _saved(cfg, fp)
    mode, manifest, _ = archive.resolve_mode(cfg, 0, fp)
    assert mode == "load" and manifest == written
    assert manifest["sizing"]["kv_cache_memory_bytes"] == 1 << 30


def test_auto_saves_over_an_archive_for_another_configuration(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    _saved(cfg, {"max_num_seqs": 8})
    mode, manifest, why = archive.resolve_mode(cfg, 0, {"max_num_seqs": 16})
    assert (mode, manifest) == ("save", None)
    assert "max_num_seqs: archive has 8, engine has 16" in why


def test_auto_saves_when_the_core_archive_is_missing(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    _saved(cfg, {"a": 1})
    archive.core_archive_dir(cfg, 0).rmdir()
    assert archive.resolve_mode(cfg, 0, {"a": 1})[0] == "save"


def test_archives_are_per_rank(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    _saved(cfg, {"a": 1}, rank=0)
    assert archive.resolve_mode(cfg, 0, {"a": 1})[0] == "load"
    assert archive.resolve_mode(cfg, 1, {"a": 1})[0] == "save"


def test_load_mode_refuses_without_a_valid_archive(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="load"))
    with pytest.raises(ArchiveStateError, match="foundry mode = load, but no archive manifest") as err:
        archive.resolve_mode(cfg, 0, {"a": 1})
    assert "\n" not in str(err.value)
    _saved(cfg, {"a": 1})
    with pytest.raises(ArchiveStateError, match="saved for another configuration"):
        archive.resolve_mode(cfg, 0, {"a": 2})
    assert archive.resolve_mode(cfg, 0, {"a": 1})[0] == "load"


def test_a_load_naming_another_toml_than_its_save_is_refused_naming_both(tmp_path, base_vllm_config):
    """vLLM hashes ``additional_config`` (the TOML's path) into its config hash: a LOAD started with
    another file than its SAVE's (a natural save.toml / load.toml pair) cannot find its archive or its
    compile cache, and says so in words rather than as two hashes (seen on an H100, 2026-12-05)."""
    load_toml = write_toml(tmp_path / "load.toml", mode="load", archive_dir=str(tmp_path / "archive"))
    cfg = load_config(load_toml)
    saved = archive.engine_fingerprint(base_vllm_config, DEVICE)
    _saved(cfg, saved)
    other = copy.deepcopy(base_vllm_config)
    other.additional_config = {"foundry": {"config": str(load_toml)}}
    now = archive.engine_fingerprint(other, DEVICE)
    assert saved["config_hash"] != now["config_hash"]  # vLLM's own hash moves with the path
    with pytest.raises(ArchiveStateError) as err:
        archive.resolve_mode(cfg, 0, now)
    message = str(err.value)
    assert saved["foundry_config"] in message and str(load_toml) in message and "same file" in message
    assert "\n" not in message
    # An archive written before the path was kept compares by the hash alone, as before.
    legacy = {k: v for k, v in saved.items() if k != "foundry_config"}
    assert archive.fingerprint_mismatch(legacy, now).startswith("config_hash:")
    assert archive.fingerprint_mismatch(legacy, {**saved}) is None


def test_save_mode_always_saves(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="save"))
    _saved(cfg, {"a": 1})
    assert archive.resolve_mode(cfg, 0, {"a": 1})[:2] == ("save", None)


def test_damaged_manifest_counts_as_missing(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml", mode="auto"))
    _saved(cfg, {"a": 1})
    path = archive.manifest_path(cfg, 0)
    path.write_text(path.read_text()[:-10])
    assert archive.read_manifest(path) is None
    assert archive.resolve_mode(cfg, 0, {"a": 1})[0] == "save"


def test_manifest_write_is_atomic_and_leaves_no_temporaries(tmp_path):
    cfg = load_config(write_toml(tmp_path / "f.toml"))
    _saved(cfg, {"a": 1})
    _saved_again = archive.write_manifest(archive.manifest_path(cfg, 0), {"a": 2}, {}, [])
    assert archive.read_manifest(archive.manifest_path(cfg, 0)) == _saved_again
    assert sorted(p.name for p in cfg.archive_dir.iterdir()) == ["rank0", "rank0.vllm.json"]


def test_worker_reads_the_same_settings_the_front_end_wrote(base_vllm_config):
    cfg = foundry_config(base_vllm_config.additional_config)
    assert cfg is not None and cfg.mode == "auto" and cfg.archive_dir.name == "archive"
