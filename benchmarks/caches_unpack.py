"""CPU reproduction: the carried-caches hand-over (``caches.unpack``) alone, and while a graph
archive inflates ahead on a thread (``Archive.inflate_ahead``) or a CPU-bound Python thread runs.

Seen on an H100 host (SGLang 0.5.23, 16 cores): the unpack of 132 files / 13.4 MB took 0.09 s
with the graph archive inflated before it, 0.60 s while that inflate ran beside it. This builds
archives of that shape with the project's own writers (bytes of real shared libraries, so that
they compress like code) and times the unpack under each kind of company. What it showed (every
core busy beside a thread that hands the GIL back at each system call slows that thread most) is
why the plugins now start the inflate after the hand-over, and on half the cores
(foundry_core/engine/prewarm.py): "alone" is a LOAD's hand-over now, "inflate" what it overlaps
where a reader's own inflate-ahead runs.

    .venv-core/bin/python benchmarks/caches_unpack.py [--reps 9] [--graph code|sparse]
        [--root /dev/shm] [--src /path/to/other/src] [--json out.json]

``--src`` times another foundry_core (``git archive HEAD src | tar -x -C /tmp/old``, with the
built native library copied beside it) for a before/after on the same machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ENGINE = {"name": "sglang", "sglang": "0.5.23"}


def _sources() -> list[bytes]:
    """Code-like bytes: shared libraries of the installed venvs (not already-compressed fatbins)."""
    root = Path(__file__).resolve().parent.parent
    pats = [
        ".venv-sglang/lib/python3*/site-packages/flash_mla/*.so",
        ".venv-sglang/lib/python3*/site-packages/deep_ep/*.so",
        ".venv-core/lib/python3*/site-packages/torch/lib/libtorch_cpu.so",
    ]
    out = []
    for pat in pats:
        for p in sorted(glob.glob(str(root / pat))):
            with open(p, "rb") as f:
                f.seek(os.path.getsize(p) // 4)
                out.append(f.read(24 << 20))
    if not out:
        sys.exit("no shared libraries found under .venv-core / .venv-sglang to take bytes from")
    return out


class _Bytes:
    def __init__(self):
        self.src = _sources()
        self.i = 0
        self.pos = 0

    def take(self, n: int) -> bytes:
        src = self.src[self.i % len(self.src)]
        if self.pos + n > len(src):
            self.i, self.pos = self.i + 1, 0
            src = self.src[self.i % len(self.src)]
        out = src[self.pos : self.pos + n]
        self.pos += n
        return out


def _fixed_fingerprint():
    from foundry_core.engine import caches
    from foundry_core.fingerprint import make_fingerprint

    def fingerprint(device, engine, *, rank=0, world_size=1):
        return make_fingerprint(
            gpu_name="NVIDIA H100 80GB HBM3",
            compute_capability="9.0",
            sm_count=132,
            driver_version=13000,
            cuda_version="13.0",
            torch_version="2.11.0+cu130",
            rank=rank,
            world_size=world_size,
            model=caches.model_facts(engine),
        )

    caches.fingerprint = fingerprint


def build(base: Path, graph_kind: str) -> tuple[Path, Path]:
    """A graph-like archive and a caches archive shaped like the H100 run's: sglang-jit 35 files
    (12.3 MB: 7 kernel folders of ninja files, an object and a .so) and triton 97 files (1.0 MB:
    16 kernel folders of cubin, ptx, IR and json).

    ``graph_kind`` "code": 5.2 MB stored, ~53 MB inflated (code images and memory images with some
    content); "sparse": 5.2 MB stored, ~1 GB inflated (memory images of mostly zero bytes, each
    64 KiB chunk holding a few non-zero words, as region.snapshot keeps them)."""
    from foundry_core.archive import ArchiveWriter
    from foundry_core.engine import caches

    src = _Bytes()
    graph = base / f"graph-{graph_kind}"
    with ArchiveWriter(graph) as w:
        for i in range(24):  # code images: ~10 MB raw
            w.add_bytes(f"modules/{i:04x}.cubin", src.take(420_000), compress=True)
        n_mem, mem_size, every = (10, 4 << 20, 64 << 10) if graph_kind == "code" else (4, 256 << 20, 64 << 10)
        for i in range(n_mem):
            buf = bytearray(mem_size)
            for j in range(0, len(buf), every):
                if graph_kind == "code":
                    buf[j : j + 4096] = src.take(4096)
                else:
                    buf[j : j + 16] = src.take(16)
            w.add_bytes(f"memory/{i:05d}.bin", bytes(buf), compress=True)
        for i in range(40):
            w.add_bytes(f"graphs/{i:04d}.bin", src.take(20_000), compress=True)
        w.commit(fingerprint={"x": 1}, meta={"kind": "foundry-graphs"})
    carried = base / "caches"
    if carried.exists():
        return graph, carried
    os.environ[caches.ROOT_ENV] = str(base / "private")
    dirs = caches.CacheDirs.create(["sglang-jit", "triton"], label="pack")
    for i in range(7):
        d = dirs.path("sglang-jit") / f"kernel_{i:02d}_{i * 7919:08x}"
        d.mkdir()
        (d / "build.ninja").write_text(f"rule cc\n  command = nvcc -o $out $in # {i}\n" * 40)
        (d / ".ninja_log").write_text("# ninja log v5\n0\t100\t0\tmain.o\tabc\n")
        (d / ".ninja_deps").write_bytes(src.take(1200))
        (d / "main.o").write_bytes(src.take(300_000))
        so = d / f"kernel_{i:02d}.so"
        so.write_bytes(src.take(1_450_000))
        so.chmod(0o755)
    n = 0
    for i in range(16):
        d = dirs.path("triton") / f"{i * 2654435761 % (1 << 128):032x}"
        d.mkdir()
        for name, size in (
            ("k.cubin", 24_000),
            ("k.ptx", 16_000),
            ("k.ttir", 6_000),
            ("k.ttgir", 7_000),
            ("k.llir", 9_000),
        ):
            (d / name).write_bytes(src.take(size))
            n += 1
        (d / "k.json").write_text(json.dumps({"name": f"k{i}", "num_warps": 4, "shared": 0}))
        n += 1
    (dirs.path("triton") / f"{0:032x}" / "__grp__k.json").write_text("{}")
    caches.pack(carried, dirs, device=0, engine=ENGINE)
    dirs.close()
    return graph, carried


def _spin(stop: threading.Event) -> None:
    """A CPU-bound Python thread (the control: pure bytecode, holds the GIL but for switches)."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def one(graph: Path, carried: Path, company: str, rep: int) -> dict:
    from foundry_core.archive import open_archive
    from foundry_core.engine import caches

    dirs = caches.CacheDirs.create(["sglang-jit", "triton"], label=f"load-{company}-{rep}")
    stop = threading.Event()
    others: list[threading.Thread] = []
    g = None
    if "inflate" in company:
        g = open_archive(graph, inflate=False)
        t = g.inflate_ahead()
        assert t is not None
        others.append(t)
    if "python" in company:
        s = threading.Thread(target=_spin, args=(stop,), daemon=True)
        s.start()
        others.append(s)
    t0 = time.perf_counter()
    caches.unpack(carried, dirs, device=0, engine=ENGINE)
    unpack_s = time.perf_counter() - t0
    opened = _OPENED.pop()
    stop.set()
    for t in others:
        t.join()
    out = {"unpack_s": unpack_s, "open_s": opened[0], **opened[1]}
    if g is not None:
        out["graph_inflate_s"] = g.inflate_s
    dirs.close()
    shutil.rmtree(dirs.root)  # the file system's state stays the same from one repetition to the next
    return out


