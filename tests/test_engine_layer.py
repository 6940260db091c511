"""The engine layer's shared pieces: the record writer and the one refusal error."""

import functools
import json
import logging
import os
import sys
import threading
import types

import pytest

from foundry_core.config import ConfigError
from foundry_core.engine import FoundryUnsupportedError, read_json, write_json_atomic


def test_records_replace_atomically_and_leave_no_temporary(tmp_path):
    path = tmp_path / "archive" / "rank0.engine.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "when": tmp_path})  # default=str: a Path is written as text
    assert read_json(path) == {"a": 2, "when": str(tmp_path)}
    assert os.listdir(path.parent) == ["rank0.engine.json"]
    assert read_json(tmp_path / "missing.json") is None
    (tmp_path / "broken.json").write_text("{")
    assert read_json(tmp_path / "broken.json") is None


def test_a_failed_write_keeps_the_old_record(tmp_path):
    path = tmp_path / "rank0.json"
    write_json_atomic(path, {"ok": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object.__new__(_Unserializable)})
    assert json.loads(path.read_text()) == {"ok": True}
    assert os.listdir(tmp_path) == ["rank0.json"]


class _Unserializable:
    def __str__(self):
        raise TypeError("not JSON")


def test_refusal_is_one_line_and_a_config_error():
    err = FoundryUnsupportedError("SGLang", ["tp_size=2: needs symmetric memory", "lora: adapters"])
    assert str(err) == (
        "Foundry cannot run this SGLang configuration: tp_size=2: needs symmetric memory; lora: adapters"
    )
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.reasons == ["tp_size=2: needs symmetric memory", "lora: adapters"]


def test_both_plugins_raise_the_shared_error():
    from foundry_sglang_plugin.support import FoundryUnsupportedError as SGLangError
    from foundry_vllm_plugin.support import FoundryUnsupportedError as VllmError

    assert issubclass(SGLangError, FoundryUnsupportedError)
    assert issubclass(VllmError, FoundryUnsupportedError)
    e = VllmError("enforce_eager", "it turns CUDA graphs off")
    assert str(e) == "Foundry cannot run this vLLM configuration: enforce_eager: it turns CUDA graphs off"
    assert (e.feature, e.reason, e.engine) == ("enforce_eager", "it turns CUDA graphs off", "vLLM")


