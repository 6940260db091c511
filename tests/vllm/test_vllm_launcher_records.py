"""vLLM's API server inspects the model class in a subprocess that imports the engine (about 20 s
of a cold start on the H200 machine) unless ``$VLLM_CACHE_ROOT/modelinfos`` holds a record for it. With Foundry, a SAVE
records it in the private vLLM cache (it is carried with the other caches) and a LOAD hands it to the
launching process before vLLM builds its config. Real vLLM, its real registry."""

from __future__ import annotations

import os

import pytest
from foundry_vllm_testutil import write_toml

from foundry_core.engine import caches, undo_launch_redirect

pytestmark = pytest.mark.vllm


@pytest.fixture
def registry(caches_machine):
    """vLLM's registry with its in-process memo emptied; a fixed machine fingerprint for the caches
    archive and private cache folders (``caches_machine``, tests/conftest.py)."""
    from vllm.model_executor.models import registry as reg

    reg._try_inspect_model_cls.cache_clear()
    yield reg
    reg._try_inspect_model_cls.cache_clear()


def _records(root: str) -> list[str]:
    folder = os.path.join(root, "modelinfos")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _record(registry, cache_root: str, mi) -> None:
    """The record vLLM's registry writes after an inspection, made with its own helpers (the test
    platform turns vLLM's writer off: it imports CUDA-only modules)."""
    import dataclasses
    import json
    from pathlib import Path

    lazy = registry._LazyRegisteredModel("vllm.model_executor.models.qwen3", "Qwen3ForCausalLM")
    source = Path(registry.__file__).parent / "qwen3.py"
    folder = Path(cache_root) / "modelinfos"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"hash": lazy._get_modelinfo_module_hash(source), "modelinfo": dataclasses.asdict(mi)}
    (folder / lazy._get_cache_filename()).write_text(json.dumps(record))


def test_a_load_hands_the_model_record_to_the_launcher(engine_args_factory, tmp_path, registry, monkeypatch):
    from vllm import envs

    toml = tmp_path / "foundry.toml"
    archive_dir = tmp_path / "archive"
    real_inspection = registry._run_in_subprocess
    seen = []

    def inspection(fn):
        seen.append(envs.VLLM_CACHE_ROOT)  # where vLLM keeps the record of this inspection
        mi = real_inspection(fn)
        _record(registry, envs.VLLM_CACHE_ROOT, mi)
        return mi

    # SAVE: vLLM inspects the model with its cache already pointed at Foundry's private folder, so
    # the record is among the caches the SAVE packs.
    monkeypatch.setattr(registry, "_run_in_subprocess", inspection)
    write_toml(toml, mode="save", archive_dir=str(archive_dir))
    engine_args_factory(additional_config={"foundry": {"config": str(toml)}}).create_engine_config()
    saved_root = os.environ["VLLM_CACHE_ROOT"]
    assert seen == [saved_root] and saved_root.startswith(str(tmp_path / "private"))
    assert _records(saved_root) == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"]
    from foundry_vllm_plugin.session import engine_facts

    caches.pack(
        archive_dir / "rank0.caches", caches.CacheDirs.inherited(["vllm"]), device=0, engine=engine_facts()
    )
    undo_launch_redirect()  # the SAVE server ended; its private folder is emptied by the next start
    registry._try_inspect_model_cls.cache_clear()

    # LOAD in a new container: the record comes from the archive; no inspection runs.
    def no_inspection(fn):
        raise AssertionError("vLLM inspected the model class although the archive carries its record")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_inspection)
    write_toml(toml, mode="auto", archive_dir=str(archive_dir))
    config = engine_args_factory(additional_config={"foundry": {"config": str(toml)}}).create_engine_config()
    assert config.model_config.architectures == ["Qwen3ForCausalLM"]
    assert os.environ["VLLM_CACHE_ROOT"] == saved_root  # the same private folder, refilled
    assert _records(saved_root) == ["vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"]


def test_without_carried_records_vllm_inspects_as_usual(engine_args_factory, tmp_path, registry, monkeypatch):
    calls, real_inspection = [], registry._run_in_subprocess
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: calls.append(1) or real_inspection(fn))
    toml = write_toml(tmp_path / "foundry.toml", mode="auto", archive_dir=str(tmp_path / "empty"))
    engine_args_factory(additional_config={"foundry": {"config": str(toml)}}).create_engine_config()
    assert calls == [1]


def test_a_save_records_what_the_api_server_read_for_the_loads_read_ahead(engine_args_factory, tmp_path):
    import json
    import time

    from foundry_core.engine import readahead

    toml = tmp_path / "foundry.toml"
    archive_dir = tmp_path / "archive"
    write_toml(toml, mode="save", archive_dir=str(archive_dir))
    engine_args_factory(additional_config={"foundry": {"config": str(toml)}}).create_engine_config()
    undo_launch_redirect()
    listed = archive_dir / f"{readahead.PREFIX}api-server.json"
    deadline = time.monotonic() + 60
    while not listed.is_file() and time.monotonic() < deadline:  # written on a daemon thread
        time.sleep(0.1)
    files = [e["path"] for e in json.loads(listed.read_text())["files"]]
    # The API server's own modules are there (vLLM's engine arguments, compiled or source).
    assert any("/vllm/engine/" in f and "arg_utils" in f for f in files), files[:5]
