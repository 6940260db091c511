"""The worker's archive bookkeeping around foundry_core.save/load (no GPU: the core calls are recorded).

Only ``foundry_core.save`` / ``foundry_core.load`` are replaced, by recorders; the session, manifest and
settings code under test is the real one, fed with a real VllmConfig.
"""

from __future__ import annotations

import types

import pytest

import foundry_core
from foundry_vllm_plugin import archive
from foundry_vllm_plugin.graphs import FoundryRestoreError
from foundry_vllm_plugin.session import FoundrySession

pytestmark = pytest.mark.vllm


class Adapter:
    kind = "v2"

    def __init__(self):
        self.installed = None

    def collect(self):
        return {"decode/g1": "G1", "decode/g2": "G2"}, {"hidden_states": "T"}, [{"name": "decode/g1"}]

    def install(self, restored, listing):
        self.installed = (restored, listing)
        return len(restored.graphs)


def _session(base_vllm_config, mode):
    s = FoundrySession(base_vllm_config)
    s.region, s.mode, s.fingerprint = object(), mode, {"config_hash": "abc"}
    s.kv_cache_memory_bytes, s.num_gpu_blocks = 1 << 30, 4096
    return s


def test_save_writes_the_manifest_only_after_the_core_archive(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "save")
    mpath = archive.manifest_path(s.cfg, 0)
    archive.write_manifest(mpath, {"old": 1}, {}, [])  # a stale manifest from an earlier SAVE
    calls = []

    def fake_save(path, **kw):
        calls.append((path, kw, mpath.exists()))
        return "digest"

    monkeypatch.setattr(foundry_core, "save", fake_save)
    s.save(Adapter())
    ((path, kw, manifest_existed_during_save),) = calls
    assert path == archive.core_archive_dir(s.cfg, 0)
    assert manifest_existed_during_save is False  # removed before the core writes
    assert kw["graphs"] == {"decode/g1": "G1", "decode/g2": "G2"} and kw["tensors"] == {"hidden_states": "T"}
    assert kw["region"] is s.region and kw["fingerprint_model"] == {"config_hash": "abc"}
    assert kw["slots"] == {
        "kv_cache_memory_bytes": 1 << 30,
        "num_gpu_blocks": 4096,
        "runner": "v2",
        "setup": None,
    }
    assert (kw["rank"], kw["world_size"]) == (0, 1)
    manifest = archive.read_manifest(mpath)
    assert manifest["fingerprint"] == {"config_hash": "abc"} and manifest["sizing"] == kw["slots"]


def test_failed_core_save_leaves_no_manifest(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "save")
    mpath = archive.manifest_path(s.cfg, 0)
    archive.write_manifest(mpath, {"old": 1}, {}, [])

    def failing_save(path, **kw):
        raise foundry_core.SaveError("graph 'x': pointer outside the region")

    monkeypatch.setattr(foundry_core, "save", failing_save)
    with pytest.raises(foundry_core.SaveError):
        s.save(Adapter())
    assert not mpath.exists()
    assert archive.resolve_mode(s.cfg, 0, {"config_hash": "abc"})[0] == "save"


def _restored(**slots):
    return types.SimpleNamespace(graphs={"decode/g1": "R1"}, tensors={}, slots=slots)


def test_restore_passes_the_pinned_digest_and_installs(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {
        "sizing": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"},
        "graphs": [],
    }
    seen = {}

    def fake_load(path, **kw):
        seen.update(kw, path=path)
        return _restored(kv_cache_memory_bytes=1 << 30, num_gpu_blocks=4096, runner="v2")

    monkeypatch.setattr(foundry_core, "load", fake_load)
    adapter = Adapter()
    assert s.restore(adapter) == 1
    assert seen["path"] == archive.core_archive_dir(s.cfg, 0)
    assert seen["expected_digest"] == s.cfg.archive_digest and seen["fingerprint_model"] == s.fingerprint
    assert adapter.installed[0].graphs == {"decode/g1": "R1"}


def test_restore_refuses_sizing_that_disagrees_with_the_manifest(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {
        "sizing": {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"},
        "graphs": [],
    }
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: _restored(num_gpu_blocks=2048))
    with pytest.raises(FoundryRestoreError, match="num_gpu_blocks=2048 disagrees"):
        s.restore(Adapter())


def test_restore_refuses_an_archive_from_the_other_model_runner(base_vllm_config, monkeypatch):
    s = _session(base_vllm_config, "load")
    s.manifest = {"sizing": {"kv_cache_memory_bytes": 1, "num_gpu_blocks": 1, "runner": "v1"}, "graphs": []}
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: _restored())
    with pytest.raises(FoundryRestoreError, match="saved from model runner v1, this engine uses v2"):
        s.restore(Adapter())


class Region:
    def __init__(self, segments, cursor):
        self._segments, self.cursor, self.marked = segments, cursor, False

    def segments(self):
        return [object()] * self._segments

    def end_setup(self):
        self.marked = True


def test_setup_boundary_is_marked_and_recorded_only_when_saving(base_vllm_config):
    save = _session(base_vllm_config, "save")
    save.region = Region(5, 0x4000000)
    save.end_setup()
    assert save.region.marked and save.setup == {"segments": 5, "cursor": 0x4000000}
    load = _session(base_vllm_config, "load")
    load.manifest = {"sizing": {"setup": save.setup}}
    load.region = Region(5, 0x4000000)
    load.end_setup()  # same layout: fine
    assert not load.region.marked


def test_load_reports_a_diverged_setup_before_warmup(base_vllm_config):
    load = _session(base_vllm_config, "load")
    load.manifest = {"sizing": {"setup": {"segments": 5, "cursor": 0x4000000}}}
    load.region = Region(6, 0x4200000)
    with pytest.raises(FoundryRestoreError, match="region setup diverged from the SAVE: 6 allocations"):
        load.end_setup()
