"""Where a LOAD's restore time goes, piece by piece, on the bench's 1.7b archive (a diagnostic).

Usage on the GPU machine (after ``benchmarks/build_native.sh``)::

    python benchmarks/restore_probe.py --workdir /tmp/probe --out $OUT/restore-probe-h200.json

It SAVEs the bench's graph set (``python -m foundry_tools.demo save``) unless the archive is already
there, then, in this fresh process, times separately: reading and checking the archive (read,
sha256, inflate), loading each code image, building every graph without instantiating it,
instantiating with several flag sets and thread counts, uploading, cloning, and the same for graphs
natively captured here. Nothing here is used by LOAD itself; ``foundry bench`` is the measurement of
record.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from foundry_core.config import DEFAULT_REGION_BASE, DEFAULT_REGION_SIZE  # noqa: E402
from foundry_tools.options import BENCH_BATCH_SIZES  # noqa: E402

now = time.perf_counter


def save(args) -> float:
    cmd = [
        sys.executable, "-m", "foundry_tools.demo", "save",
        "--archive", args.archive, "--reference", args.reference,
        "--variant", "qwen3", "--preset", args.preset, "--max-seq-len", "512", "--seed", "1234",
        "--device", "0", "--region-base", hex(DEFAULT_REGION_BASE),
        "--region-size", str(DEFAULT_REGION_SIZE), "--replays", "0",
        "--batch-sizes", *map(str, BENCH_BATCH_SIZES),
    ]  # fmt: skip
    t = now()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return now() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/probe")
    p.add_argument("--preset", default="1.7b")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    args.archive = os.path.join(args.workdir, "archive")
    args.reference = os.path.join(args.workdir, "reference.pt")
    out: dict = {"preset": args.preset}
    if not os.path.exists(os.path.join(args.archive, "manifest.json")):
        out["save_process_s"] = save(args)
    env = dict(os.environ, FOUNDRY_PROBE_CHILD="1")
    cmd = [sys.executable, __file__, "--workdir", args.workdir, "--preset", args.preset, "--out", args.out]
    if os.environ.get("FOUNDRY_PROBE_CHILD"):
        probe(args, out)
    else:
        subprocess.run(cmd, check=True, env=env)


def probe(args, out: dict) -> None:
    import torch

    from foundry_core import _native
    from foundry_core import archive as A
    from foundry_core import graph_codec as G
    from foundry_core.driver import call
    from foundry_core.modules import LoadedModules
    from foundry_tools import demo
    from foundry_tools.workloads import Spec

    out["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING")
    out["cpus"] = os.cpu_count()
    spec = Spec("qwen3", args.preset, tuple(BENCH_BATCH_SIZES), 512, 1234, 0)
    ns = argparse.Namespace(region_base=DEFAULT_REGION_BASE, region_size=DEFAULT_REGION_SIZE)
    region, workload = demo._build(ns, spec)
    torch.cuda.synchronize()
    out["cuda_module_loading_after_torch"] = os.environ.get("CUDA_MODULE_LOADING")

    # ---- archive: read, sha256, inflate
    spent: dict[str, float] = {}
    orig_map = A._map_on_threads

    def timed_map(fn, items, threads, name):
        t = now()
        r = orig_map(fn, items, threads, name)
        spent[name] = spent.get(name, 0.0) + now() - t
        return r

    A._map_on_threads = timed_map
    t = now()
    arch = A.open_archive(args.archive)
    out["archive_open_s"] = now() - t
    out["archive_open_parts_s"] = spent
    A._map_on_threads = orig_map
    for threads in (1, 4, 8, 16):
        A._ZLIB_THREADS = threads
        t = now()
        A.open_archive(args.archive)
        out[f"archive_open_s_zlib{threads}"] = now() - t
    meta = arch.meta
    t = now()
    region.restore_layout(meta["layout"])  # memset and memcpy nodes need their memory mapped
    out["memory_map_s"] = now() - t

    # ---- modules
    images = [(d, arch.read_bytes(f"modules/{d}.cubin")) for d in meta["images"]]
    if os.environ.get("FOUNDRY_PROBE_FOCUS") == "modules":
        focus_modules(out, args, images, meta["kernels"])
        return
    out["images"] = len(images)
    out["image_bytes"] = [len(b) for _, b in images]
    out["kernels"] = len(meta["kernels"])
    mods = LoadedModules()
    per = []
    for d, data in images:
        t = now()
        mods.load(d, data)
        per.append(now() - t)
    out["module_load_s"] = per
    t = now()
    funcs = [mods.function(i, n, a) for i, n, a in meta["kernels"]]
    out["functions_s"] = now() - t
    per_kernel_images = {}
    for i, _n, _ in meta["kernels"]:
        per_kernel_images[i] = per_kernel_images.get(i, 0) + 1
    out["kernels_per_image"] = [per_kernel_images.get(d, 0) for d, _ in images]

    # second copy: sequential again (driver warm), then on a thread while zlib runs on the main thread
    extra = LoadedModules()
    t = now()
    for d, data in images:
        extra.load(d, data)
    out["module_reload_s"] = now() - t
    extra.unload()
    box: dict = {}

    def load_all():
        torch.cuda.set_device(0)
        m = LoadedModules()
        t0 = now()
        for d, data in images:
            m.load(d, data)
        box["s"] = now() - t0
        box["m"] = m

    th = threading.Thread(target=load_all)
    t = now()
    th.start()
    A.open_archive(args.archive)
    t_open = now() - t
    th.join()
    out["overlap"] = {"wall_s": now() - t, "open_s": t_open, "modules_on_thread_s": box["s"]}
    box["m"].unload()

    # ---- graphs: build only, then instantiate variants
    libcuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    libcuda.cuCtxGetCurrent(ctypes.byref(ctx))
    so = _native.graph_lib()
    fptrs = (ctypes.c_void_p * len(funcs))(*[int(f) for f in funcs])
    stream = torch.cuda.current_stream().cuda_stream

    def build_only(data: bytes, flags: int = 0):
        """foundry_graph_build: build only (flags 0), or also instantiate (1); (graph, events, times)."""
        n_events = G.encoded_events(data)
        events = [call("cuEventCreate", 2) for _ in range(n_events)]
        handles = (ctypes.c_void_p * max(n_events, 1))(*[int(e) for e in events])
        graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
        times = (ctypes.c_double * 3)()
        err = ctypes.create_string_buffer(1024)
        rc = so.foundry_graph_build(
            ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data), fptrs, len(funcs),
            handles, n_events, stream, flags, ctypes.byref(graph), ctypes.byref(exec_), times, err, len(err),
        )  # fmt: skip
        assert rc == 0, err.value
        return graph.value, events, list(times)

    blobs = [(e["name"], e["nodes"], arch.read_bytes(e["file"])) for e in meta["graphs"]]
    graphs, build_s = [], []
    for _name, _n, data in blobs:
        t = now()
        g, _ev, _times = build_only(data)
        build_s.append(now() - t)
        graphs.append(g)
    out["graph_names"] = [b[0] for b in blobs]
    out["graph_nodes"] = [b[1] for b in blobs]
    out["build_s"] = build_s
    if os.environ.get("FOUNDRY_PROBE_FOCUS") == "instantiate2":
        focus_instantiate2(out, args, graphs, workload, region, spec)
        return
    if os.environ.get("FOUNDRY_PROBE_FOCUS") == "instantiate":
        focus_instantiate(out, args, graphs, blobs, build_only, region, workload, spec)
        return

    def instantiate_all(flags: int, gs=None):
        execs, per = [], []
        for g in gs or graphs:
            e = ctypes.c_void_p()
            t = now()
            rc = libcuda.cuGraphInstantiateWithFlags(
                ctypes.byref(e), ctypes.c_void_p(g), ctypes.c_ulonglong(flags)
            )
            per.append(now() - t)
            assert rc == 0, rc
            execs.append(e.value)
        return execs, per

    execs9, out["instantiate_flags9_s"] = instantiate_all(9)
    execs0, out["instantiate_flags0_s"] = instantiate_all(0)
    upload = []
    for e in execs9:
        t = now()
        assert libcuda.cuGraphUpload(ctypes.c_void_p(e), ctypes.c_void_p(stream)) == 0
        upload.append(now() - t)
    t = now()
    torch.cuda.synchronize()
    out["upload_s"] = upload
    out["upload_sync_s"] = now() - t
    # upload of the flags-0 set with no wait in between, then one sync
    t = now()
    for e in execs0:
        libcuda.cuGraphUpload(ctypes.c_void_p(e), ctypes.c_void_p(stream))
    out["upload_batch_host_s"] = now() - t
    torch.cuda.synchronize()
    out["upload_batch_total_s"] = now() - t
    clone = []
    for g in graphs:
        c = ctypes.c_void_p()
        t = now()
        assert libcuda.cuGraphClone(ctypes.byref(c), ctypes.c_void_p(g)) == 0
        clone.append(now() - t)
    out["clone_s"] = clone

    # instantiate on 2 and 4 threads (each thread its own graphs)
    for n_threads in (2, 4):
        parts = [graphs[i::n_threads] for i in range(n_threads)]
        res = [None] * n_threads

        def work(i, parts=parts, res=res):
            libcuda.cuCtxSetCurrent(ctx)
            res[i] = instantiate_all(9, parts[i])[1]

        ths = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        t = now()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        out[f"instantiate_threads{n_threads}"] = {"wall_s": now() - t, "sum_s": sum(sum(r) for r in res)}

    # topologies: kernel sequence + edges, from the decoded descriptions
    def topo(gr):
        nodes = [
            [
                nd["type"],
                nd.get("image"),
                nd.get("name"),
                nd.get("attrs"),
                topo(nd["graph"]) if "graph" in nd else None,
            ]
            for nd in gr["nodes"]
        ]
        return [nodes, gr["edges"]]

    keys = {}
    for name, _n, data in blobs:
        top = json.dumps(topo(G.decode(data, meta["kernels"])), sort_keys=True, default=str)
        keys.setdefault(top, []).append(name)
    out["topologies"] = len(keys)
    out["topology_sizes"] = sorted((len(v) for v in keys.values()), reverse=True)

    # ---- natively captured graphs in this process: capture vs instantiate, re-instantiate
    sub = dataclasses.replace(spec, batch_sizes=(1, 64, 256))
    demo._warmup(workload, region, sub, "probe-")
    native = {}
    with region.routing(), region.label("probe-capture"):
        for bs in sub.batch_sizes:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            t = now()
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                workload.step(bs)
            t1 = now()
            g.instantiate()
            t2 = now()
            raw = g.raw_cuda_graph()
            _, re9 = instantiate_all(9, [raw])
            native[str(bs)] = {
                "capture_s": t1 - t,
                "instantiate_s": t2 - t1,
                "reinstantiate_flags9_s": re9[0],
            }
    out["native"] = native
    idx = {n: i for i, n in enumerate(out["graph_names"])}
    out["restored_same_bs"] = {
        bs: {
            "instantiate_flags9_s": out["instantiate_flags9_s"][idx[f"bs{bs}"]],
            "nodes": out["graph_nodes"][idx[f"bs{bs}"]],
        }
        for bs in ("1", "64", "256")
        if f"bs{bs}" in idx
    }
    for key in (
        "build_s",
        "instantiate_flags9_s",
        "instantiate_flags0_s",
        "upload_s",
        "clone_s",
        "module_load_s",
    ):
        vals = out[key]
        out[key + "_total"] = sum(vals)
        out[key + "_median"] = statistics.median(vals)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}, indent=1))


def _cudart():
    import glob

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    for entry in sys.path:
        for path in glob.glob(os.path.join(entry, "nvidia", "**", "libcudart.so*"), recursive=True):
            return ctypes.CDLL(path)
    raise OSError("no libcudart")


def focus_modules(out, args, images, kernels):
    """cuModuleLoadData against cuLibraryLoadData (with and without BINARY_IS_PRESERVED), fresh each."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p

    def addr(b):
        return ctypes.cast(ctypes.c_char_p(b), vp)

    def via_module():
        handles, t = {}, now()
        for d, data in images:
            m = vp()
            assert libcuda.cuModuleLoadData(ctypes.byref(m), addr(data)) == 0
            handles[d] = m
        t1 = now()
        for image, name, _ in kernels:
            f = vp()
            assert libcuda.cuModuleGetFunction(ctypes.byref(f), handles[image], name.encode()) == 0
            assert libcuda.cuFuncLoad(f) == 0
        return t1 - t, now() - t1

    def via_library(preserved):
        handles, t = {}, now()
        for d, data in images:
            lib = vp()
            if preserved:
                opts = (ctypes.c_int * 1)(1)  # CU_LIBRARY_BINARY_IS_PRESERVED
                vals = (vp * 1)(1)
                rc = libcuda.cuLibraryLoadData(ctypes.byref(lib), addr(data), None, None, 0, opts, vals, 1)
            else:
                rc = libcuda.cuLibraryLoadData(ctypes.byref(lib), addr(data), None, None, 0, None, None, 0)
            assert rc == 0, rc
            handles[d] = lib
        t1 = now()
        for image, name, _ in kernels:
            k, f = vp(), vp()
            assert libcuda.cuLibraryGetKernel(ctypes.byref(k), handles[image], name.encode()) == 0
            assert libcuda.cuKernelGetFunction(ctypes.byref(f), k) == 0
            assert libcuda.cuFuncLoad(f) == 0
        return t1 - t, now() - t1

    rows = {}
    for label, fn in (
        ("module", via_module),
        ("library_preserved", lambda: via_library(True)),
        ("library", lambda: via_library(False)),
        ("module_again", via_module),
        ("library_preserved_again", lambda: via_library(True)),
    ):
        load_s, funcs_s = fn()
        rows[label] = {"load_s": load_s, "functions_s": funcs_s}
    out["modules_focus"] = rows
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(rows, indent=1))


