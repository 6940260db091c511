"""A core archive refused by ``foundry_core.verify`` before the region is reserved (no GPU).

auto + one rank: a warning and a normal SAVE that replaces it; auto + several data-parallel ranks, or
mode = load: a one-line error.  ``foundry_core.verify`` is replaced by fakes, except where the real
one can refuse without a GPU (no manifest in the core archive, a path outside the archive_dir).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

import foundry_core
from foundry_core.archive import ArchiveError, FingerprintMismatch
from foundry_vllm_plugin import archive, session
from foundry_vllm_plugin.archive import ArchiveStateError
from foundry_vllm_plugin.session import FoundrySession

pytestmark = pytest.mark.vllm

FP = {"config_hash": "abc", "device": {"name": "NVIDIA H200"}}
SIZING = {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}


@pytest.fixture
def captures_only(monkeypatch):
    """Records the switch of module recording to counting only (a LOAD); no native library needed."""
    calls = []
    monkeypatch.setattr(session, "count_captures_only", lambda: calls.append(True))
    return calls


def _session(base_vllm_config, tmp_path, mode="auto", world_size=1, saved=True):
    s = FoundrySession(base_vllm_config)
    s.cfg = dataclasses.replace(s.cfg, mode=mode, archive_dir=tmp_path / "archive")
    s.fingerprint, s.world_size = dict(FP), world_size
    if saved:  # a manifest that matches this engine, and a core archive directory
        archive.core_archive_dir(s.cfg, 0).mkdir(parents=True)
        archive.write_manifest(archive.manifest_path(s.cfg, 0), FP, SIZING, [])
    return s


def _refusing(exc):
    calls = []

    def fake_verify(path, **kw):
        calls.append((path, kw))
        raise exc

    return fake_verify, calls


def _mismatch():
    return FingerprintMismatch(
        "archive saved on driver 570.1, this machine has 580.2: SAVE again",
        "driver",
        "570.1",
        "580.2",
    )


def test_auto_verifies_before_loading_and_loads_a_good_archive(
    base_vllm_config, tmp_path, monkeypatch, captures_only
):
    s = _session(base_vllm_config, tmp_path)
    calls = []
    monkeypatch.setattr(foundry_core, "verify", lambda path, **kw: calls.append((path, kw)))
    s.decide_mode(3)
    assert (s.mode, s.manifest["sizing"]) == ("load", SIZING)
    ((path, kw),) = calls
    assert path == archive.core_archive_dir(s.cfg, 0)
    assert kw == {
        "device": 3,
        "fingerprint_model": FP,
        "rank": 0,
        "world_size": 1,
        "expected_digest": s.cfg.digest_for_rank(0),
        "trusted_root": s.cfg.archive_dir,
        "inflate": False,  # inflated on a thread after the steps, while the engine loads its weights
    }
    assert captures_only == [True]  # LOAD: module images no longer copied
    assert s.report["mode"] == "load" and "refused" not in s.report


@pytest.mark.parametrize(
    "exc",
    [ArchiveError("archive x: modules/ab.cubin: sha256 mismatch (damaged or tampered)"), _mismatch()],
    ids=["damaged", "fingerprint"],
)
def test_auto_saves_over_a_refused_archive_with_a_warning(
    base_vllm_config, tmp_path, monkeypatch, captures_only, warnings_logged, exc
):
    s = _session(base_vllm_config, tmp_path)
    fake_verify, calls = _refusing(exc)
    monkeypatch.setattr(foundry_core, "verify", fake_verify)
    why = s.decide_mode(0)
    assert len(calls) == 1
    assert (s.mode, s.manifest) == ("save", None)  # KV sizing profiled, warmups and capture as usual
    assert captures_only == []  # module images kept for the SAVE
    path = archive.core_archive_dir(s.cfg, 0)
    expected = f"Foundry rank 0: archive {path} refused ({exc}); capturing and saving a fresh one"
    assert [r.getMessage() for r in warnings_logged] == [expected]
    assert warnings_logged[0].levelno == logging.WARNING
    assert why == f"archive {path} refused ({exc})" and s.report["reason"] == why
    assert s.report["mode"] == "save" and s.report["refused"] == str(exc)


def test_the_fresh_save_replaces_the_refused_archive(base_vllm_config, tmp_path, monkeypatch, captures_only):
    s = _session(base_vllm_config, tmp_path)
    fake_verify, _ = _refusing(_mismatch())
    monkeypatch.setattr(foundry_core, "verify", fake_verify)
    s.decide_mode(0)
    s.region, s.kv_cache_memory_bytes, s.num_gpu_blocks = object(), 2 << 30, 8192
    saved = []
    monkeypatch.setattr(foundry_core, "save", lambda path, **kw: saved.append(path))

    class Adapter:
        kind = "v2"

        def collect(self):
            return {"decode/g1": "G1"}, {}, [{"name": "decode/g1"}]

    s.save(Adapter())
    s.publish(0)
    assert saved == [archive.core_archive_dir(s.cfg, 0)]
    manifest = archive.read_manifest(archive.manifest_path(s.cfg, 0))
    assert manifest["sizing"]["kv_cache_memory_bytes"] == 2 << 30 and manifest["graphs"] == [
        {"name": "decode/g1"}
    ]


def test_auto_with_several_ranks_refuses_instead_of_saving_one(
    base_vllm_config, tmp_path, monkeypatch, captures_only, warnings_logged
):
    s = _session(base_vllm_config, tmp_path, world_size=2)
    fake_verify, calls = _refusing(_mismatch())
    monkeypatch.setattr(foundry_core, "verify", fake_verify)
    with pytest.raises(ArchiveStateError, match="refused .*start once with mode = save") as err:
        s.decide_mode(0)
    assert "\n" not in str(err.value) and "580.2" in str(err.value)
    assert calls[0][1]["world_size"] == 2
    assert s.mode is None and warnings_logged == [] and captures_only == []


@pytest.mark.parametrize("exc", [ArchiveError("archive x: manifest checksum mismatch"), _mismatch()])
def test_load_mode_refusal_is_an_error_with_the_reason(base_vllm_config, tmp_path, monkeypatch, exc):
    s = _session(base_vllm_config, tmp_path, mode="load")
    fake_verify, _ = _refusing(exc)
    monkeypatch.setattr(foundry_core, "verify", fake_verify)
    with pytest.raises(
        ArchiveStateError, match="Foundry rank 0: archive .* refused .*mode = load cannot go on"
    ) as err:
        s.decide_mode(0)
    assert str(exc) in str(err.value) and "\n" not in str(err.value)
    assert s.mode is None


def test_save_mode_and_a_missing_archive_do_not_verify(
    base_vllm_config, tmp_path, monkeypatch, captures_only
):
    monkeypatch.setattr(foundry_core, "verify", lambda path, **kw: pytest.fail("verify called"))
    s = _session(base_vllm_config, tmp_path, mode="save")
    s.decide_mode(0)
    assert s.mode == "save"
    fresh = _session(base_vllm_config, tmp_path / "other", saved=False)
    fresh.decide_mode(0)
    assert fresh.mode == "save" and "no archive manifest" in fresh.report["reason"]
    assert captures_only == []


def test_a_configuration_error_is_not_a_refusal(base_vllm_config, tmp_path, monkeypatch):
    s = _session(base_vllm_config, tmp_path)
    s.cfg = dataclasses.replace(s.cfg, archive_digests=((1, "0" * 64),))  # rank 0 left unpinned
    monkeypatch.setattr(foundry_core, "verify", lambda path, **kw: None)
    with pytest.raises(foundry_core.config.ConfigError, match="not rank 0"):
        s.decide_mode(0)


def test_real_verify_refuses_a_damaged_archive_without_a_gpu(
    base_vllm_config, tmp_path, captures_only, warnings_logged
):
    s = _session(base_vllm_config, tmp_path)  # the core archive directory is empty: no manifest
    s.decide_mode(0)
    assert s.mode == "save" and s.manifest is None
    assert "refused" in warnings_logged[0].getMessage() and captures_only == []


def test_an_archive_outside_the_archive_dir_is_refused(
    base_vllm_config, tmp_path, monkeypatch, warnings_logged
):
    s = _session(base_vllm_config, tmp_path, saved=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    s.cfg.archive_dir.mkdir()
    archive.core_archive_dir(s.cfg, 0).symlink_to(elsewhere, target_is_directory=True)
    archive.write_manifest(archive.manifest_path(s.cfg, 0), FP, SIZING, [])

    # The real fc.verify: it checks trusted_root before it opens anything.
    monkeypatch.setattr(
        foundry_core.api, "open_archive", lambda *a, **k: pytest.fail("opened before the location check")
    )
    monkeypatch.setattr(session, "count_captures_only", lambda: None)
    s.decide_mode(0)
    assert s.mode == "save" and "outside the configured directory" in s.report["refused"]