_OPENED: list = []


def _time_open() -> None:
    """Record how long unpack's open_archive took, and its own split, beside the whole unpack."""
    from foundry_core.engine import caches

    inner = caches.open_archive

    def timed(*a, **k):
        t0 = time.perf_counter()
        archive = inner(*a, **k)
        _OPENED.append((time.perf_counter() - t0, dict(archive.open_timings)))
        return archive

    caches.open_archive = timed


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:6.1f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json")
    ap.add_argument("--graph", default="code", choices=("code", "sparse"))
    ap.add_argument("--companies", default="alone,inflate,python,inflate+python")
    ap.add_argument("--src", help="the foundry_core to time (default: this checkout's src/)")
    ap.add_argument(
        "--root",
        help="where the archives and the private folders go (default: the temporary directory; "
        "/dev/shm takes the file system's own costs out, leaving the CPU's and the GIL's)",
    )
    args = ap.parse_args()
    sys.path.insert(0, args.src or str(Path(__file__).resolve().parent.parent / "src"))
    _fixed_fingerprint()
    _time_open()
    from foundry_core import _native
    from foundry_core.archive import codec, open_archive

    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        graph, carried = build(Path(tmp), args.graph)
        ga, ca = open_archive(graph, inflate=False), open_archive(carried, inflate=False)
        for name, a in (("graph", ga), ("caches", ca)):
            sizes = a.open_timings  # the reader's own count of stored and inflated bytes
            print(
                f"{name}: {len(a.files)} members, {sizes['stored_bytes'] / 1e6:.1f} MB stored, "
                f"{sizes['content_bytes'] / 1e6:.1f} MB inflated"
            )
        del ga, ca
        print(
            f"cpus {os.cpu_count()}, native inflate {_native.inflate_fn() is not None}, zlib threads {codec._ZLIB_THREADS}"
        )
        companies = args.companies.split(",")
        results: dict[str, list[dict]] = {c: [] for c in companies}
        one(graph, carried, "alone", -1)  # warm the page cache and imports
        for rep in range(args.reps):
            for c in companies:  # interleaved, so that drift hits every case alike
                results[c].append(one(graph, carried, c, rep))
        print("median (min-max) ms; write = unpack - open_archive")
        for c, runs in results.items():
            col = {k: [r[k] for r in runs] for k in runs[0]}
            col["write_s"] = [r["unpack_s"] - r["open_s"] for r in runs]
            line = f"{c:>15}: unpack {_ms(col['unpack_s'])}  open {_ms(col['open_s'])}  write {_ms(col['write_s'])}"
            line += f"  [hash {_ms(col['hash_s'])} inflate {_ms(col['inflate_s'])}]"
            if "graph_inflate_s" in col:
                line += f"  graph inflate {_ms(col['graph_inflate_s'])}"
            print(line)
        if args.json:
            Path(args.json).write_text(
                json.dumps({"graph": args.graph, "cpus": os.cpu_count(), "runs": results}, indent=1)
            )


if __name__ == "__main__":
    main()