def focus_instantiate2(out, args, graphs, workload, region, spec):
    """Page faults, device memory and live executables around each instantiate; a tiny capture before."""
    import resource

    import torch

    from foundry_tools import demo

    libcuda = ctypes.CDLL("libcuda.so.1")
    out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES")

    def inst(g, destroy=False):
        free0, total = ctypes.c_size_t(), ctypes.c_size_t()
        libcuda.cuMemGetInfo_v2(ctypes.byref(free0), ctypes.byref(total))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        e = ctypes.c_void_p()
        t = now()
        assert (
            libcuda.cuGraphInstantiateWithFlags(ctypes.byref(e), ctypes.c_void_p(g), ctypes.c_ulonglong(9))
            == 0
        )
        dt = now() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        free1 = ctypes.c_size_t()
        libcuda.cuMemGetInfo_v2(ctypes.byref(free1), ctypes.byref(total))
        if destroy:
            libcuda.cuGraphExecDestroy(e)
        return {
            "s": dt,
            "minflt": r1.ru_minflt - r0.ru_minflt,
            "utime": r1.ru_utime - r0.ru_utime,
            "stime": r1.ru_stime - r0.ru_stime,
            "dev_mib": (free0.value - free1.value) / 2**20,
        }

    out["loop_a"] = [inst(g) for g in graphs[:10]]
    out["loop_b_destroy"] = [inst(graphs[10], destroy=True) for _ in range(8)]
    x = torch.zeros(16, device="cuda")
    side = torch.cuda.Stream()
    rows = []
    for g in graphs[11:21]:
        tiny = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(tiny, stream=side):
            x.add_(1)
        rows.append(inst(g))
    out["loop_c_after_tiny_capture"] = rows
    out["loop_d"] = [inst(g) for g in graphs[21:31]]
    sub = dataclasses.replace(spec, batch_sizes=(8, 16))
    demo._warmup(workload, region, sub, "probe-")
    native = {}
    with region.routing(), region.label("probe-capture"):
        for bs in sub.batch_sizes:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                workload.step(bs)
            raw = g.raw_cuda_graph()
            native[str(bs)] = [inst(raw), inst(raw), inst(raw)]
    out["native_focus2"] = native
    summary = {
        k: sum(r["s"] for r in out[k]) / len(out[k])
        for k in ("loop_a", "loop_b_destroy", "loop_c_after_tiny_capture", "loop_d")
    }
    out["mean_s"] = summary
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(
        json.dumps(
            {"tunables": out["glibc_tunables"], "mean_s": summary, "native": native, "a": out["loop_a"][:4]},
            indent=1,
        )
    )


