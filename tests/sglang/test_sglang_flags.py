"""--enable-foundry / --foundry-config through SGLang's real parser, Engine and launch checks."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle

import pytest

pytestmark = pytest.mark.sglang

BASE_ARGV = ["--device", "cuda", "--cuda-graph-backend-prefill", "disabled", "--tp-size", "1"]

_SNAPSHOT = """
import json, msgspec
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args({argv!r})
print(json.dumps({{
    "fields": {{k: repr(v) for k, v in msgspec.structs.asdict(sa).items()}},
    "extra": sorted(sa.__dict__),
    "plugins": __import__("sys").modules.get("foundry_sglang_plugin") is not None,
}}))
"""


def test_flags_reach_server_args(parse, foundry_toml):
    sa = parse("--cuda-graph-backend-prefill", "disabled")
    assert sa.enable_foundry is True
    assert sa.foundry_config == str(foundry_toml)
    # Settings are not configuration fields: the field set is SGLang's own.
    assert "enable_foundry" not in type(sa).__struct_fields__


def test_flags_survive_the_trip_to_scheduler_processes(parse, foundry_toml):
    """SGLang pickles ServerArgs into its scheduler subprocesses; the settings ride along."""
    sa = parse("--cuda-graph-backend-prefill", "disabled")
    copy = pickle.loads(pickle.dumps(sa))
    assert (copy.enable_foundry, copy.foundry_config) == (True, str(foundry_toml))


def test_help_lists_the_flags(plugins_loaded):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "--enable-foundry" in text and "--foundry-config" in text


def test_flag_off_leaves_server_args_identical(fresh_python, model_dir):
    argv = ["--model-path", str(model_dir), *BASE_ARGV]
    without = fresh_python(_SNAPSHOT.format(argv=argv), env={"SGLANG_PLUGINS": "no-such-plugin"})
    with_plugin = fresh_python(_SNAPSHOT.format(argv=argv))
    assert not without["plugins"] and with_plugin["plugins"]
    assert with_plugin["fields"] == without["fields"]
    assert with_plugin["extra"] == without["extra"]


def test_flag_off_launch_check_is_a_no_op(parse):
    import msgspec

    sa = parse(*BASE_ARGV, foundry=False)
    before = (msgspec.structs.asdict(sa), dict(sa.__dict__))
    sa.resolve_once()
    sa.check_server_args()
    assert "foundry_mode" not in sa.__dict__ and "enable_foundry" not in sa.__dict__
    assert not any(k.startswith("FOUNDRY") for k in os.environ)
    assert msgspec.structs.asdict(sa) == before[0]


def test_launch_check_settles_auto_and_exports_settings(parse, foundry_toml):
    sa = parse(*BASE_ARGV)
    sa.resolve_once()
    sa.check_server_args()
    assert sa.foundry_mode == "save"  # auto without an archive
    assert os.environ["FOUNDRY_SGLANG"] == "1"
    assert os.environ["FOUNDRY_MODE"] == "save"
    assert os.environ["FOUNDRY_CONFIG"] == str(foundry_toml.resolve())


@contextlib.contextmanager
def _rank0_archive(sa, foundry_toml):
    """Rank 0's finished archive for ``sa``'s configuration in the shared archive_dir, for the block."""
    from foundry_core.config import load_config
    from foundry_sglang_plugin import archive

    cfg = load_config(foundry_toml)
    archive.write_sidecar(cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": {}, "outputs": {}})
    try:
        yield
    finally:
        archive.drop_sidecar(cfg, 0)


def test_launch_check_loads_when_every_rank_has_a_matching_archive(parse, foundry_toml):
    sa = parse(*BASE_ARGV)
    sa.resolve_once()
    with _rank0_archive(sa, foundry_toml):
        sa.check_server_args()
        assert sa.foundry_mode == "load"


def test_config_without_enable_is_refused(parse, foundry_toml):
    from foundry_core.config import ConfigError

    sa = parse(*BASE_ARGV, "--foundry-config", str(foundry_toml), foundry=False)
    sa.resolve_once()
    with pytest.raises(ConfigError, match="--enable-foundry"):
        sa.check_server_args()


def test_enable_without_config_is_refused(parse):
    from foundry_core.config import ConfigError

    sa = parse(*BASE_ARGV, "--enable-foundry", foundry=False)
    sa.resolve_once()
    with pytest.raises(ConfigError, match="--foundry-config"):
        sa.check_server_args()


def test_invalid_config_file_is_refused_in_one_line(parse, tmp_path):
    from foundry_core.config import ConfigError

    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "sometimes"\narchive_dir = "x"\n')
    sa = parse(*BASE_ARGV, "--enable-foundry", "--foundry-config", str(bad), foundry=False)
    sa.resolve_once()
    with pytest.raises(ConfigError) as err:
        sa.check_server_args()
    assert "mode must be one of" in str(err.value) and "\n" not in str(err.value)


def test_engine_kwargs_reach_server_args_and_refuse_before_any_subprocess(
    fresh_python, model_dir, foundry_toml
):
    """sglang.Engine(enable_foundry=..., foundry_config=...) is refused at SGLang's launch check."""
    out = fresh_python(
        f"""
        import json, multiprocessing
        import sglang.srt.entrypoints.engine
        from sglang.srt.plugins import load_plugins
        load_plugins()  # kwargs need the Engine hook in place before the first Engine is built
        import sglang
        from foundry_sglang_plugin import FoundryUnsupportedError
        try:
            sglang.Engine(model_path={str(model_dir)!r}, device="cuda", pp_size=2,
                          cuda_graph_backend_prefill="disabled",
                          enable_foundry=True, foundry_config={str(foundry_toml)!r})
            error = None
        except FoundryUnsupportedError as e:
            error = str(e)
        print(json.dumps({{"error": error, "children": len(multiprocessing.active_children())}}))
        """
    )
    assert out["error"] is not None and "pipeline parallelism (pp_size=2)" in out["error"]
    assert "\n" not in out["error"]
    assert out["children"] == 0


