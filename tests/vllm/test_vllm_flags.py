"""--enable-foundry / --foundry-config through vLLM's real parsers, into the real engine config."""

from __future__ import annotations

import os

import pytest
from foundry_vllm_testutil import write_toml

from foundry_core.config import ConfigError, load_config
from foundry_vllm_plugin.support import FOUNDRY_WORKER, VLLM_GPU_WORKER, FoundryUnsupportedError

pytestmark = pytest.mark.vllm


def _parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def _common(qwen3_dir):
    return [
        "--model",
        str(qwen3_dir),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--max-model-len",
        "1024",
    ]


def test_flags_are_on_the_engine_parser():
    text = _parser().format_help()
    assert "--enable-foundry" in text and "--foundry-config" in text


def test_flags_are_on_the_vllm_serve_parser(qwen3_dir, foundry_toml):
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args([*_common(qwen3_dir), "--enable-foundry", "--foundry-config", str(foundry_toml)])
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config["foundry"] == {"config": str(foundry_toml.resolve())}


def test_flags_reach_the_engine_config(qwen3_dir, foundry_toml):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _parser().parse_args(
        [*_common(qwen3_dir), "--enable-foundry", "--foundry-config", str(foundry_toml)]
    )
    assert args.enable_foundry is True
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()
    assert vllm_config.additional_config == {"foundry": {"config": str(foundry_toml.resolve())}}
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER


