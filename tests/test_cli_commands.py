"""The ``foundry`` command finds subcommands through the entry-point group ``foundry_graphs.commands``;
the core imports no tool. Stand-in distributions (a ``.dist-info`` on ``sys.path``) declare them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from foundry_core import cli
from foundry_tools import commands
from tool_commands import register_commands, register_tool_commands

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_the_parser_loads_no_tool_when_none_is_registered(monkeypatch, capsys):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    for name in [m for m in sys.modules if m.split(".")[0] == "foundry_tools"]:
        monkeypatch.delitem(sys.modules, name)
    parser = cli.build_parser()
    assert not [m for m in sys.modules if m.split(".")[0] == "foundry_tools"]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["demo"])
    assert exit_.value.code == 2 and "invalid choice: 'demo'" in capsys.readouterr().err


HELLO = """
def add(sub):
    p = sub.add_parser("hello", help="says hello")
    p.add_argument("--times", type=int, default=1)
    p.set_defaults(func=lambda args: print("hello " * args.times) or 7)
"""


def test_a_registered_subcommand_is_found_and_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "hello_cmd.py").write_text(HELLO)
    register_commands(monkeypatch, tmp_path, {"hello": "hello_cmd:add"}, "hello-tools")
    assert cli.main(["hello", "--times", "2"]) == 7
    assert capsys.readouterr().out.strip() == "hello hello"


def test_a_broken_entry_is_left_out_with_one_line_and_the_rest_works(tmp_path, monkeypatch, capsys):
    (tmp_path / "hello_cmd.py").write_text(HELLO)
    entries = {"broken": "no_such_module_here:add", "hello": "hello_cmd:add", "inspect": "hello_cmd:add"}
    register_commands(monkeypatch, tmp_path, entries, "mixed-tools")
    assert cli.main(["hello"]) == 7
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "foundry: subcommand 'broken' (no_such_module_here:add) not loaded"
    )
    # A registered name cannot take the core's own inspect over.
    assert cli.main(["inspect", str(tmp_path / "nothing")]) == cli.EXIT_REFUSED


def test_a_name_registered_twice_is_added_once(tmp_path, monkeypatch, capsys):
    (tmp_path / "hello_cmd.py").write_text(HELLO)
    register_commands(monkeypatch, tmp_path / "a", {"hello": "hello_cmd:add"}, "hello-old")
    register_commands(monkeypatch, tmp_path / "b", {"hello": "hello_cmd:add"}, "hello-new")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["hello"]) == 7  # argparse would refuse a second "hello" parser


def test_demo_comes_from_the_tools_and_says_in_one_line_that_there_is_no_gpu(tmp_path, monkeypatch, capsys):
    from foundry_tools import demo

    register_tool_commands(monkeypatch, tmp_path)
    monkeypatch.setattr(demo, "gpu_available", lambda: False)  # as on this machine; also on a GPU one
    args = cli.build_parser().parse_args(["demo", "--preset", "tiny"])
    assert args.func.__module__ == "foundry_tools.commands"
    assert cli.main(["demo", "--preset", "tiny"]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and out.startswith("foundry demo: no NVIDIA GPU is visible")


def test_every_tool_entry_adds_its_subcommand():
    """What the packaging metadata declares (pyproject.toml, where it declares the group) is what
    foundry_tools.commands defines, and each entry adds the subcommand of its name."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    group = declared.get(cli.COMMANDS_GROUP)
    if group is not None:
        assert group == {
            name: f"foundry_tools.commands:{func}" for name, func in commands.ENTRY_POINTS.items()
        }
    assert set(commands.ENTRY_POINTS) == {"demo", "bench", "soak", "tp"}
    for name, func in commands.ENTRY_POINTS.items():
        parser = argparse.ArgumentParser()
        getattr(commands, func)(parser.add_subparsers(dest="command"))
        args = parser.parse_args([name])
        assert args.command == name and args.func.__name__ == f"cmd_{name}"


def test_the_tools_run_from_an_uninstalled_checkout():
    """``python -m foundry_tools`` (PYTHONPATH=src, no entry point registered: how the GPU machine runs
    the tree) is the ``foundry`` parser with the four tools added; its demo says in one line that
    there is no GPU, as ``foundry demo`` does. The device scripts call it, not ``foundry_core.cli``, whose parser has no
    tool there (on the H100 on 2026-12-06: ``foundry: error: argument command: invalid choice: 'demo'``)."""
    import os
    import re
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    run = [sys.executable, "-m", "foundry_tools"]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert "{inspect,verify,demo,bench,soak,tp}" in helped.stdout  # the foundry parser, tools added
    demo = subprocess.run(
        [*run, "demo", "--preset", "tiny"], capture_output=True, text=True, env=env, timeout=300
    )
    assert demo.returncode == 2, demo.stderr[-2000:]
    assert demo.stdout.startswith("foundry demo: no NVIDIA GPU is visible"), demo.stdout
    scripts = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.sh"))
    tools = "|".join(commands.ENTRY_POINTS)
    assert not re.search(rf"foundry_core\.cli ({tools})\b", scripts)
    assert re.search(rf"-m foundry_tools ({tools})\b", scripts)