def test_engine_server_args_route(fresh_python, model_dir, foundry_toml):
    """enable() on a Python-built ServerArgs; sglang.Engine loads the plugins itself and refuses."""
    out = fresh_python(
        f"""
        import json, multiprocessing
        import sglang
        from sglang.srt.server_args import ServerArgs
        import foundry_sglang_plugin
        sa = ServerArgs(model_path={str(model_dir)!r}, device="cuda", enable_lora=True, lora_paths=["a={str(model_dir)}"],
                        cuda_graph_backend_prefill="disabled")
        foundry_sglang_plugin.enable(sa, {str(foundry_toml)!r})
        try:
            sglang.Engine(server_args=sa)
            error = None
        except foundry_sglang_plugin.FoundryUnsupportedError as e:
            error = str(e)
        print(json.dumps({{"error": error, "children": len(multiprocessing.active_children())}}))
        """
    )
    assert out["error"] is not None and "LoRA is not supported" in out["error"]
    assert out["children"] == 0


def test_a_previous_launch_in_the_process_does_not_leak(parse, monkeypatch):
    # What an earlier Foundry launch in this process exported (mode=load).
    monkeypatch.setenv("FOUNDRY_SGLANG", "1")
    monkeypatch.setenv("FOUNDRY_MODE", "load")
    sa = parse(*BASE_ARGV)
    sa.resolve_once()
    sa.check_server_args()
    assert sa.foundry_mode == "save"  # decided afresh: auto without an archive
    off = parse(*BASE_ARGV, foundry=False)
    off.resolve_once()
    off.check_server_args()
    assert not any(k.startswith("FOUNDRY") for k in os.environ)


def test_forced_load_without_an_archive_is_refused_at_launch(parse, tmp_path):
    from foundry_sglang_plugin.session import FoundrySessionError

    toml = tmp_path / "load.toml"
    toml.write_text(f'mode = "load"\narchive_dir = "{tmp_path / "none"}"\n')
    sa = parse(*BASE_ARGV, "--enable-foundry", "--foundry-config", str(toml), foundry=False)
    sa.resolve_once()
    with pytest.raises(FoundrySessionError, match="mode=load but .* holds no complete archive"):
        sa.check_server_args()
    assert "FOUNDRY_SGLANG" not in os.environ


@pytest.mark.parametrize("mode", ["save", "auto"])
def test_an_archive_dir_that_cannot_be_written(parse, tmp_path, logged, mode):
    # A path below a regular file can never be created, also for root (a read-only mount acts alike).
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    toml = tmp_path / f"{mode}.toml"
    toml.write_text(f'mode = "{mode}"\narchive_dir = "{blocker / "archive"}"\n')
    sa = parse(*BASE_ARGV, "--enable-foundry", "--foundry-config", str(toml), foundry=False)
    sa.resolve_once()
    if mode == "save":  # refused at launch, in one line, before any scheduler starts
        with pytest.raises(SystemExit) as err:
            sa.check_server_args()
        assert str(err.value.code).startswith(
            "error: Foundry: archive_dir "
        ) and "mode = save cannot go on" in str(err.value.code)
    else:  # auto serves as stock SGLang would, with a warning saying why
        sa.check_server_args()
        warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
        assert any("is not writable" in m and "serves without Foundry" in m for m in warnings), warnings
    assert "FOUNDRY_SGLANG" not in os.environ  # no scheduler gets the worker hooks


def test_launch_check_settles_each_data_parallel_replica(parse, foundry_toml):
    """--dp-size 2 with replica 0's archive complete and replica 1's missing: the launcher settles
    ``load,save``, and each scheduler gets its replica's mode, through the record or the environment
    (foundry_core's FOUNDRY_MODE keeps the configured mode)."""
    from foundry_sglang_plugin import settings
    from foundry_sglang_plugin.session import settle

    sa = parse(*BASE_ARGV, "--dp-size", "2")
    sa.resolve_once()
    try:
        with _rank0_archive(sa, foundry_toml):
            sa.check_server_args()
            assert sa.foundry_mode == "load,save"
            assert (
                os.environ["FOUNDRY_MODE"] == "auto" and os.environ[settings.REPLICA_MODES_ENV] == "load,save"
            )
            assert [settle(sa, replica=r)[1] for r in (0, 1)] == ["load", "save"]
            assert settle(sa)[1] == "load,save", "the launcher keeps every replica's"
            sa.__dict__.pop(settings.MODE_ATTR)  # a record that lost the launcher's mode: the environment's
            assert [settle(sa, replica=r)[1] for r in (0, 1)] == ["load", "save"]
    finally:
        settings.clear_env()
    assert settings.REPLICA_MODES_ENV not in os.environ
