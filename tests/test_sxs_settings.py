"""stock_best and foundry of the side-by-side harness (benchmarks/sxs_modes.py) differ only in what
ALLOWED_DIFF lists, and stock_best applies every launch setting Foundry applies that a stock user can."""

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sxs_modes as modes  # noqa: E402  (benchmarks/ is no package)


def _where(tmp_path: Path, mode: str = "foundry") -> "modes.Where":
    return modes.Where(
        model_dir=tmp_path / "model",
        home=tmp_path / "h",
        tmp=tmp_path / "t",
        port=1234,
        shim=tmp_path / "shim",
        toml=tmp_path / f"{mode}.toml",
        peer_site=tmp_path / "site-peer",
    )


PARENT = {
    "PATH": "/usr/bin",
    "PYTHONPATH": "/tmp/site-x",
    "TRITON_CACHE_DIR": "/elsewhere",
    "VLLM_PLUGINS": "a",
}


@pytest.mark.parametrize("engine", modes.ENGINES)
@pytest.mark.parametrize("dummy", [False, True])
def test_stock_best_differs_from_foundry_only_where_allowed(tmp_path, engine, dummy):
    best = modes.launch(engine, "stock_best", _where(tmp_path), dummy, PARENT, ROOT / "src")
    foundry = modes.launch(engine, "foundry", _where(tmp_path), dummy, PARENT, ROOT / "src")
    diff = modes.settings_diff(best, foundry)
    assert modes.disallowed(diff) == {"args": [], "env": []}, diff
    assert "--enable-foundry" in diff["args"]  # the comparison sees the plugin at all
    # an inherited cache location never reaches a start: every engine falls back to HOME/TMPDIR
    assert "TRITON_CACHE_DIR" not in best.env and best.env["HOME"] == str(tmp_path / "h")


def test_other_plugins_stay_allowed_in_every_mode(tmp_path):
    others = ("smg-servicer", "smg-zmq")
    for mode in ("stock_naive", "stock_best", "foundry", "peer"):
        env = modes.launch("sglang", mode, _where(tmp_path), False, PARENT, ROOT / "src", others).env
        allowed = env["SGLANG_PLUGINS"].split(",")
        assert allowed[:2] == list(others)
        assert (modes.PLUGIN_NAME in allowed) == (mode == "foundry")  # ours, by its own name
        assert (modes.PEER_PLUGIN_NAME in allowed) == (mode == "peer")  # upstream's


def test_a_difference_outside_the_list_is_caught(tmp_path):
    best = modes.launch("vllm", "stock_best", _where(tmp_path), False, PARENT, ROOT / "src")
    foundry = modes.launch("vllm", "foundry", _where(tmp_path), False, PARENT, ROOT / "src")
    foundry.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    foundry.argv += ["--max-num-seqs", "8"]
    assert modes.disallowed(modes.settings_diff(best, foundry)) == {
        "args": ["--max-num-seqs"],
        "env": ["VLLM_ENABLE_V1_MULTIPROCESSING"],
    }


def test_vllm_graph_and_compile_settings_are_the_plugins(tmp_path):
    """All modes but stock_default request the graphs Foundry's plugin requests; stock_best and foundry
    compile with the Inductor entries the plugin pins (read from the plugin's code)."""
    sys.path.insert(0, str(ROOT / "src"))
    from foundry_core.engine import inductor
    from foundry_vllm_plugin import support

    def config(mode):
        argv = modes.launch("vllm", mode, _where(tmp_path), False, PARENT, ROOT / "src").argv
        return (
            json.loads(argv[argv.index("--compilation-config") + 1])
            if "--compilation-config" in argv
            else None
        )

    pinned = {"inductor_compile_config": {k: v for k, (v, _env, _why) in inductor.PINNED.items()}}
    assert config("stock_naive") == {"cudagraph_mode": support.FOUNDRY_CUDAGRAPH_MODE}
    assert (
        config("stock_best")
        == config("foundry")
        == {"cudagraph_mode": support.FOUNDRY_CUDAGRAPH_MODE, **pinned}
    )
    assert config("stock_default") is None


def test_stock_best_applies_every_launch_setting_of_foundry(monkeypatch):
    """What the plugins set at a Foundry start (read from their code) is in STOCK_BEST_ENV."""
    sys.path.insert(0, str(ROOT / "src"))
    from foundry_core.engine import inductor
    from foundry_vllm_plugin import session

    for name in ("VLLM_USE_STANDALONE_COMPILE", "VLLM_USE_AOT_COMPILE", "VLLM_DISABLE_COMPILE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    expected = {"vllm": {k: v for k, (v, _why) in session.launch_settings().items()}, "sglang": {}}
    for engine in modes.ENGINES:
        for _key, (value, env, _why) in inductor.PINNED.items():
            expected[engine][env] = "1" if value else "0"
        assert modes.STOCK_BEST_ENV[engine] == expected[engine], engine


def test_peer_and_stock_default(tmp_path):
    peer = modes.launch("sglang", "peer", _where(tmp_path, "peer"), False, PARENT, ROOT / "src")
    assert peer.env[modes.PEER_CONFIG_ENV] == str(tmp_path / "peer.toml")
    assert peer.env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site-peer")
    assert "--enable-foundry" not in peer.argv and "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK" not in peer.env
    default = modes.launch("sglang", "stock_default", _where(tmp_path), False, PARENT, ROOT / "src")
    naive = modes.launch("sglang", "stock_naive", _where(tmp_path), False, PARENT, ROOT / "src")
    assert modes.settings_diff(default, naive) == {"args": ["--cuda-graph-backend-prefill"], "env": []}
    with pytest.raises(ValueError, match="peer exists for sglang only"):
        modes.launch("vllm", "peer", _where(tmp_path), False, PARENT, ROOT / "src")


@pytest.mark.parametrize("phase", ["save", "load"])
def test_the_foundry_toml_of_the_harness_is_what_the_plugins_read(tmp_path, phase):
    sys.path.insert(0, str(ROOT / "src"))
    from foundry_core.config import load_config

    path = modes.foundry_toml(tmp_path / "foundry.toml", phase, tmp_path / "archive", "96GiB")
    cfg = load_config(path)
    assert (cfg.mode, cfg.region_size, Path(cfg.archive_dir)) == (phase, 96 << 30, tmp_path / "archive")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_entry_point_shims_declare_what_the_plugin_package_declares(engine, tmp_path):
    # The harness's shim (and engine_run's) must name the plugin as its package does, or the
    # engine's allow-list would keep Foundry out of its own starts (or let it into stock's).
    import engine_run
    import tomllib

    declared = tomllib.loads((ROOT / "packages" / engine / "pyproject.toml").read_text())
    eps = declared["project"]["entry-points"][modes.PLUGIN_GROUPS[engine]]
    assert eps == {modes.PLUGIN_NAME: modes.PLUGIN_TARGETS[engine]}
    assert (engine_run.PLUGIN_NAME, engine_run.PLUGIN_TARGETS[engine]) == next(iter(eps.items()))
    shim = modes.write_shim(tmp_path, engine)
    text = next(shim.glob("*.dist-info")).joinpath("entry_points.txt").read_text()
    assert f"{modes.PLUGIN_NAME} = {modes.PLUGIN_TARGETS[engine]}" in text
