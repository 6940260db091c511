"""A stand-in distribution that declares ``foundry_tools``' subcommands in ``foundry_graphs.commands``.

The shared environments hold Foundry installed before the packaging metadata declared the group;
until they are installed again, tests that run ``foundry demo``, ``bench``, ``soak`` or ``tp``
register the entries through this: a ``.dist-info`` folder on ``sys.path`` (and on ``PYTHONPATH``,
for the processes they start), which ``importlib.metadata`` reads as it reads an installed one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from foundry_tools.commands import ENTRY_POINTS


def register_commands(
    monkeypatch: pytest.MonkeyPatch, where: Path, entries: dict[str, str], name: str
) -> Path:
    """Declare ``entries`` (command name -> ``module:callable``) in ``foundry_graphs.commands`` as the
    distribution ``name``, found under the folder ``where``; undone with ``monkeypatch``."""
    dist = where / f"{name.replace('-', '_')}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    lines = ["[foundry_graphs.commands]", *(f"{k} = {v}" for k, v in entries.items())]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))
    )
    return dist


def register_tool_commands(monkeypatch: pytest.MonkeyPatch, where: Path) -> Path:
    """``foundry_tools``' own entries, as its packaging metadata declares them."""
    entries = {name: f"foundry_tools.commands:{func}" for name, func in ENTRY_POINTS.items()}
    return register_commands(monkeypatch, where, entries, "foundry-graphs-tool-commands")
