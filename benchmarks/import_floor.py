"""How much of a cold start is reading files, and how much of it Foundry's read-ahead takes back (CPU only).

For an engine's entry module (SGLang's HTTP server, vLLM's OpenAI server), in fresh interpreters of
the given Python:

1. ``record``: one import, and the files it read (modules, mapped libraries) written as a
   read-ahead list, the format a SAVE writes (``foundry_core.engine.readahead``);
2. ``cold``: every listed file evicted from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``,
   no root; pages another process has mapped stay), then the import timed;
3. ``cold+readahead``: evicted again, then an interpreter that starts the read-ahead of that list
   as Foundry's plugin does (a helper process plans and reads) and imports the module; with
   ``posix_fadvise(WILLNEED)`` (the default), with plain reads (``cold+readahead-read``) and planned
   and read on the importing process's own threads (``cold+readahead-threads``, as before the
   helper process); ``plan_s`` is how long the plan took (None: not made before the import ended);
4. ``warm``: the import with the files cached (the floor read-ahead aims at).

For SGLang it also times a scheduler start (``--scheduler``): a child process that imports
``sglang.srt.managers.scheduler`` and answers, started by ``spawn`` (SGLang's way: the child
imports again), by ``fork`` from a launcher that imported it (Foundry's way where it is safe), and
from Foundry's fork server (``foundry_core.forkserver`` with the SGLang plugin's ``PRELOAD``, the
way where the launcher has initialised CUDA), started before the launcher's own import as the
plugin's ``register()`` starts it.

How much of each file was in memory after the eviction (``mincore``) is printed, since other
processes on the machine keep pages of shared libraries mapped. Usage::

    python benchmarks/import_floor.py --python /work/main/.venv-sglang/bin/python \
        --module sglang.srt.entrypoints.http_server --scheduler --out sglang.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

RECORD = """
import json, sys, time
t = time.perf_counter()
import {module}
took = time.perf_counter() - t
from foundry_core.engine import readahead
entries = readahead.collect()
json.dump({{"format": readahead.FORMAT, "model": None, "prefix": sys.prefix, "files": entries}},
          open(sys.argv[1], "w"))
print(json.dumps({{"import_s": took, "files": len(entries)}}))
"""

TIMED = """
import json, sys, time
t = time.perf_counter()
{prelude}
import {module}
took = time.perf_counter() - t
ahead = sys.modules.get("foundry_core.engine.readahead")
summary = (ahead.summary() or {{}}) if ahead is not None else {{}}
print(json.dumps({{"import_s": took, "plan_s": summary.get("plan_s")}}))
"""

READAHEAD_PRELUDE = """
import sys
sys.argv = ["bench", "--foundry-config", {config!r}]
from foundry_core.early import start_readahead
start_readahead("bench")
"""


def evict(paths: list[str]) -> int:
    """Drop the files' clean, unmapped pages from the page cache; the bytes asked for."""
    asked = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            asked += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_fraction(paths: list[str]) -> float:
    """The share of the files' bytes in the page cache now (mincore over a read-only mapping)."""
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) == 0:
                resident += sum(v & 1 for v in vec) * page
                total += n * page
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def run_child(python: str, code: str, *args: str, env: dict[str, str]) -> dict:
    t = time.perf_counter()
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data["wall_s"] = wall
    return data


def measure_imports(python: str, module: str, rounds: int, env: dict[str, str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="import-floor-"))
    archive = work / "archive"
    archive.mkdir()
    listing = archive / "readahead-bench.json"
    recorded = run_child(python, RECORD.format(module=module), str(listing), env=env)
    files = [e["path"] for e in json.loads(listing.read_text())["files"]]
    config = work / "foundry.toml"
    config.write_text(f'mode = "load"\narchive_dir = "{archive}"\n')
    plain = TIMED.format(prelude="", module=module)
    ahead = TIMED.format(prelude=READAHEAD_PRELUDE.format(config=str(config)), module=module)
    names = ("cold", "cold+readahead", "cold+readahead-read", "cold+readahead-threads", "warm")
    results: dict[str, list[dict]] = {name: [] for name in names}
    read_env = {**env, "FOUNDRY_READAHEAD_MODE": "read"}
    threads_env = {**env, "FOUNDRY_READAHEAD_HELPER": "0"}
    for _ in range(rounds):
        for name, code, child_env in (
            ("cold", plain, env),
            ("cold+readahead", ahead, env),
            ("cold+readahead-read", ahead, read_env),
            ("cold+readahead-threads", ahead, threads_env),
        ):
            evict(files)
            left = resident_fraction(files)
            r = run_child(python, code, env=child_env)
            r["resident_before"] = round(left, 3)
            results[name].append(r)
        results["warm"].append(run_child(python, plain, env=env))
    return {
        "module": module,
        "files": len(files),
        "mb": round(sum(os.path.getsize(f) for f in files if os.path.exists(f)) / 1e6, 1),
        "recorded_import_s": round(recorded["import_s"], 2),
        "runs": results,
        "median_import_s": {
            k: round(statistics.median(r["import_s"] for r in v), 2) for k, v in results.items()
        },
        "median_wall_s": {k: round(statistics.median(r["wall_s"] for r in v), 2) for k, v in results.items()},
    }