def test_flag_off_changes_nothing(qwen3_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _parser().parse_args(_common(qwen3_dir))
    assert args.enable_foundry is False and args.foundry_config is None
    with_plugin = AsyncEngineArgs.from_cli_args(args)
    plain = AsyncEngineArgs.from_cli_args.__func__.__wrapped__(AsyncEngineArgs, args)  # vLLM's own
    assert with_plugin == plain
    assert "foundry" not in (with_plugin.additional_config or {})
    got = with_plugin.create_engine_config()
    want = AsyncEngineArgs.create_engine_config.__wrapped__(plain)
    assert got.compute_hash() == want.compute_hash()
    assert got.parallel_config.worker_cls == want.parallel_config.worker_cls == VLLM_GPU_WORKER
    assert got.compilation_config.cudagraph_mode == want.compilation_config.cudagraph_mode
    assert got.additional_config == want.additional_config == {}


def test_python_api_entry_reaches_the_engine_config(engine_args_factory, tmp_path, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    write_toml(tmp_path / "foundry.toml")
    monkeypatch.chdir(tmp_path)
    vllm_config = engine_args_factory(
        additional_config={"foundry": {"config": "foundry.toml"}}
    ).create_engine_config()
    # The relative path is pinned to an absolute one: the same string at SAVE and LOAD.
    assert vllm_config.additional_config["foundry"] == {"config": str((tmp_path / "foundry.toml").resolve())}
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER


def test_config_hash_is_the_same_for_save_and_load(engine_args_factory, tmp_path):
    # vLLM keys its torch.compile cache on compute_hash(); LOAD must hit the cache SAVE filled.
    toml = tmp_path / "foundry.toml"
    hashes = []
    for mode in ("save", "load"):
        write_toml(toml, mode=mode)
        args = engine_args_factory(additional_config={"foundry": {"config": str(toml)}})
        hashes.append(args.create_engine_config().compute_hash())
    assert hashes[0] == hashes[1]


def test_enable_without_config_reads_foundry_config_env(qwen3_dir, foundry_toml, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.setenv("FOUNDRY_CONFIG", str(foundry_toml))
    args = _parser().parse_args([*_common(qwen3_dir), "--enable-foundry"])
    assert AsyncEngineArgs.from_cli_args(args).additional_config["foundry"]["config"] == str(
        foundry_toml.resolve()
    )


def test_enable_without_any_config_is_refused(qwen3_dir, monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.delenv("FOUNDRY_CONFIG", raising=False)
    args = _parser().parse_args([*_common(qwen3_dir), "--enable-foundry"])
    with pytest.raises(ConfigError, match="--enable-foundry needs --foundry-config"):
        AsyncEngineArgs.from_cli_args(args)


def test_config_without_enable_is_refused(qwen3_dir, foundry_toml):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _parser().parse_args([*_common(qwen3_dir), "--foundry-config", str(foundry_toml)])
    with pytest.raises(ConfigError, match="without --enable-foundry"):
        AsyncEngineArgs.from_cli_args(args)


def test_invalid_toml_is_refused_with_one_line(qwen3_dir, tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    bad = write_toml(tmp_path / "bad.toml", extra="archve_digest = 1\n")
    args = _parser().parse_args([*_common(qwen3_dir), "--enable-foundry", "--foundry-config", str(bad)])
    with pytest.raises(ConfigError) as err:
        AsyncEngineArgs.from_cli_args(args)
    assert "unknown key 'archve_digest'" in str(err.value) and "\n" not in str(err.value)


def test_missing_toml_is_refused(qwen3_dir, tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _parser().parse_args(
        [*_common(qwen3_dir), "--enable-foundry", "--foundry-config", str(tmp_path / "nope.toml")]
    )
    with pytest.raises(ConfigError, match="does not exist"):
        AsyncEngineArgs.from_cli_args(args)


def test_user_chosen_piecewise_mode_is_refused_at_config_time(engine_args_factory, foundry_toml):
    args = engine_args_factory(
        additional_config={"foundry": {"config": str(foundry_toml)}},
        compilation_config={"cudagraph_mode": "PIECEWISE"},
    )
    with pytest.raises(FoundryUnsupportedError, match="cudagraph_mode=PIECEWISE"):
        args.create_engine_config()


def test_user_chosen_full_decode_only_is_kept(engine_args_factory, foundry_toml):
    from vllm.config.compilation import CUDAGraphMode

    args = engine_args_factory(
        additional_config={"foundry": {"config": str(foundry_toml)}},
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    vllm_config = args.create_engine_config()
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert list(vllm_config.compilation_config.cudagraph_capture_sizes) == [1, 2, 4, 8]


def test_inductor_settings_for_a_bit_exact_load_are_pinned(engine_args_factory, foundry_toml):
    """Foundry compiles with reduction-block rescaling off (foundry_core.engine.inductor), beside the
    user's own Inductor settings, and only with Foundry on."""
    args = engine_args_factory(
        additional_config={"foundry": {"config": str(foundry_toml)}},
        compilation_config={"inductor_compile_config": {"max_autotune": False}},
    )
    cc = args.create_engine_config().compilation_config
    assert cc.inductor_compile_config["dynamic_scale_rblock"] is False
    assert cc.inductor_compile_config["max_autotune"] is False
    plain = engine_args_factory().create_engine_config().compilation_config
    assert "dynamic_scale_rblock" not in plain.inductor_compile_config


def test_a_user_setting_against_the_pin_is_refused(engine_args_factory, foundry_toml):
    args = engine_args_factory(
        additional_config={"foundry": {"config": str(foundry_toml)}},
        compilation_config={"inductor_compile_config": {"dynamic_scale_rblock": True}},
    )
    with pytest.raises(FoundryUnsupportedError, match="inductor_compile_config dynamic_scale_rblock=True"):
        args.create_engine_config()


def test_malformed_additional_config_entry_is_refused(engine_args_factory):
    with pytest.raises(ConfigError, match="must be a table"):
        engine_args_factory(additional_config={"foundry": "yes"}).create_engine_config()


def test_example_recipe_serve_command_reaches_the_engine_config():
    # The flags of examples/vllm/README.md, with the example's own model dir and foundry.toml.
    from pathlib import Path

    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    example = Path(__file__).resolve().parents[2] / "examples" / "vllm"
    argv = ["--model", str(example.parent / "qwen3-tiny"), "--load-format", "dummy", "--skip-tokenizer-init"]
    argv += [
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.3",
        "-cc.cudagraph_capture_sizes=[1,2,4,8]",
    ]
    argv += ["--enable-foundry", "--foundry-config", str(example / "foundry.toml")]
    vllm_config = AsyncEngineArgs.from_cli_args(
        make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    ).create_engine_config()
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert list(vllm_config.compilation_config.cudagraph_capture_sizes) == [1, 2, 4, 8]
    assert vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER
    cfg = load_config(example / "foundry.toml")
    assert cfg.mode == "auto" and cfg.archive_dir == example / "archive" and cfg.region_size == 64 << 30
    # Weights, KV cache and graphs all live in the region: it must hold what --gpu-memory-utilization
    # 0.3 hands to vLLM on the largest GPU the example targets (H200, 141 GiB).
    assert cfg.region_size > 0.3 * (141 << 30)


def _cli_env_setup():
    """vLLM's CLI start-up, which assigns its process start method before plugins load."""
    try:
        from vllm.entrypoints.common.startup import cli_env_setup
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    cli_env_setup()


@pytest.fixture
def start_env(monkeypatch):
    from foundry_core.engine import launch_env, undo_launch_redirect

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_MEGA_AOT_ARTIFACT", "VLLM_USE_STANDALONE_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    started_with: dict[str, str] = {}
    monkeypatch.setattr(launch_env, "initial_environment", lambda: dict(started_with))
    yield started_with
    undo_launch_redirect()


def test_a_foundry_start_forks_the_engine_core_and_loads_the_compiled_artifact_whole(
    engine_args_factory, foundry_toml, start_env
):
    from vllm.utils.system_utils import get_mp_context

    from vllm import envs

    _cli_env_setup()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # vLLM's CLI default
    engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}}).create_engine_config()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert get_mp_context().get_start_method() == "fork"  # what vLLM starts its engine core with
    assert envs.VLLM_USE_MEGA_AOT_ARTIFACT is True


def test_the_users_start_method_and_compile_switches_are_kept(
    engine_args_factory, foundry_toml, start_env, monkeypatch
):
    start_env.update(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_USE_STANDALONE_COMPILE="0")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_USE_STANDALONE_COMPILE", "0")
    engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}}).create_engine_config()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # The one-artifact load needs vLLM's standalone compile, which the user turned off.
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" not in os.environ


def test_without_foundry_the_start_settings_stay_vllms(engine_args_factory, start_env):
    _cli_env_setup()
    engine_args_factory().create_engine_config()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" not in os.environ
