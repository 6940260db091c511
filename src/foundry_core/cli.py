"""The ``foundry`` command: inspect and verify, and the subcommands other packages add.

``inspect`` and ``verify`` are the core's own. Other subcommands (``demo``, ``bench``, ``soak`` and
``tp``, from the ``foundry_tools`` package) are found through the entry-point group
``foundry_graphs.commands``: each entry names a callable that adds its subparser to the ``foundry``
parser's subparsers. The core never imports ``foundry_tools``; ``foundry --version`` and ``foundry
--help`` import no torch (an entry's module must be cheap to load, and the tools import theirs when
their subcommand runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

from . import __version__

COMMANDS_GROUP = "foundry_graphs.commands"

# Exit codes of inspect and verify (the --help epilog and docs/api.md list them).
EXIT_OK, EXIT_REFUSED, EXIT_NOT_CHECKED = 0, 1, 2
EXIT_CODES = """exit codes:
  0  every archive checked is sound (verify: and matches this machine)
  1  an archive was refused: missing, damaged, not a graph archive, a rank absent or saved for
     another rank, or (verify) saved for another machine, device or launch
  2  an archive could not be checked here (verify without --integrity-only: no GPU or driver to
     read this machine's fingerprint from); also a usage error"""


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


_RANK_DIR = re.compile(r"rank(\d+)")


def rank_archives(path: str | Path) -> list[tuple[int | None, Path]]:
    """The archives that ``path`` names: itself when it is one archive (or not one: opening it then
    says why), else each ``rank<N>`` of an engine's archive directory, by rank (None: one archive)."""
    p = Path(path)
    if not p.is_dir() or (p / "manifest.json").exists() or (p / "manifest.json").is_symlink():
        return [(None, p)]
    ranks = []
    for child in p.iterdir():
        found = _RANK_DIR.fullmatch(child.name)
        if found and (child.is_dir() or child.is_symlink()):  # a dangling link is reported when opened
            ranks.append((int(found.group(1)), child))
    return sorted(ranks) or [(None, p)]


def _missing_ranks(ranks: list[tuple[int | None, Path]], world_sizes: dict[int, int]) -> list[str]:
    """What a set of rank archives lacks or holds wrong: every rank below each one's world size,
    one world size for all (a rank archive's own rank is checked by its fingerprint)."""
    if not world_sizes:
        return []
    sizes = set(world_sizes.values())
    if len(sizes) > 1:
        shown = ", ".join(f"rank{r}: {w}" for r, w in sorted(world_sizes.items()))
        return [f"the rank archives were saved for different world sizes ({shown}); SAVE again"]
    present = {rank for rank, _ in ranks}
    return [f"rank{r} of {max(sizes)} is missing; SAVE again" for r in range(max(sizes)) if r not in present]


def cmd_inspect(args) -> int:
    ranks = rank_archives(args.archive)
    worst, world_sizes = EXIT_OK, {}
    for rank, path in ranks:
        if rank is not None:  # one block per rank, a blank line between
            print(("" if rank == ranks[0][0] else "\n") + f"== rank{rank} ==")
        code, fingerprint = _inspect_one(path, list_kernels=args.kernels)
        worst = max(worst, code)
        if rank is not None and fingerprint is not None:
            world_sizes[rank] = fingerprint.get("world_size", 1)
    for why in _missing_ranks(ranks, world_sizes):
        print(f"foundry inspect: {Path(args.archive)}: {why}", file=sys.stderr)
        worst = EXIT_REFUSED
    return worst


def _inspect_one(path: Path, *, list_kernels: bool) -> tuple[int, dict | None]:
    """Print one archive; its exit code and fingerprint (None when it could not be opened)."""
    from .archive import ArchiveError, open_archive
    from .graph_codec import read_description

    try:
        archive = open_archive(path)
    except ArchiveError as e:
        print(f"foundry inspect: {e}", file=sys.stderr)
        return EXIT_REFUSED, None
    meta, fp = archive.meta, archive.fingerprint
    if meta.get("kind") == "foundry-caches":
        print(f"archive   {archive.path} (carried compile caches)")
        print(f"digest    {archive.digest}")
        _print_caches(archive)
        return EXIT_OK, fp
    print(f"archive   {archive.path}")
    print(f"digest    {archive.digest}")
    stored = sum(entry["size"] for entry in archive.manifest["files"].values())
    packed = sum(1 for entry in archive.manifest["files"].values() if "encoding" in entry)
    print(
        f"files     {len(archive.files)}, {_human(sum(archive.files.values()))} "
        f"({_human(stored)} on disk, {packed} compressed)"
    )
    print("\nfingerprint")
    for key, value in fp.items():
        print(f"  {key:<20} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    rows = []
    for g in meta.get("graphs", []):
        desc = read_description(archive, g)
        kernels = sum(1 for n in desc["nodes"] if n["type"] == "kernel")
        comms = ", ".join(f"{k} {n}" for k, n in sorted((g.get("collectives") or {}).items())) or "-"
        rows.append([g["name"], g["nodes"], kernels, len(desc["edges"]), "yes" if g["rng"] else "no", comms])
    print()
    print(_table(rows, ["graph", "nodes", "kernels", "edges", "rng", "collectives"]))
    totals = meta.get("collectives")
    if totals is not None:  # archives saved before collectives were counted have no entry
        shown = ", ".join(f"{k} {n}" for k, n in totals.items()) or "none"
        print(f"\ncollective kernels: {shown} (NCCL kernels are refused at SAVE)")
    for rec in meta.get("symmetric", []):  # torch symmetric memory the graphs address, checked at LOAD
        peers = ", ".join(f"{p:#x}" for p in rec["buffer_ptrs"])
        print(
            f"symmetric {rec['name']}: rank {rec['rank']} of {rec['world_size']}, {_human(rec['buffer_size'])} "
            f"per rank at {peers}; multicast {rec['multicast_ptr']:#x}"
        )
    heap = meta.get("nvshmem_heap")
    if heap:  # NVSHMEM's heap as SAVE placed it; LOAD must place it the same (checked)
        print(f"NVSHMEM heap: {_human(heap['size'])} at {heap['base']:#x}")
    rows = []
    by_image: dict[str, int] = {}
    for image, _name, _attrs in meta.get("kernels", []):
        by_image[image] = by_image.get(image, 0) + 1
    # Variables SAVE found changed in the engine's module, written into the restored one at LOAD;
    # modules whose NVSHMEM device state the LOAD process's NVSHMEM sets up (module_globals.py).
    variables = Counter(row[0] for row in meta.get("globals", []))
    nvshmem = set(meta.get("nvshmem_images", []))
    # variables holding pointers outside the region, left as the image has them
    skipped = Counter(row[0] for row in meta.get("globals_skipped", []))
    for image in meta.get("images", []):
        state = [f"{variables[image]} variables"] if image in variables else []
        state += [f"{skipped[image]} not restored"] if image in skipped else []
        state += ["NVSHMEM"] if image in nvshmem else []
        rows.append(
            [
                image[:16],
                by_image.get(image, 0),
                _human(archive.files[f"modules/{image}.cubin"]),
                ", ".join(state) or "-",
            ]
        )
    print()
    print(_table(rows, ["module", "kernels used", "bytes", "restored state"]))
    if list_kernels:
        print()
        print(
            _table([[image[:16], name] for image, name, _ in meta.get("kernels", [])], ["module", "kernel"])
        )
    layout = meta.get("layout", {})
    live = [s for s in layout.get("segments", []) if s[2]]
    print(
        f"\nregion    base {layout.get('base', 0):#x}, {len(layout.get('segments', []))} segments "
        f"({len(live)} live, {_human(sum(s[1] for s in live))})"
    )
    carried = Path(str(archive.path).rstrip("/") + ".caches")
    if carried.is_dir():
        try:
            caches = open_archive(carried)
        except ArchiveError as e:
            print(f"\ncaches    {carried}: {e}")
        else:
            print(f"\ncaches    {carried}, digest {caches.digest}")
            _print_caches(caches)
    return EXIT_OK, fp


def _print_caches(archive) -> None:
    """The carried caches of an engine: one row per cache kind."""
    engine = (archive.fingerprint.get("model") or {}).get("engine") or {}
    name = engine.get("name", "?")
    version = engine.get(name) or ""
    rows = [
        [
            f"{name} {version}".strip(),
            kind,
            v.get("files", 0),
            _human(int(v.get("bytes", 0))),
            v.get("what", ""),
        ]
        for kind, v in sorted((archive.meta.get("kinds") or {}).items())
    ]
    print()
    print(_table(rows, ["engine", "cache", "files", "bytes", "what"]))


def cmd_verify(args) -> int:
    ranks = rank_archives(args.archive)
    several = ranks[0][0] is not None
    if several and args.rank is None and args.digest is not None:
        print(
            f"foundry verify: --digest pins one archive; {args.archive} holds {len(ranks)} rank archives: "
            "give one of them, or --rank",
            file=sys.stderr,
        )
        return EXIT_NOT_CHECKED
    if several and args.rank is not None:  # one rank of an archive directory: that rank's archive
        ranks = [(rank, path) for rank, path in ranks if rank == args.rank]
        if not ranks:
            print(
                f"foundry verify: REFUSED: no rank{args.rank} archive under {args.archive}", file=sys.stderr
            )
            return EXIT_REFUSED
    codes, world_sizes = [], {}
    for rank, path in ranks:
        code, fingerprint = _verify_one(path, rank, args)
        codes.append(code)
        if rank is not None and fingerprint is not None:
            world_sizes[rank] = fingerprint.get("world_size", 1)
    if several and args.rank is None:
        for why in _missing_ranks(ranks, world_sizes):
            print(f"foundry verify: REFUSED: {Path(args.archive)}: {why}", file=sys.stderr)
            codes.append(EXIT_REFUSED)
    worst = EXIT_REFUSED if EXIT_REFUSED in codes else max(codes)
    if several:
        ok = codes.count(EXIT_OK)
        verdict = "OK" if worst == EXIT_OK else ("REFUSED" if worst == EXIT_REFUSED else "NOT CHECKED")
        print(f"foundry verify: {verdict}: {ok} of {len(ranks)} rank archives under {args.archive} sound")
    return worst


def _verify_one(path: Path, rank_dir: int | None, args) -> tuple[int, dict | None]:
    """Check one archive; its exit code and fingerprint (None when it was refused unread)."""
    from .api import verify
    from .archive import ArchiveError, open_archive
    from .archive_check import check_structure

    fingerprint = None
    try:
        # Checksums and structure first: no GPU needed, and a damaged archive is refused before the
        # machine is asked anything.
        saved = open_archive(path, expected_digest=args.digest)
        check_structure(saved)
        fingerprint = saved.fingerprint
        if rank_dir is not None and args.rank is None and fingerprint.get("rank", 0) != rank_dir:
            raise ArchiveError(
                f"archive {path} was saved by rank {fingerprint.get('rank', 0)}, not rank {rank_dir}; SAVE again"
            )
        graphs = len(saved.meta["graphs"])
        if args.integrity_only:
            print(
                f"foundry verify: OK: {path} ({graphs} graphs): checksums and structure sound "
                "(this machine not compared: --integrity-only)"
            )
            return EXIT_OK, fingerprint
        # A multi-GPU launch keeps an archive per rank, each saved on its own device: unless told
        # otherwise, check each as its own rank would load it (rank, world size, device ordinal).
        rank = fingerprint.get("rank", 0) if args.rank is None else args.rank
        world_size = fingerprint.get("world_size", 1) if args.world_size is None else args.world_size
        device = saved.meta.get("device", 0) if args.device is None else args.device
        verify(path, device=device, rank=rank, world_size=world_size, expected_digest=args.digest)
    except ArchiveError as e:
        print(f"foundry verify: REFUSED: {e}", file=sys.stderr)
        return EXIT_REFUSED, None
    except RuntimeError as e:
        print(
            f"foundry verify: NOT CHECKED: {e} (--integrity-only checks the archive alone)", file=sys.stderr
        )
        return EXIT_NOT_CHECKED, fingerprint
    print(f"foundry verify: OK: {path} ({graphs} graphs) matches this machine")
    return EXIT_OK, fingerprint


def _subcommands() -> list[tuple[str, object]]:
    """The subcommands other packages register in ``foundry_graphs.commands``: (name, adder), by name.

    A name registered twice (a stale install beside a fresh one) is taken once; one that fails to
    load is left out with a one-line note on stderr, so that it cannot take inspect and verify down.
    """
    from importlib.metadata import entry_points

    found: dict[str, object] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name in found or ep.name in ("inspect", "verify"):
            continue
        try:
            found[ep.name] = ep.load()
        except Exception as e:  # a broken or half-installed package
            print(
                f"foundry: subcommand {ep.name!r} ({ep.value}) not loaded: {type(e).__name__}: {e}",
                file=sys.stderr,
            )
    return sorted(found.items())


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one (not None, not a flag's False); the epilog kept as written."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser(subcommands: list[tuple[str, object]] | None = None) -> argparse.ArgumentParser:
    """The ``foundry`` parser: inspect, verify, and the subcommands of ``foundry_graphs.commands``
    (or ``subcommands``, (name, adder) pairs, where no entry point is installed to find them by)."""
    fmt = _HelpFormatter
    p = argparse.ArgumentParser(
        prog="foundry",
        description="CUDA-graph persistence for LLM serving engines",
        formatter_class=fmt,
        epilog=f"inspect and verify {EXIT_CODES}",
    )
    p.add_argument("--version", action="version", version=f"foundry {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    where = (
        "an archive directory: one archive, or an engine's archive_dir holding one per rank "
        "(rank0, rank1, ...), each taken in turn"
    )
    what = "show an archive's graphs, kernels, modules, bytes and fingerprint"
    i = sub.add_parser("inspect", help=what, description=what, formatter_class=fmt, epilog=EXIT_CODES)
    i.add_argument("archive", help=f"{where}; or carried caches, ARCHIVE.caches")
    i.add_argument("--kernels", action="store_true", help="also list every kernel by name")
    i.set_defaults(func=cmd_inspect)

    what = "check an archive's integrity and fingerprint against this machine"
    v = sub.add_parser("verify", help=what, description=what, formatter_class=fmt, epilog=EXIT_CODES)
    v.add_argument("archive", help=where)
    v.add_argument(
        "--integrity-only",
        action="store_true",
        help="check checksums and structure only (every member, field, image, snapshot and graph a LOAD "
        "reads); needs no GPU and does not compare this machine",
    )
    v.add_argument(
        "--device",
        type=int,
        default=None,
        help="CUDA device index it would be loaded on (default: the one it was saved on)",
    )
    v.add_argument(
        "--rank",
        type=int,
        default=None,
        help="rank it would be loaded as (default: its own); of an archive_dir, only that rank's archive",
    )
    v.add_argument(
        "--world-size", type=int, default=None, help="ranks of the launch (default: as it was saved)"
    )
    v.add_argument(
        "--digest", default=None, help="also require this archive digest (sha256; one archive, or one --rank)"
    )
    v.set_defaults(func=cmd_verify)

    for name, add in _subcommands() if subcommands is None else subcommands:
        try:
            add(sub)
        except Exception as e:  # its parser is left out; the others still work
            print(f"foundry: subcommand {name!r} not added: {type(e).__name__}: {e}", file=sys.stderr)
    return p


def main(argv=None, subcommands: list[tuple[str, object]] | None = None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = build_parser(subcommands).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
