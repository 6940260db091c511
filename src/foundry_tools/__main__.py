"""``python -m foundry_tools demo|bench|soak|tp ...``: the tools' subcommands where the checkout runs
uninstalled (``PYTHONPATH=src``, as on the GPU machine the tree travels to). ``foundry`` finds them
through installed entry points, which such a tree has none of, so ``foundry demo`` there says
"invalid choice". Same parsers, same defaults, same exit codes.
"""

from __future__ import annotations

import argparse
import sys

from foundry_core import __version__

from . import commands


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m foundry_tools",
        description="Foundry's demo and benchmark tools, from an uninstalled checkout",
    )
    p.add_argument("--version", action="version", version=f"foundry {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands.ENTRY_POINTS) + "}")
    for adder in commands.ENTRY_POINTS.values():
        getattr(commands, adder)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
