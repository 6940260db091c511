"""SGLang's own plugin loader finds Foundry, and register() is idempotent and cheap."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang

LAUNCHER_TARGETS = [
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.check_server_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
]


def test_sglang_loader_discovers_and_runs_register(fresh_python):
    out = fresh_python(
        """
        import json
        from importlib.metadata import entry_points
        from sglang.srt import plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        eps = [ep.value for ep in entry_points(group=plugins.GENERAL_PLUGINS_GROUP) if ep.name == "foundry_graphs"]
        plugins.load_plugins()
        import foundry_sglang_plugin, foundry_sglang_plugin.hooks as h
        from sglang.srt.server_args import ServerArgs
        print(json.dumps({
            "entry_points": eps,
            "registered": sorted({t for t, _kind in foundry_sglang_plugin._registered}),
            "patched": sorted(t for t in HookRegistry._patched if t.startswith("sglang.")),
            "parser_wrapped": getattr(ServerArgs.add_cli_args, "__wrapped__", None) is not None,
            "engine_hook": (h.ENGINE_HOOK[0], h.ENGINE_HOOK[2]) in foundry_sglang_plugin._registered,
        }))
        """
    )
    assert out["entry_points"] == ["foundry_core.plugin_entry:sglang"]  # foundry-graphs-sglang's
    assert out["registered"] == LAUNCHER_TARGETS
    assert set(LAUNCHER_TARGETS) <= set(out["patched"])
    assert out["parser_wrapped"]
    # Nothing had imported sglang.srt.entrypoints.engine, so no Engine hook and no engine import.
    assert not out["engine_hook"]


def test_no_worker_hooks_without_a_foundry_launch(fresh_python):
    """With Foundry off, a process loading plugins (e.g. a scheduler) gets no worker hook."""
    out = fresh_python(
        """
        import json
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from foundry_sglang_plugin import hooks
        print(json.dumps({"worker": [t for t, _, _ in hooks.WORKER_HOOKS if t in HookRegistry._hooks]}))
        """
    )
    assert out["worker"] == []


def test_worker_hooks_in_a_process_spawned_by_a_foundry_launch(fresh_python, foundry_toml):
    out = fresh_python(
        """
        import json
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        load_plugins()
        from foundry_sglang_plugin import hooks
        targets = [t for t, _, _ in hooks.WORKER_HOOKS]
        print(json.dumps({"targets": targets, "patched": [t for t in targets if t in HookRegistry._patched]}))
        """,
        env={"FOUNDRY_SGLANG": "1", "FOUNDRY_CONFIG": str(foundry_toml), "FOUNDRY_MODE": "save"},
    )
    # Every worker target exists in this SGLang release and was patched by SGLang's apply_hooks.
    assert out["patched"] == out["targets"]
    # The end of setup (SAVE) / the restore point (LOAD) and the warmup gate are among them: without
    # the capture hook a SAVE has no setup mark and fc.save refuses.
    assert {
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture",
        "sglang.srt.model_executor.runner.base_runner.BaseRunner.warmup",
    } <= set(out["targets"])


def test_register_is_idempotent(plugins_loaded):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    import foundry_sglang_plugin
    from foundry_sglang_plugin import hooks

    ours = {fn for _, fn, _ in (*hooks.LAUNCHER_HOOKS, hooks.ENGINE_HOOK, *hooks.WORKER_HOOKS)}

    def count() -> dict[tuple[str, object], int]:
        return {
            (target, fn): sum(1 for _, f, _ in entries if f is fn)
            for target, entries in HookRegistry._hooks.items()
            for _, fn, _ in entries
            if fn in ours
        }

    before = count()
    foundry_sglang_plugin.register()
    foundry_sglang_plugin.register()
    load_plugins()
    HookRegistry.apply_hooks()
    assert count() == before
    assert before and all(n == 1 for n in before.values())


def test_register_is_cheap(fresh_python):
    out = fresh_python(
        """
        import json, sys, time
        import sglang.srt.plugins  # what SGLang has imported when its loader calls register()
        import foundry_sglang_plugin
        before = set(sys.modules)
        t0 = time.perf_counter()
        foundry_sglang_plugin.register()
        seconds = time.perf_counter() - t0
        new = sorted(set(sys.modules) - before)
        torch = sys.modules.get("torch")
        print(json.dumps({
            "new": new,
            "seconds": seconds,
            "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
        }))
        """
    )
    assert all(m.startswith("foundry_sglang_plugin") for m in out["new"]), out["new"]
    assert "torch" not in out["new"] and "foundry_core" not in out["new"]
    assert not out["cuda_initialized"]
    assert out["seconds"] < 0.5
