"""register(): loaded by vLLM's own plugin loader, cheap, idempotent."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.vllm


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("foundry_graphs") == "foundry_core.plugin_entry:vllm"  # foundry-graphs-vllm's


def test_vllm_plugin_loader_runs_register_in_a_fresh_process():
    # vLLM's real loader, as run in every engine-core and worker process; arg_utils not yet imported.
    got = _run(
        """
        import json, sys
        import vllm.plugins
        vllm.plugins.load_general_plugins()
        import foundry_vllm_plugin
        before = "vllm.engine.arg_utils" in sys.modules
        import vllm.engine.arg_utils as au
        from foundry_vllm_plugin import engine_args
        print(json.dumps({"registered": foundry_vllm_plugin.is_registered(), "arg_utils_before": before,
                          "hooked": engine_args.installed(au)}))
        """
    )
    assert got == {"registered": True, "arg_utils_before": False, "hooked": True}


def test_engine_args_construction_loads_the_plugin_in_a_fresh_process(tmp_path):
    # The path that `vllm.LLM(...)` takes: EngineArgs.__post_init__ calls load_general_plugins().
    got = _run(
        f"""
        import json
        from vllm.engine.arg_utils import EngineArgs
        from foundry_vllm_plugin import engine_args
        import foundry_vllm_plugin
        hooked_before = engine_args.installed(__import__("vllm.engine.arg_utils").engine.arg_utils)
        EngineArgs(model={str(tmp_path)!r})
        import vllm.engine.arg_utils as au
        print(json.dumps({{"before": hooked_before, "registered": foundry_vllm_plugin.is_registered(),
                          "hooked": engine_args.installed(au)}}))
        """
    )
    assert got == {"before": False, "registered": True, "hooked": True}


def test_register_is_cheap_in_a_fresh_process():
    got = _run(
        """
        import json, sys, time
        t0 = time.perf_counter()
        import foundry_vllm_plugin
        foundry_vllm_plugin.register()
        foundry_vllm_plugin.register()
        dt = time.perf_counter() - t0
        heavy = sorted(m for m in ("torch", "vllm", "foundry_core.api", "foundry_core.region") if m in sys.modules)
        print(json.dumps({"seconds": dt, "heavy": heavy}))
        """
    )
    assert got["heavy"] == []
    assert got["seconds"] < 0.5, got


def test_register_is_idempotent():
    import vllm.engine.arg_utils as au
    from vllm.plugins import load_general_plugins

    import foundry_vllm_plugin
    from foundry_vllm_plugin import engine_args

    load_general_plugins()
    for _ in range(3):
        foundry_vllm_plugin.register()
    assert engine_args.installed(au)
    assert engine_args.install(au) is False  # a second install is refused, not stacked
    for name in ("create_engine_config", "add_cli_args", "from_cli_args"):
        fn = getattr(au.EngineArgs, name)
        fn = getattr(fn, "__func__", fn)
        inner = getattr(fn, "__wrapped__", None)
        assert inner is not None, name
        assert not getattr(inner, engine_args._MARK, False), f"{name} is wrapped twice"
    finders = [f for f in sys.meta_path if type(f).__name__ == "_ArgUtilsFinder"]
    assert finders == []


def test_an_engine_args_of_another_layout_is_left_alone_without_raising(caplog):
    """vLLM's plugin loader does not catch: a release whose EngineArgs no longer has the methods in
    the form the wrappers expect gets a warning and no Foundry flags, never an exception, and not a
    partial install (flags without the config step would be silently ignored)."""
    import logging
    import types

    from vllm.engine.arg_utils import EngineArgs

    from foundry_vllm_plugin import engine_args

    class Reshaped(EngineArgs):
        # from_cli_args as a staticmethod, add_cli_args and create_engine_config only inherited
        from_cli_args = staticmethod(lambda args: None)

    module = types.SimpleNamespace(EngineArgs=Reshaped)
    before = dict(Reshaped.__dict__)
    with caplog.at_level(logging.WARNING, logger="vllm.foundry"):
        assert engine_args.install(module) is False
    assert dict(Reshaped.__dict__) == before
    assert not engine_args.installed(module)
    assert "Foundry: not installed in this vLLM (TypeError" in caplog.text
    assert engine_args.install(types.SimpleNamespace()) is False  # no EngineArgs at all
