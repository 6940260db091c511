"""``python -m foundry_tools demo|bench|soak|tp ...``: the ``foundry`` command where the checkout runs
uninstalled (``PYTHONPATH=src``, as on the GPU machine the tree travels to). ``foundry`` finds the
tools through installed entry points, which such a tree has none of, so ``foundry demo`` there says
"invalid choice"; this hands ``foundry_core.cli`` the same adders the entry points name.
"""

from __future__ import annotations

import sys

from foundry_core import cli

from . import commands


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, [(name, getattr(commands, fn)) for name, fn in commands.ENTRY_POINTS.items()])


if __name__ == "__main__":
    sys.exit(main())
