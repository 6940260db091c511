"""Which package may import which: the plugins and the tools import foundry_core, never the other way.

    foundry_sglang_plugin, foundry_vllm_plugin  ->  foundry_core  <-  foundry_tools

The library (every module under src/foundry_core) imports neither plugin nor any tool, the
``foundry`` command line (foundry_core/cli.py) included: it finds the tools' subcommands through the
entry-point group ``foundry_graphs.commands``. Read from the source with ``ast`` (imports inside
functions count too), so a lazy import cannot slip through.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CORE = "foundry_core"
TOOLS = "foundry_tools"
PLUGINS = ("foundry_sglang_plugin", "foundry_vllm_plugin")


def imports(source: str) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, at import time?) of every import in ``source``.

    Counts ``import x``, ``from x import y`` (relative ones are resolved only within their own
    package, so they cannot leave it and are left out) and ``importlib.import_module("x")`` /
    ``__import__("x")`` with a literal name. "At import time" is False inside a function body.
    """
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, not in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, child.lineno, not in_function))
            elif isinstance(child, ast.Call) and child.args:
                func, first = child.func, child.args[0]
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if (
                    name in ("import_module", "__import__")
                    and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                ):
                    found.append((first.value, child.lineno, not in_function))
            visit(
                child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            )

    visit(ast.parse(source), False)
    return found


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _files(package: str) -> list[Path]:
    files = sorted((SRC / package).rglob("*.py"))
    assert files, f"no sources under {SRC / package}"
    return files


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in _files(package):
        rel = path.relative_to(SRC).as_posix()
        for module, line, eager in imports(path.read_text()):
            if _top(module) not in forbidden:
                continue
            out.append(f"{rel}:{line} imports {module}" + (" at import time" if eager else ""))
    return out


def test_the_scan_sees_every_kind_of_import():
    source = textwrap.dedent(
        """
        import os, foundry_tools.demo
        from foundry_vllm_plugin.support import x
        from . import config
        from .engine import caches

        class C:
            from foundry_sglang_plugin import y

        def f():
            import importlib
            from foundry_tools import soak
            importlib.import_module("foundry_tools.bench")
            return lambda: __import__("foundry_vllm_plugin")
        """
    )
    assert imports(source) == [
        ("os", 2, True),
        ("foundry_tools.demo", 2, True),
        ("foundry_vllm_plugin.support", 3, True),
        ("foundry_sglang_plugin", 8, True),  # a class body runs at import time
        ("importlib", 11, False),
        ("foundry_tools", 12, False),
        ("foundry_tools.bench", 13, False),
        ("foundry_vllm_plugin", 14, False),
    ]


def test_the_library_imports_no_plugin_and_no_tool():
    assert _violations(CORE, (TOOLS, *PLUGINS)) == []


def test_tools_and_plugins_do_not_import_each_other():
    assert _violations(TOOLS, PLUGINS) == []
    for plugin in PLUGINS:
        assert _violations(plugin, (TOOLS, *(p for p in PLUGINS if p != plugin))) == []


def test_the_tools_import_foundry_core_absolutely():
    """Inside foundry_tools, a relative import names another tool; the library is ``foundry_core.x``."""
    siblings = {p.stem for p in (SRC / TOOLS).iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    wrong = []
    for path in _files(TOOLS):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and path.parent == SRC / TOOLS:
                names = [node.module] if node.module else [a.name for a in node.names]
                wrong += [f"{path.name}:{node.lineno} .{n}" for n in names if n.split(".")[0] not in siblings]
    assert wrong == []


def test_version_and_help_import_neither_torch_nor_the_tools(tmp_path, monkeypatch):
    """``foundry --version`` / ``--help`` (and each subcommand's help) build the parser only: of the
    tools, the entries of ``foundry_graphs.commands`` and the options they add."""
    from tool_commands import register_tool_commands

    register_tool_commands(monkeypatch, tmp_path)  # the child process finds them on PYTHONPATH
    script = textwrap.dedent(
        """
        import json, sys
        from foundry_core import cli

        seen = {}
        for argv in (["--version"], ["--help"], ["demo", "--help"], ["bench", "--help"], ["soak", "--help"], ["tp", "--help"]):
            try:
                cli.main(argv)
            except SystemExit:
                pass
            seen[" ".join(argv)] = sorted(
                m for m in sys.modules if m.split(".")[0] in ("torch", "foundry_tools")
            )
        print(json.dumps(seen))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(seen) == {"--version", "--help", "demo --help", "bench --help", "soak --help", "tp --help"}
    for argv, modules in seen.items():
        assert modules == ["foundry_tools", "foundry_tools.commands", "foundry_tools.options"], (
            argv,
            modules,
        )
    assert "usage: foundry soak" in proc.stdout and "(default: 10000)" in proc.stdout


def _file_of(name: str) -> Path | None:
    """The source file of the foundry_core module ``name`` (a package's __init__.py); None outside."""
    if _top(name) != CORE:
        return None
    base = SRC.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_files(path: Path) -> set[Path]:
    """The foundry_core files that ``path`` imports, relative imports resolved, lazy ones and those
    under ``TYPE_CHECKING`` included (each is an arrow a reader has to follow)."""
    package = path.relative_to(SRC).with_suffix("").parts[:-1]  # a package's own, for its __init__.py too
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # ``from package import name``: the submodule ``name`` where there is one, else the package
            names = [f"{module}.{a.name}" if _file_of(f"{module}.{a.name}") else module for a in node.names]
        out.update(f for f in map(_file_of, names) if f is not None and f != path)
    return out


def _circles() -> list[list[str]]:
    """Every set of foundry_core files that import each other in a loop (Tarjan's strongly connected
    components of the import graph), each as sorted relative paths."""
    graph = {p: _imported_files(p) for p in _files(CORE)}
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    found: list[list[str]] = []

    def strong(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w.relative_to(SRC).as_posix())
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    return sorted(found)


def test_no_import_circles_in_the_library():
    assert _circles() == []


def test_the_circle_finder_sees_a_circle(tmp_path, monkeypatch):
    """A loop through a lazy import and one under TYPE_CHECKING, as the LOAD path had them."""
    package = tmp_path / CORE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    (package / "d.py").write_text("from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _circles() == [[f"{CORE}/a.py", f"{CORE}/b.py", f"{CORE}/c.py"]]


def test_no_library_module_is_over_700_lines():
    long = {
        p.relative_to(SRC).as_posix(): n for p in _files(CORE) if (n := len(p.read_text().splitlines())) > 700
    }
    assert long == {}
