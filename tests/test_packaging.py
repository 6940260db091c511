"""The three distributions: what each declares, and what the plugins' entry points do when things go wrong.

Building and installing each plugin alone in a fresh venv is CI's step (.ci/packaging.sh); here the
declarations are read from the sources, and the entry points run in fresh interpreters against the
real ``importlib.metadata`` with stand-in distributions on the path (upstream Foundry's layout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foundry_core import plugin_entry
from foundry_core.engine import release

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ENGINES = ("sglang", "vllm")


def pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_the_core_registers_no_engine_plugin_and_ships_no_plugin_module():
    core = pyproject(REPO / "pyproject.toml")
    assert core["project"]["name"] == "foundry-graphs"
    groups = set(core["project"].get("entry-points", {}))
    assert not groups & {p.group for p in plugin_entry.PLUGINS.values()}
    assert core["tool"]["setuptools"]["packages"]["find"]["include"] == ["foundry_core*", "foundry_tools*"]
    from foundry_tools.commands import ENTRY_POINTS

    commands = core["project"]["entry-points"]["foundry_graphs.commands"]
    assert commands == {name: f"foundry_tools.commands:{fn}" for name, fn in ENTRY_POINTS.items()}


@pytest.mark.parametrize("engine", ENGINES)
def test_each_plugin_package_declares_the_tested_range_and_its_entry_point(engine):
    core = pyproject(REPO / "pyproject.toml")["project"]
    meta = pyproject(REPO / "packages" / engine / "pyproject.toml")
    project = meta["project"]
    assert project["name"] == plugin_entry.PLUGINS[engine].distribution == f"foundry-graphs-{engine}"
    assert project["version"] == core["version"]
    deps = project["dependencies"]
    assert f"foundry-graphs=={core['version']}" in deps
    assert f"{engine}{release.TESTED[engine]}" in deps  # pip refuses what the gate refuses
    (other,) = set(ENGINES) - {engine}
    assert not any(d.startswith(other) for d in deps)
    group = plugin_entry.PLUGINS[engine].group
    assert project["entry-points"] == {group: {"foundry_graphs": f"foundry_core.plugin_entry:{engine}"}}
    assert callable(getattr(plugin_entry, engine))
    assert meta["tool"]["setuptools"]["packages"] == [plugin_entry.PLUGINS[engine].module]
    assert meta["tool"]["setuptools"]["package-dir"] == {"": "../../src"}


def test_the_core_version_is_one_version():
    import foundry_core

    assert foundry_core.__version__ == pyproject(REPO / "pyproject.toml")["project"]["version"]


# -- entry points in fresh interpreters -------------------------------------------------------------

UPSTREAM = "foundry-core"


def upstream_standin(site: Path) -> Path:
    """Upstream Foundry's installed layout (foundry-core 0.1.0rc3, facts from its wheel): a top-level
    module ``foundry_sglang_plugin`` and an ``sglang.srt.plugins`` entry point ``foundry`` into it. The
    module's ``load`` marks that it ran (it must not, when ours is the one that reports)."""
    info = site / "foundry_core-0.1.0rc3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {UPSTREAM}\nVersion: 0.1.0rc3\n")
    (info / "top_level.txt").write_text("foundry\nfoundry_sglang_plugin\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nfoundry = foundry_sglang_plugin:load\n")
    (info / "RECORD").write_text("foundry_sglang_plugin.py,,\nfoundry_core-0.1.0rc3.dist-info/METADATA,,\n")
    (site / "foundry_sglang_plugin.py").write_text("RAN = []\n\ndef load():\n    RAN.append(1)\n")
    return site