def test_a_refusal_at_server_start_ends_with_one_line(tmp_path):
    import subprocess
    import sys

    from foundry_core.engine import exiting

    err = exiting(FoundryUnsupportedError("SGLang", ["lora: adapters", "pp_size=2: stages"]))
    # Still the error it was, for code that catches it ...
    assert isinstance(err, FoundryUnsupportedError) and isinstance(err, ValueError)
    assert err.reasons == ["lora: adapters", "pp_size=2: stages"] and err.engine == "SGLang"
    assert exiting(err) is err
    # ... and, uncaught, one line and status 1 instead of a traceback.
    script = tmp_path / "serve.py"
    script.write_text(
        "from foundry_core.engine import FoundryUnsupportedError, exiting\n"
        "def start():\n"
        "    raise exiting(FoundryUnsupportedError('vLLM', ['lora: adapter slots']))\n"
        "start()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == "error: Foundry cannot run this vLLM configuration: lora: adapter slots\n"


def _cfg(tmp_path, mode="auto", **extra):
    from foundry_core.config import config_from_dict

    return config_from_dict({"mode": mode, "archive_dir": str(tmp_path / "a"), **extra})


def test_refusal_policy_is_one_for_both_engines(tmp_path, log_records):
    import logging

    from foundry_core.engine import decide

    records = log_records("engine.test", logging.WARNING)
    line = decide.after_refusal(
        _cfg(tmp_path), 0, 1, "checksum mismatch", log=logging.getLogger("engine.test")
    )
    assert (
        line
        == f"Foundry rank 0: archive {tmp_path / 'a' / 'rank0'} refused (checksum mismatch); capturing and saving a fresh one"
    )
    assert [r.getMessage() for r in records] == [line]
    with pytest.raises(decide.ArchiveRefused, match="has 2 ranks .* start once with mode = save") as err:
        decide.after_refusal(_cfg(tmp_path), 1, 2, "gpu_name differs")
    assert "\n" not in str(err.value) and "rank1" in str(err.value)
    with pytest.raises(KeyError, match="mode = load cannot go on"):  # the plugin's own error class
        decide.after_refusal(_cfg(tmp_path, "load"), 0, 1, "damaged", error=KeyError)


def test_verify_archive_reports_a_refusal_and_raises_on_a_bad_pin_table(tmp_path, monkeypatch):
    import foundry_core as fc
    from foundry_core.engine import decide

    seen = {}

    def refuse(path, **kw):
        seen.update(kw, path=path)
        raise fc.ArchiveError("archive x: member  modules/a.cubin\\n checksum mismatch")

    monkeypatch.setattr(fc, "verify", refuse)
    verified, reason = decide.verify_archive(_cfg(tmp_path), 0, device=3, fingerprint={"m": 1}, world_size=1)
    assert verified is None and reason == "archive x: member modules/a.cubin\\n checksum mismatch"
    assert seen["trusted_root"] == tmp_path / "a" and seen["device"] == 3 and seen["expected_digest"] is None
    pinned_other_rank = _cfg(tmp_path, trust={"archive_digest": {"1": "a" * 64}})
    with pytest.raises(ConfigError, match="pin every rank or none"):
        decide.verify_archive(pinned_other_rank, 0, device=0, fingerprint={}, world_size=2)


def test_every_error_foundry_raises_has_one_exported_base():
    import foundry_core as fc

    errors = [
        fc.ArchiveError,
        fc.ArchiveNotFound,
        fc.ArchiveLocationError,
        fc.FingerprintMismatch,
        fc.ConfigError,
        fc.CudaError,
        fc.GraphError,
        fc.ModuleError,
        fc.PlacementError,
        fc.RegionError,
        fc.SaveError,
        FoundryUnsupportedError,
    ]
    for cls in errors:
        assert issubclass(cls, fc.FoundryError), cls
        assert cls.__name__ in fc.__all__ or cls is FoundryUnsupportedError, cls
    # Each keeps the builtin it always was, so existing handlers still catch it.
    assert issubclass(fc.ConfigError, ValueError) and issubclass(fc.SaveError, RuntimeError)
    assert issubclass(fc.RegionError, RuntimeError) and issubclass(fc.ModuleError, RuntimeError)
    assert set(fc.__all__) <= set(dir(fc))
    # Raised from its own module (NVSHMEM's heap), caught with the rest all the same.
    from foundry_core.nvshmem import HeapPlacementError

    assert issubclass(HeapPlacementError, fc.FoundryError) and issubclass(HeapPlacementError, RuntimeError)


def test_archive_dir_problem_and_the_save_failure_policy(tmp_path, log_records):
    import logging

    from foundry_core.engine import decide

    assert decide.archive_dir_problem(_cfg(tmp_path)) is None  # created when missing
    assert (tmp_path / "a").is_dir() and list((tmp_path / "a").iterdir()) == []  # no probe left
    (tmp_path / "file").write_text("")
    blocked = _cfg(tmp_path, archive_dir=str(tmp_path / "file" / "a"))
    assert "is not writable" in decide.archive_dir_problem(blocked)

    records = log_records("engine.test", logging.WARNING)
    err = OSError(28, "No space left on device")
    decide.save_failed(_cfg(tmp_path), 0, err, logging.getLogger("engine.test"))  # auto: serve on
    assert "SAVE failed" in records[0].getMessage() and "No space left" in records[0].getMessage()
    with pytest.raises(OSError, match="No space left"):
        decide.save_failed(_cfg(tmp_path, "save"), 0, err)

    # auto deciding SAVE: a directory that cannot be written is named at the decision, once
    assert decide.save_blocked(_cfg(tmp_path), 0, logging.getLogger("engine.test")) is None
    assert len(records) == 1
    why = decide.save_blocked(blocked, 3, logging.getLogger("engine.test"))
    assert why.startswith(f"archive_dir {tmp_path / 'file' / 'a'} is not writable (")
    assert records[1].getMessage() == (
        f"Foundry rank 3: {why}; auto mode serves with the graphs it captures and saves nothing this time"
    )
    save_mode = _cfg(tmp_path, "save", archive_dir=str(tmp_path / "file" / "a"))
    assert decide.save_blocked(save_mode, 0) is None and len(records) == 2  # save refused at startup


def test_one_line_keeps_the_reason_at_the_end_of_a_long_error():
    from foundry_core.engine.decide import one_line

    long = RuntimeError("graph 'decode/size=256': kernel " + "x" * 2000 + "\n  points outside the region")
    line = one_line(long)
    assert len(line) <= 500 and "\n" not in line
    assert line.startswith("graph 'decode/size=256'") and line.endswith("points outside the region")
    assert one_line(RuntimeError("short")) == "short" and one_line(RuntimeError()) == "RuntimeError"


def test_profiled_writes_a_profile_only_when_asked(tmp_path, monkeypatch):
    from foundry_core.engine.profiling import ENV, profiled

    def phase():
        return sum(i * i for i in range(20000))

    monkeypatch.delenv(ENV, raising=False)
    with profiled("quiet", 0):
        phase()
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(ENV, str(tmp_path / "profiles"))
    with profiled("graphs-load", 3):
        phase()
    text = (tmp_path / "profiles" / "graphs-load-rank3.txt").read_text()
    assert "phase" in text and "cumulative" in text
    assert (tmp_path / "profiles" / "graphs-load-rank3.prof").stat().st_size > 0


# --- prewarm: Triton's per-process cache key -----------------------------------------------------


def test_triton_key_is_warmed_on_a_background_thread(monkeypatch):
    cache = pytest.importorskip("triton.runtime.cache", reason="Triton is not installed here")
    from foundry_core.engine import prewarm

    monkeypatch.setattr(prewarm, "_thread", None)
    cache.triton_key.cache_clear()
    callers = []
    real = cache.triton_key.__wrapped__

    def recording():
        callers.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(cache, "triton_key", functools.lru_cache()(recording))
    thread = prewarm.start()
    assert thread is not None and thread.daemon
    thread.join(120)
    assert callers == ["foundry-triton-key"]  # computed off the calling thread
    assert cache.triton_key.cache_info().currsize == 1  # the engine's first launch finds it
    assert prewarm.start() is None  # once per process


def test_prewarm_can_be_switched_off(monkeypatch):
    """FOUNDRY_PREWARM=0: nothing is started (and nothing imported), so the engine's first Triton
    launch computes the key as it does without Foundry."""
    import types

    from foundry_core.engine import prewarm

    called = []
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    fake = types.ModuleType("triton.runtime.cache")
    fake.triton_key = lambda: called.append("key")
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", fake)
    monkeypatch.setattr(prewarm, "_thread", None)
    monkeypatch.setenv("FOUNDRY_PREWARM", "0")
    assert prewarm.start() is None and called == []
    monkeypatch.setenv("FOUNDRY_PREWARM", "1")
    prewarm.start().join(10)
    assert called == ["key"]


def test_prewarm_without_triton_does_nothing(monkeypatch):
    from foundry_core.engine import prewarm

    monkeypatch.setattr(prewarm, "_thread", None)
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", None)  # import fails as if absent
    assert prewarm.start() is None


def test_a_record_write_removes_only_this_hosts_orphaned_temporaries(tmp_path):
    import subprocess

    from foundry_core.engine import records

    record = tmp_path / "rank0.x.json"
    host = records._host()
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead = proc.pid  # a process that has exited
    names = {
        "dead": f"rank0.x.json.{host}-{dead}.abc.tmp",
        "alive": f"rank0.x.json.{host}-{os.getpid()}.abc.tmp",  # a writer still at work
        "other host": f"rank0.x.json.otherhost-{dead}.abc.tmp",  # its processes cannot be seen here
        "other record": f"rank1.x.json.{host}-{dead}.abc.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_text("{")
    write_json_atomic(record, {"ok": 1})
    left = {p.name for p in tmp_path.glob("*.tmp")}
    assert left == {names["alive"], names["other host"], names["other record"]}
    assert read_json(record) == {"ok": 1}


def test_inductor_pin_sets_what_is_missing_and_names_a_contradiction():
    from foundry_core.engine import inductor

    config = {"max_autotune": True}
    assert inductor.pin(config) is None
    assert config == {"max_autotune": True, "dynamic_scale_rblock": False}
    assert inductor.pin(config) is None  # idempotent
    theirs = {"dynamic_scale_rblock": True}
    why = inductor.pin(theirs)
    assert why.startswith("dynamic_scale_rblock=True: ") and "halved reduction blocks" in why
    assert theirs == {"dynamic_scale_rblock": True}  # left as the user set it: the plugin refuses


def test_inductor_pin_process_sets_this_process_defaults_once(monkeypatch, caplog):
    """Other torch.compile calls in the worker (not the engine's own model compile) take the
    process defaults: the pin puts them in the environment torch reads them from and, where torch's
    Inductor config is imported already, in the module; a second call changes nothing."""
    from foundry_core.engine import inductor

    env = "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK"
    monkeypatch.setenv(env, "1")  # a user's contrary setting: overridden, and said so
    monkeypatch.delitem(sys.modules, "torch._inductor.config", raising=False)
    with caplog.at_level(logging.INFO, logger="foundry"):
        assert inductor.pin_process() == {"dynamic_scale_rblock": "1"}
    assert os.environ[env] == "0"
    assert "Inductor dynamic_scale_rblock=False in this process" in caplog.text
    assert inductor.pin_process() == {}

    config = types.SimpleNamespace(dynamic_scale_rblock=True)  # torch's module, imported already
    monkeypatch.setitem(sys.modules, "torch._inductor.config", config)
    assert inductor.pin_process() == {"dynamic_scale_rblock": True}
    assert config.dynamic_scale_rblock is False and os.environ[env] == "0"


def test_only_auto_mode_saves_over_just_the_archive_it_saw(tmp_path):
    import dataclasses

    from foundry_core.archive import ANY_VERSION
    from foundry_core.config import FoundryConfig
    from foundry_core.engine import decide

    cfg = FoundryConfig(archive_dir=tmp_path)
    seen = decide.archive_stamp(tmp_path / "rank0")
    assert seen is None
    auto = decide.save_guard(dataclasses.replace(cfg, mode="auto"), seen)
    assert auto == {"expected_version": None, "lock_timeout": decide.AUTO_SAVE_LOCK_WAIT_S}
    save = decide.save_guard(dataclasses.replace(cfg, mode="save"), seen)
    assert save["expected_version"] is ANY_VERSION and save["lock_timeout"] == 0.0


def test_every_foundry_switch_reads_the_same_way(monkeypatch):
    # On unless the variable is "0" (spaces ignored); any other value, "false" included, leaves it on.
    from foundry_core.switches import switched_on

    monkeypatch.delenv("FOUNDRY_SOME_SWITCH", raising=False)
    assert switched_on("FOUNDRY_SOME_SWITCH")
    for value, on in (("0", False), (" 0\n", False), ("1", True), ("", True), ("false", True)):
        monkeypatch.setenv("FOUNDRY_SOME_SWITCH", value)
        assert switched_on("FOUNDRY_SOME_SWITCH") is on
    assert switched_on("X", {"X": "0"}) is False and switched_on("X", {}) is True
    from foundry_core.engine import readahead  # its own copy of the test (loaded alone in its helper)

    for value in ("0", " 0\n", "1", "", "false"):
        assert readahead.enabled({readahead.ENV: value}) is switched_on(readahead.ENV, {readahead.ENV: value})


def test_a_launch_names_a_configuration_by_its_flag_or_foundry_config():
    # The early start and the read-ahead ask this one question; an empty FOUNDRY_CONFIG or a flag
    # that only begins like ours names nothing.
    from foundry_core.switches import config_path

    assert config_path(["serve", "--foundry-config", "f.toml"], {}) == "f.toml"
    assert config_path(["serve", "--foundry-config=f.toml"], {}) == "f.toml"
    assert config_path(["serve"], {"FOUNDRY_CONFIG": "f.toml"}) == "f.toml"
    assert config_path(["serve", "--foundry-configs", "f.toml"], {}) is None
    assert config_path(["serve"], {"FOUNDRY_CONFIG": ""}) is None
    # The plugins spell it out (their register() imports nothing of the core): they read a command
    # line alike.
    import foundry_sglang_plugin
    import foundry_vllm_plugin

    cases = [
        (a, e)
        for a in (["--foundry-config", "f"], ["--foundry-config=f"], ["--foundry-configs", "f"], [])
        for e in ({}, {"FOUNDRY_CONFIG": ""}, {"FOUNDRY_CONFIG": "f"})
    ]
    for argv, env in cases:
        named = config_path(argv, env) is not None
        assert foundry_sglang_plugin._config_named(argv, env) is named
        assert foundry_vllm_plugin._config_named(argv, env) is named
