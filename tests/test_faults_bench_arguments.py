"""benchmarks/engine_faults.py without an engine or a GPU: its arguments, the servers' command lines, TOML
and environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_faults  # noqa: E402  (benchmarks/ is no package)
import engine_run as cs  # noqa: E402
import faults_catalog  # noqa: E402
import faults_server  # noqa: E402

TINY = json.loads((ROOT / "examples" / "qwen3-tiny" / "config.json").read_text())


# --- arguments and command lines ---------------------------------------------------------------------


def _args(*extra: str) -> list[str]:
    return ["--engine", "sglang", "--out", "/tmp/x.json", "--logs", "/tmp/l", *extra]


def test_parse_args_defaults_and_fixed_order():
    opts = engine_faults.parse_args(_args())
    assert opts.cases == list(faults_catalog.DEFAULT_CASES) and "sustained_load" not in opts.cases
    assert opts.kill_points == ["persisting"] and opts.max_bs == 64 and opts.weights == "dummy"
    assert opts.model_config == str(ROOT / "examples" / "qwen3-tiny" / "config.json")
    opts = engine_faults.parse_args(
        _args(
            "--cases",
            "damaged_cache,kill_during_save",
            "--kill-points",
            "complete,capture",
            "--model",
            "1.7b",
        )
    )
    assert opts.cases == ["kill_during_save", "damaged_cache"]  # the method's order, not the caller's
    assert opts.kill_points == ["capture", "complete"] and opts.model_config is None


@pytest.mark.parametrize(
    "extra",
    [
        ("--cases", "kill_during_save,nope"),
        ("--cases", "disk_full,disk_full"),
        ("--cases", ","),
        ("--kill-points", "halfway"),
        ("--model", "/no/such/config.json"),
        ("--parallel", "0"),
    ],
)
def test_parse_args_refuses(extra):
    with pytest.raises(SystemExit):
        engine_faults.parse_args(_args(*extra))


def test_server_argv_pins_batch_and_kv_before_the_foundry_flags(tmp_path):
    toml = tmp_path / "f.toml"
    argv = faults_server.server_argv(
        "sglang", tmp_path, 1234, toml, dummy=False, max_bs=64, kv_tokens=1000, kv_bytes=5
    )
    at = argv.index("--enable-foundry")
    assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "64"
    assert argv.count("--cuda-graph-max-bs-decode") == 1
    assert argv[argv.index("--max-total-tokens") + 1] == "1000" and argv.index("--max-total-tokens") < at
    assert "--kv-cache-memory-bytes" not in argv and argv[-1] == str(toml)
    argv = faults_server.server_argv(
        "vllm", tmp_path, 1234, toml, dummy=True, max_bs=8, kv_tokens=1000, kv_bytes=5
    )
    assert argv[argv.index("--max-num-seqs") + 1] == "8" and argv.count("--max-num-seqs") == 1
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "5" and "--max-total-tokens" not in argv
    stock = faults_server.server_argv(
        "vllm", tmp_path, 1, toml, dummy=True, max_bs=0, kv_tokens=None, kv_bytes=None
    )
    assert stock == cs.server_command("vllm", tmp_path, 1, toml, dummy=True)


def test_kv_sizes():
    # 4 layers x 8 KV heads x 128 x (K, V) x bf16 = 16 KiB a token.
    assert faults_server.kv_sizes(TINY, 4.0) == (262144, 4 << 30)
    # Qwen3-1.7B: 112 KiB a token; at least two 40960-token requests.
    tokens, nbytes = faults_server.kv_sizes(cs.MODEL_CONFIG, 4.0)
    assert tokens == 2 * 40960 and nbytes == 4 << 30
    assert faults_server.kv_sizes(TINY, 0) == (None, None)


def test_write_toml_sets_the_mode(tmp_path):
    path = tmp_path / "a" / "foundry.toml"
    faults_server.write_toml(path, tmp_path / "arch", "load", "8GiB")
    text = path.read_text()
    assert 'mode = "load"' in text and f'archive_dir = "{tmp_path / "arch"}"' in text and "8GiB" in text


def test_stock_env_is_what_the_plugins_pin():
    from foundry_core.engine.inductor import PINNED

    assert faults_server.STOCK_ENV == {env: "1" if value else "0" for value, env, _why in PINNED.values()}