def focus_instantiate(out, args, graphs, blobs, build_only, region, workload, spec):
    """Why does torch's first instantiate of a captured graph take about half as long as ours?"""
    import torch

    from foundry_core.driver import call, cu
    from foundry_tools import demo

    libcuda = ctypes.CDLL("libcuda.so.1")
    cudart = _cudart()

    def via_driver(g):
        e = ctypes.c_void_p()
        t = now()
        assert (
            libcuda.cuGraphInstantiateWithFlags(ctypes.byref(e), ctypes.c_void_p(g), ctypes.c_ulonglong(9))
            == 0
        )
        return now() - t

    def via_runtime(g):
        e = ctypes.c_void_p()
        t = now()
        assert (
            cudart.cudaGraphInstantiateWithFlags(ctypes.byref(e), ctypes.c_void_p(g), ctypes.c_ulonglong(9))
            == 0
        )
        return now() - t

    def via_bindings(g):
        t = now()
        call("cuGraphInstantiate", cu().CUgraph(init_value=g), 9)
        return now() - t

    rows = {"driver": [], "runtime": [], "bindings": []}
    for g in graphs:  # interleaved, so drift hits all three alike
        rows["runtime"].append(via_runtime(g))
        rows["driver"].append(via_driver(g))
        rows["bindings"].append(via_bindings(g))
    out["restored_instantiate_by_entry_s"] = {k: sum(v) for k, v in rows.items()}
    # the real path: build then instantiate (and upload) in one native call, per graph
    real = [build_only(data, flags=1)[2] for _name, _n, data in blobs]
    out["real_path_build_s"] = sum(r[0] for r in real)
    out["real_path_instantiate_s"] = sum(r[1] for r in real)
    # native captures: first instantiate through each entry point, then again
    sizes = (1, 2, 4, 64, 128, 256)
    sub = dataclasses.replace(spec, batch_sizes=sizes)
    demo._warmup(workload, region, sub, "probe-")
    native = {}
    entries = [via_runtime, via_driver, via_bindings]
    with region.routing(), region.label("probe-capture"):
        for i, bs in enumerate(sizes):
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                workload.step(bs)
            raw = g.raw_cuda_graph()
            first = entries[i % 3]
            c = ctypes.c_void_p()
            libcuda.cuGraphClone(ctypes.byref(c), ctypes.c_void_p(raw))
            row = {"first_entry": first.__name__, "first_s": first(raw), "again_driver_s": via_driver(raw)}
            row["again_runtime_s"] = via_runtime(raw)
            row["clone_driver_s"] = via_driver(c.value)
            t = now()
            g.instantiate()
            row["torch_instantiate_after_s"] = now() - t
            native[str(bs)] = row
    out["native_focus"] = native
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}, indent=1))


if __name__ == "__main__":
    main()
