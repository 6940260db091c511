"""The archive directory as engine_faults sees it: what a SAVE left there (polled cheaply while it runs,
verified after the fact), a staged copy of the base archive, a flipped byte, and the file sizes that
disk_full's fallback limit is set from."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

RANK = 0
RECORD_NAMES = {"sglang": f"rank{RANK}.sglang.json", "vllm": f"rank{RANK}.vllm.json"}
START_REPORT = f"rank{RANK}.start.json"  # vLLM's start report, beside the archive


def _scratch_re(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(name)}\.(?:tmp|link|old)-\d+-[0-9a-f]{{8}}")


def quick_state(archive_dir: Path, engine: str) -> dict[str, Any]:
    """Cheap enough to poll every few milliseconds: the graph archive's scratch directories, where
    its link points, and whether the record that marks a SAVE finished exists."""
    try:
        names = os.listdir(archive_dir)
    except OSError:
        names = []
    scratch = _scratch_re(f"rank{RANK}")
    link = archive_dir / f"rank{RANK}"
    try:
        target = os.readlink(link)
    except OSError:
        target = None
    return {
        "scratch": sorted(n for n in names if scratch.fullmatch(n) and ".tmp-" in n),
        "link": target,
        "record": RECORD_NAMES[engine] in names,
    }


def _archive_member(path: Path) -> dict[str, Any]:
    """One archive (graphs or carried caches) at ``path``, opened with every check but the machine's
    fingerprint (foundry_core.archive.open_archive: CPU only)."""
    out: dict[str, Any] = {"present": os.path.lexists(path), "link": None, "ok": False}
    if not out["present"]:
        return out
    with contextlib.suppress(OSError):
        out["link"] = os.readlink(path)
    real = path.resolve()
    files = [p for p in real.rglob("*") if p.is_file()] if real.is_dir() else []
    out["bytes"] = sum(p.stat().st_size for p in files)
    if files:
        biggest = max(files, key=lambda p: p.stat().st_size)
        out["max_member"] = {"name": biggest.relative_to(real).as_posix(), "bytes": biggest.stat().st_size}
    try:
        from foundry_core.archive import ArchiveError, open_archive
    except ImportError as e:
        out["error"] = f"foundry_core not importable here: {e}"
        return out
    try:
        archive = open_archive(path)
    except ArchiveError as e:
        out["error"] = " ".join(str(e).split())[:600]
        return out
    meta = archive.meta
    out.update(ok=True, digest=archive.digest, kind=meta.get("kind"))
    if isinstance(meta.get("graphs"), list):
        out["graphs"] = len(meta["graphs"])
        out["graph_names"] = sorted(str(g.get("name")) for g in meta["graphs"] if isinstance(g, dict))
    if "slots" in meta:
        out["slots"] = meta["slots"]
    return out


def archive_state(archive_dir: Path, engine: str) -> dict[str, Any]:
    """Everything a case asks of an archive directory after the fact: the graph archive and the
    carried caches (verified), the finishing record and whether it agrees with the graph archive,
    version directories, leftovers of killed writes. ``complete``: graphs and caches open and the
    record is there; ``consistent``: complete, the record matches the graph archive, one version of
    each, nothing left over; ``any_archive``: anything of an archive at all (lock files aside)."""
    name = f"rank{RANK}"
    try:
        entries = sorted(os.listdir(archive_dir))
    except OSError as e:
        return {
            "dir": str(archive_dir),
            "exists": False,
            "error": str(e),
            "complete": False,
            "consistent": False,
            "any_archive": False,
            "record": {"present": False},
        }
    graph = _archive_member(archive_dir / name)
    caches = _archive_member(archive_dir / f"{name}.caches")
    record_path = archive_dir / RECORD_NAMES[engine]
    record: dict[str, Any] = {"present": record_path.exists(), "name": RECORD_NAMES[engine]}
    data = None
    if record["present"]:
        try:
            data = json.loads(record_path.read_text())
            record["valid"] = isinstance(data, dict) and "fingerprint" in data
        except (OSError, ValueError) as e:
            record.update(valid=False, error=str(e))
    matches = None
    if isinstance(data, dict) and graph.get("ok"):
        if engine == "sglang":
            outputs = data.get("outputs") or {}
            matches = data.get("slots") == graph.get("slots") and set(outputs) <= set(
                graph.get("graph_names", [])
            )
        else:
            listed = {str(g.get("name")) for g in data.get("graphs") or [] if isinstance(g, dict)}
            matches = data.get("sizing") == graph.get("slots") and listed == set(graph.get("graph_names", []))
    record["matches_graph_archive"] = matches
    versions = {
        n: [e for e in entries if re.fullmatch(rf"\.{re.escape(n)}\.[0-9a-f]{{16}}", e)]
        for n in (name, f"{name}.caches")
    }
    leftovers = [
        e for e in entries if _scratch_re(name).fullmatch(e) or _scratch_re(f"{name}.caches").fullmatch(e)
    ]
    leftovers += [
        e for e in entries if re.fullmatch(rf"{re.escape(name)}\.(?:sglang|vllm|start)\.json\..*\.tmp", e)
    ]
    complete = bool(graph.get("ok") and caches.get("ok") and record.get("valid"))
    return {
        "dir": str(archive_dir),
        "exists": True,
        "entries": entries[:60],
        "graph": graph,
        "caches": caches,
        "record": record,
        "versions": versions,
        "leftovers": leftovers,
        "complete": complete,
        "consistent": bool(
            complete and matches and all(len(v) == 1 for v in versions.values()) and not leftovers
        ),
        # A record with no verified graph archive behind it: what a LOAD must never be offered.
        "loadable_partial": bool(record.get("valid") and not graph.get("ok")),
        "any_archive": bool(
            graph["present"] or caches["present"] or record["present"] or leftovers or any(versions.values())
        ),
    }


def stage_archive(src: Path, dst: Path) -> None:
    """A copy of the base archive (links kept relative, locks and start reports left behind)."""
    shutil.rmtree(dst, ignore_errors=True)
    # Leftovers of a write the base server's stop interrupted (a late caches save) stay behind too.
    skip = shutil.ignore_patterns("*.lock", START_REPORT, "*.tmp", ".*.tmp-*", ".*.link-*", ".*.old-*")
    shutil.copytree(src, dst, symlinks=True, ignore=skip)


def flip_byte(archive: Path) -> dict[str, Any]:
    """Flip one byte in the middle of the largest member of the archive at ``archive`` (a link to
    its version directory); the manifest is left alone, so only that member's sha256 check fails."""
    real = archive.resolve()
    members = sorted(p for p in real.rglob("*") if p.is_file() and p.name != "manifest.json")
    if not members:
        raise RuntimeError(f"{archive} has no member to damage")
    victim = max(members, key=lambda p: (p.stat().st_size, p.as_posix()))
    size = victim.stat().st_size
    offset = size // 2
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
    return {
        "member": victim.relative_to(real).as_posix(),
        "bytes": size,
        "offset": offset,
        "old": old,
        "new": old ^ 0xFF,
    }


def largest_file(roots: list[Path]) -> dict[str, Any]:
    best: dict[str, Any] = {"bytes": 0, "path": None}
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for fn in files:
                p = Path(dirpath, fn)
                with contextlib.suppress(OSError):
                    if not p.is_symlink() and p.stat().st_size > best["bytes"]:
                        best = {"bytes": p.stat().st_size, "path": str(p)}
    return best


def rlimit_threshold(archive_max: int | None, other_max: int | None) -> tuple[int | None, str]:
    """RLIMIT_FSIZE for disk_full's fallback: three quarters of the largest graph-archive member, if
    that still leaves a quarter of headroom over every other file the base SAVE wrote."""
    if not archive_max or other_max is None:
        return None, "the base SAVE's file sizes are unknown"
    limit = archive_max * 3 // 4
    if limit <= other_max * 5 // 4:
        return None, (
            f"largest graph-archive member {archive_max} B is not clearly larger than the largest other "
            f"file the SAVE wrote ({other_max} B): a file size limit cannot fail only the archive"
        )
    return limit, f"RLIMIT_FSIZE {limit} B: graph member {archive_max} B, other files at most {other_max} B"