# --- scheduler start: spawn (re-import) against fork (the launcher's modules) -------------------

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def _scheduler_child(conn, started: float) -> None:
    import importlib

    importlib.import_module(SCHEDULER_MODULE)
    conn.send(time.time() - started)
    conn.close()


def _start_child(ctx, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        reader, writer = ctx.Pipe(duplex=False)
        target = _scheduler_child
        if ctx.get_start_method() == "forkserver":
            from foundry_core.forkserver import WithLaunchState

            target = WithLaunchState(_scheduler_child)  # as sched_start wraps SGLang's function
        p = ctx.Process(target=target, args=(writer, time.time()))
        p.start()
        writer.close()  # the child's end only: a child that dies ends the wait below
        try:
            out.append(reader.recv())
        except EOFError:
            p.join()
            raise SystemExit(
                f"the scheduler stand-in ({ctx.get_start_method()}) exited with {p.exitcode}"
            ) from None
        p.join()
    return out


def measure_scheduler(rounds: int, preload: tuple[str, ...] | None = None) -> dict:
    import importlib
    import multiprocessing as mp

    from foundry_core import forkserver
    from foundry_sglang_plugin import SCHEDULER_PRELOAD, SCHEDULER_RESYNCED

    preload = preload or SCHEDULER_PRELOAD

    # The fork server started before the launcher's own imports, as the plugin's register() starts
    # it: its first child waits for the preload, later ones find it done.
    assert forkserver.start(preload, resynced=SCHEDULER_RESYNCED)
    server = mp.get_context("forkserver")
    t = time.perf_counter()
    first = _start_child(server, 1)
    forkserver_first_s = time.perf_counter() - t
    t = time.perf_counter()
    importlib.import_module(SCHEDULER_MODULE)  # the launcher has imported it (engine.py does)
    launcher_s = time.perf_counter() - t
    out = {
        "spawn": _start_child(mp.get_context("spawn"), rounds),
        "fork": _start_child(mp.get_context("fork"), rounds),
        "forkserver-preloaded": _start_child(server, rounds),
    }
    return {
        "launcher_import_s": round(launcher_s, 2),
        "forkserver_first_child_s": round(first[0], 3),
        "forkserver_first_wall_s": round(forkserver_first_s, 3),
        "forkserver_preload": list(preload),
        "runs_s": {k: [round(x, 3) for x in v] for k, v in out.items()},
        "median_s": {k: round(statistics.median(v), 3) for k, v in out.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the engine's interpreter")
    ap.add_argument("--module", required=True, help="the engine's entry module")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--scheduler", action="store_true", help="also time SGLang's scheduler start (spawn/fork)"
    )
    ap.add_argument("--scheduler-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--preload", help="the fork server's modules, comma-separated (default: the SGLang plugin's)"
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args(argv)
    if args.scheduler_only:  # run inside the engine's interpreter
        preload = tuple(args.preload.split(",")) if args.preload else None
        print(json.dumps(measure_scheduler(args.rounds, preload)))
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(dict(e.split("=", 1) for e in args.env))
    result = {"python": args.python, "cpus": os.cpu_count(), "load": os.getloadavg()}
    result["imports"] = measure_imports(args.python, args.module, args.rounds, env)
    if args.scheduler:
        cmd = [
            args.python,
            __file__,
            "--module",
            args.module,
            "--scheduler-only",
            "--rounds",
            str(args.rounds),
            *(["--preload", args.preload] if args.preload else []),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode != 0:
            raise SystemExit(f"scheduler timing failed: {out.stderr.strip().splitlines()[-1:]}")
        result["scheduler"] = json.loads(out.stdout.strip().splitlines()[-1])
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
