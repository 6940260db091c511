"""The release gate and ``strict`` with the real installed vLLM: ``EngineArgs.create_engine_config``
(the path of ``vllm serve`` and ``vllm.LLM``) refuses a release outside the tested range in one line
before vLLM builds anything; ``allow_untested_release`` goes on and the worker's every LOAD reads its
graphs back; ``strict`` turns the worker's ``auto`` fallbacks into one-line refusals."""

from __future__ import annotations

import dataclasses
import types
from importlib.metadata import version

import pytest
from foundry_vllm_testutil import write_toml

import foundry_core
from foundry_core.archive import ArchiveError
from foundry_core.engine import release
from foundry_vllm_plugin import archive, engine_args, session
from foundry_vllm_plugin.archive import ArchiveStateError
from foundry_vllm_plugin.session import FoundrySession

pytestmark = pytest.mark.vllm

FP = {"config_hash": "abc", "device": {"name": "NVIDIA H200"}}
SIZING = {"kv_cache_memory_bytes": 1 << 30, "num_gpu_blocks": 4096, "runner": "v2"}


@pytest.fixture
def launched(monkeypatch):
    """Whether the wrapper got past the gate to vLLM's own work (its first step, the launch caches)."""
    calls = []
    original = engine_args.launch_caches
    monkeypatch.setattr(engine_args, "launch_caches", lambda extra: calls.append(1) or original(extra))
    return calls


def refused_line(args, launched) -> str:
    with pytest.raises(SystemExit) as err:
        args.create_engine_config()
    assert isinstance(err.value, release.UntestedReleaseError)
    line = str(err.value.code)
    assert "\n" not in line and line.startswith("error: ")
    assert launched == []  # refused before vLLM built anything
    return line


def test_the_installed_vllm_is_in_the_tested_range(engine_args_factory, foundry_toml, launched):
    assert release.in_range(version("vllm"), release.TESTED["vllm"])
    engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}}).create_engine_config()
    assert launched == [1]


def test_the_installed_vllm_is_refused_when_the_range_excludes_it(
    engine_args_factory, foundry_toml, monkeypatch, launched
):
    monkeypatch.setitem(release.TESTED, "vllm", ">=0.34.0,<0.35")
    args = engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}})
    line = refused_line(args, launched)
    assert f"Foundry is tested with vllm >=0.34.0,<0.35 but this is vllm {version('vllm')}" in line


def test_an_older_vllm_release_is_refused(engine_args_factory, foundry_toml, monkeypatch, launched):
    """0.26.0, the release validated before this range: its version string, on the real path."""
    monkeypatch.setattr(release, "installed_version", lambda engine: "0.26.0")
    args = engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}})
    line = refused_line(args, launched)
    assert "vllm >=0.33.0,<0.34 but this is vllm 0.26.0" in line and "allow_untested_release" in line


def test_without_foundry_the_gate_does_not_apply(engine_args_factory, monkeypatch):
    monkeypatch.setattr(release, "installed_version", lambda engine: "0.26.0")
    engine_args_factory().create_engine_config()  # stock vLLM is none of Foundry's business


def test_allow_untested_release_goes_on_and_structure_checks_every_load(
    engine_args_factory, tmp_path, monkeypatch, warnings_logged
):
    monkeypatch.setattr(release, "installed_version", lambda engine: "0.26.0")
    toml = write_toml(tmp_path / "foundry.toml", extra="allow_untested_release = true\n")
    config = engine_args_factory(additional_config={"foundry": {"config": str(toml)}}).create_engine_config()
    untested = [r.getMessage() for r in warnings_logged if "outside the tested range" in r.getMessage()]
    assert len(untested) == 1 and "vllm 0.26.0" in untested[0]

    s = FoundrySession(config)  # the worker's session
    assert s.cfg.check_structure is True and s.cfg.allow_untested_release is True
    s.region, s.mode, s.fingerprint = object(), "load", dict(FP)
    s.manifest = {"sizing": dict(SIZING), "graphs": []}
    checked = []
    restored = types.SimpleNamespace(
        graphs={}, tensors={}, slots={}, digest="d" * 64, timings={}, unload=lambda: None
    )
    restored.archive = types.SimpleNamespace(meta={"graphs": {}})
    restored.check = lambda: checked.append(1) or {}
    monkeypatch.setattr(foundry_core, "load", lambda path, **kw: restored)

    class Adapter:
        kind = "v2"

        def install(self, restored, listing):
            return 0

    s._load_checked(Adapter())
    assert checked == [1] and "structure_check_s" in restored.timings


def _refusing_session(base_vllm_config, tmp_path, monkeypatch, strict: bool) -> FoundrySession:
    s = FoundrySession(base_vllm_config)
    s.cfg = dataclasses.replace(s.cfg, mode="auto", archive_dir=tmp_path / "archive", strict=strict)
    s.fingerprint = dict(FP)
    archive.core_archive_dir(s.cfg, 0).mkdir(parents=True)
    archive.write_manifest(archive.manifest_path(s.cfg, 0), FP, SIZING, [])

    def verify(path, **kw):
        raise ArchiveError(f"archive {path}: graphs/decode.bin: checksum mismatch")

    monkeypatch.setattr(foundry_core, "verify", verify)
    monkeypatch.setattr(session, "count_captures_only", lambda: None)
    return s


def test_auto_records_its_fallback_in_the_start_report(
    base_vllm_config, tmp_path, monkeypatch, warnings_logged
):
    s = _refusing_session(base_vllm_config, tmp_path, monkeypatch, strict=False)
    s.decide_mode(0)
    (warning,) = [r.getMessage() for r in warnings_logged]
    assert s.mode == "save" and s.report["fallback"] == warning
    assert "checksum mismatch" in warning and warning.endswith("capturing and saving a fresh one")


def test_strict_auto_refuses_a_refused_archive_in_one_line(
    base_vllm_config, tmp_path, monkeypatch, warnings_logged
):
    s = _refusing_session(base_vllm_config, tmp_path, monkeypatch, strict=True)
    with pytest.raises(ArchiveStateError) as err:
        s.decide_mode(0)
    line = str(err.value)
    assert "\n" not in line and "checksum mismatch" in line and "strict = true" in line
    assert s.mode is None and not warnings_logged