def run(code: str, path: list[Path]) -> dict:
    """``code`` in a fresh interpreter with ``path`` first on sys.path; its log lines (WARNING and
    up) and the JSON object it prints last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(SRC), env.get("PYTHONPATH", "")])
    prelude = (
        "import logging, sys, json\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format='%(levelname)s %(message)s')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["log"] = [line for line in proc.stderr.splitlines() if line.strip()]
    return out


def test_beside_upstream_foundry_our_sglang_entry_point_refuses_in_one_line(tmp_path):
    """Upstream's module first on the path (the one ``import foundry_sglang_plugin`` finds): our entry
    point names both distributions in one line and imports neither plugin module."""
    site = upstream_standin(tmp_path / "site")
    out = run(
        """
        from foundry_core import plugin_entry
        plugin_entry.sglang()
        plugin_entry.sglang()  # a second plugin load in the process says nothing new
        plugins = [m for m in sys.modules if m.startswith(("foundry_sglang_plugin", "foundry_vllm_plugin"))]
        print(json.dumps({"imported": sorted(plugins)}))
        """,
        [site],
    )
    (line,) = out["log"]
    assert line.startswith(
        "ERROR Foundry: foundry-core 0.1.0rc3 also installs the module foundry_sglang_plugin"
    )
    assert "foundry-graphs-sglang" in line and "pip uninstall foundry-core" in line
    assert out["imported"] == []


def test_beside_upstream_foundry_its_entry_point_reaching_our_module_says_the_same(tmp_path):
    """Our package first on the path: upstream's ``foundry_sglang_plugin:load`` finds our module; the
    engine's loader (here its core, ``EntryPoint.load``) gets one line instead of an AttributeError,
    and our own entry point does not repeat it."""
    site = upstream_standin(tmp_path / "site")
    out = run(
        """
        from importlib.metadata import entry_points
        eps = entry_points(group="sglang.srt.plugins")
        (upstream,) = [ep for ep in eps if ep.dist.name == "foundry-core"]
        upstream.load()()
        from foundry_core import plugin_entry
        plugin_entry.sglang()
        import foundry_sglang_plugin
        hooked = "foundry_sglang_plugin.hooks" in sys.modules
        print(json.dumps({"ours": foundry_sglang_plugin.__file__, "hooks": hooked}))
        """,
        [SRC, site],
    )
    (line,) = out["log"]
    assert "foundry-core 0.1.0rc3 also installs the module foundry_sglang_plugin" in line
    assert out["ours"].startswith(str(SRC)) and not out["hooks"]  # nothing registered


def test_without_upstream_nobody_else_owns_the_plugin_modules():
    for engine in ENGINES:
        assert plugin_entry.foreign_owner(engine) is None


def test_a_vllm_register_that_fails_logs_one_line_and_returns(tmp_path):
    """vLLM's plugin loader does not catch exceptions: an ``arg_utils`` the plugin cannot wrap (here
    a stand-in without ``EngineArgs.add_cli_args``) is one logged line, and no SGLang plugin import."""
    stub = tmp_path / "stub"
    (stub / "vllm" / "engine").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text("")
    (stub / "vllm" / "engine" / "__init__.py").write_text("")
    (stub / "vllm" / "engine" / "arg_utils.py").write_text("class EngineArgs:\n    pass\n")
    out = run(
        """
        import vllm.engine.arg_utils
        from foundry_core import plugin_entry
        plugin_entry.vllm()
        print(json.dumps({"sglang_plugin": "foundry_sglang_plugin" in sys.modules}))
        """,
        [stub],
    )
    (line,) = out["log"]
    # engine_args.install() declines an EngineArgs of another layout itself, in one line
    assert line.startswith("WARNING Foundry: not installed in this vLLM (TypeError: EngineArgs.add_cli_args")
    assert line.endswith("--enable-foundry is not available")
    assert out["sglang_plugin"] is False


def test_an_sglang_plugin_without_sglang_logs_one_line_and_returns(tmp_path):
    out = run(
        """
        import importlib.util
        if importlib.util.find_spec("sglang") is not None:
            sys.modules["sglang"] = None  # as where SGLang is missing: its import fails
        from foundry_core import plugin_entry
        plugin_entry.sglang()
        print(json.dumps({"vllm_plugin": "foundry_vllm_plugin" in sys.modules}))
        """,
        [],
    )
    (line,) = out["log"]
    assert line.startswith("ERROR Foundry: the SGLang plugin was not registered (")
    assert out["vllm_plugin"] is False
