"""``foundry demo``: SAVE in one process, LOAD in a fresh one, compare, print times.

The parent never touches the GPU; each phase runs in its own ``python -m foundry_tools.demo``
subprocess so that the LOAD process has provably never captured anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .options import (  # noqa: F401  (DEFAULT_BATCH_SIZES re-exported)
    CHECK_STRUCTURE_HELP,
    DEFAULT_BATCH_SIZES,
    NO_PREPARE_HELP,
    REINSTANTIATE_HELP,
    HelpFormatter,
    add_arguments,
    workload_argv,
)

ROUNDS = 2  # replays per graph compared, each with different inputs


def _spec_from_args(args):
    from .workloads import Spec

    return Spec(
        variant=args.variant,
        preset=args.preset,
        batch_sizes=tuple(args.batch_sizes),
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        device=args.device,
    )


def _build(args, spec, region=None):
    """The region (unless given) and the model built inside it: the setup a SAVE and every LOAD
    repeat identically. Returns (region, workload); SAVE then calls ``region.end_setup()``."""
    import foundry_core as fc

    from .workloads import Workload

    if region is None:
        region = fc.Region(args.region_base, args.region_size, spec.device)
    workload = Workload(spec)
    with region.routing():
        workload.build(region)
    return region, workload


def _replay_all(workload, replay, out_tensors) -> dict:
    """Replay every batch size ROUNDS times from a fixed generator state; collect outputs on the CPU."""
    import torch

    workload.reset_state()
    torch.cuda.manual_seed(4321)
    results = {}
    for bs in workload.spec.batch_sizes:
        for r in range(ROUNDS):
            workload.set_inputs(bs, r)
            replay(bs)
            torch.cuda.synchronize()
            for key in ("logits", "tokens"):
                results[f"bs{bs}.r{r}.{key}"] = out_tensors(bs, key).detach().cpu().clone()
    return results


def _time_replays(workload, replay, n: int) -> dict[str, float]:
    """Median wall time of one replay per batch size, in microseconds, from CUDA events."""
    import statistics

    import torch

    medians = {}
    for bs in workload.spec.batch_sizes:
        workload.set_inputs(bs)
        for _ in range(10):
            replay(bs)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)
        ]
        for start, end in events:
            start.record()
            replay(bs)
            end.record()
        torch.cuda.synchronize()
        medians[str(bs)] = 1000.0 * statistics.median(a.elapsed_time(b) for a, b in events)
    return medians


def _alternate(native, restored, bs: int, n: int, measure) -> dict[str, list]:
    """``n`` measurements of each of two replay functions at batch size ``bs``, the two kinds
    alternating (native first on even rounds, restored first on odd ones) so that clocks, caches and
    queue depth treat them alike; ``measure(fn, bs)`` runs one replay and returns what it measured."""
    times: dict[str, list] = {"native": [], "restored": []}
    for i in range(n):
        order = (("native", native), ("restored", restored))
        for kind, fn in order if i % 2 == 0 else order[::-1]:
            times[kind].append(measure(fn, bs))
    return times


def _time_interleaved(workload, native, restored, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median replay time per batch size of two graph sets, measured alternately in one process.

    For each batch size both sets get 10 untimed replays, then ``n`` timed replays each, alternating
    (:func:`_alternate`). Microseconds, from CUDA events around each replay.
    """
    import statistics

    import torch

    def events_around(fn, bs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(bs)
        end.record()
        return start, end

    out_native, out_restored = {}, {}
    for bs in workload.spec.batch_sizes:
        workload.set_inputs(bs)
        for _ in range(10):
            native(bs)
            restored(bs)
        times = _alternate(native, restored, bs, n, events_around)
        torch.cuda.synchronize()
        out_native[str(bs)] = 1000.0 * statistics.median(a.elapsed_time(b) for a, b in times["native"])
        out_restored[str(bs)] = 1000.0 * statistics.median(a.elapsed_time(b) for a, b in times["restored"])
    return out_native, out_restored


HOST_SIZES = 3  # batch sizes whose launch cost is timed (smallest, middle, largest)


def paired_difference(native: list[float], restored: list[float]) -> dict[str, float]:
    """restored - native of each round's pair, in the units given: median and quartiles.

    The two calls of a round run back to back, so what moves both (clock, cache, the host's other
    work) cancels in their difference, where a difference of the two medians keeps it: the same
    graph's median launch moved between 67.8 and 183.1 µs from one run to the next on the H200
    (2026-12-02), far more than the differences looked for. A gap shows when the quartiles of the
    differences lie on one side of zero."""
    import statistics

    diffs = sorted(r - n for n, r in zip(native, restored))
    nan = float("nan")
    q1, _q2, q3 = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else (nan, nan, nan)  # too few
    median = statistics.median(diffs) if diffs else nan
    return {"median": median, "p25": q1, "p75": q3, "rounds": len(diffs)}


def _time_host_interleaved(
    workload, native, restored, n: int
) -> tuple[dict[str, float], dict[str, float], dict[str, dict]]:
    """Median host time of one replay call, in microseconds, for two graph sets, alternately, and
    the paired differences (:func:`paired_difference`).

    The GPU is idle and the launch queue empty before each call (synchronized), so what is timed is
    the launch itself on the CPU, as a serving loop pays it; device time is what
    :func:`_time_interleaved` measures. A few batch sizes only: each timed call waits for the last.
    """
    import statistics

    import torch

    def host_time(fn, bs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(bs)
        return time.perf_counter() - t0

    sizes = list(workload.spec.batch_sizes)
    picked = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})[:HOST_SIZES]
    out_native, out_restored, paired = {}, {}, {}
    for bs in picked:
        workload.set_inputs(bs)
        times = _alternate(native, restored, bs, n, host_time)
        torch.cuda.synchronize()
        out_native[str(bs)] = 1e6 * statistics.median(times["native"])
        out_restored[str(bs)] = 1e6 * statistics.median(times["restored"])
        paired[str(bs)] = paired_difference(
            [1e6 * t for t in times["native"]], [1e6 * t for t in times["restored"]]
        )
    return out_native, out_restored, paired


def _raw_launchers(twins, restored):
    """``bs -> launch`` of each native twin's and each restored graph's executable graph through the
    same bare ``cuGraphLaunch`` on the current stream; None where torch does not expose a captured
    graph's executable graph."""
    import torch

    from foundry_core.driver import call, cu

    driver = cu()
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None

    def launcher(exec_of):
        def launch(bs):
            stream = driver.CUstream(init_value=torch.cuda.current_stream().cuda_stream)
            call(driver.cuGraphLaunch, exec_of(bs), stream)

        return launch

    native = {k: driver.CUgraphExec(init_value=int(g.raw_cuda_graph_exec())) for k, g in twins.items()}
    return launcher(lambda bs: native[f"bs{bs}"]), launcher(
        lambda bs: restored.graphs[f"bs{bs}"]._rebuilt.exec
    )


def _warmup(workload, region, spec, label: str = "") -> None:
    """Compile and run every batch size twice on a side stream, as a SAVE does before capturing."""
    import torch

    with region.routing(), region.label(f"{label}warmup"):
        workload.compile()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in spec.batch_sizes:
                workload.set_inputs(bs)
                for _ in range(2):
                    workload.step(bs)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(workload, region, spec, label: str = ""):
    """Capture every batch size (largest first) into the region's graph pool; (graphs, outputs)."""
    import torch

    graphs, outputs = {}, {}
    # Under routing too: torch allocates the generator's graph-side seed/offset words at capture
    # start, outside the capture pool, and graphs that sample read them.
    with region.routing(), region.label(f"{label}capture"):
        for bs in sorted(spec.batch_sizes, reverse=True):
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                outputs[bs] = workload.step(bs)
            g.instantiate()
            graphs[f"bs{bs}"] = g
    torch.cuda.synchronize()
    return graphs, outputs


def _warmup_and_capture(workload, region, spec, label: str):
    """Warm up and capture every batch size natively, as a SAVE does; returns (graphs, outputs)."""
    _warmup(workload, region, spec, label)
    return _capture(workload, region, spec, label)


def _state_digest(workload) -> str:
    """A digest of every parameter and buffer, to tell weight differences from replay differences."""
    import hashlib

    h = hashlib.sha256()
    for name, t in list(workload.model.named_parameters()) + list(workload.model.named_buffers()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def run_save(args) -> dict:
    import torch

    import foundry_core as fc
    from foundry_core.engine.profiling import profiled

    fc.start_recording()
    spec = _spec_from_args(args)
    region, workload = _build(args, spec)
    region.end_setup()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _warmup(workload, region, spec)
    t1 = time.perf_counter()
    graphs, outputs = _capture(workload, region, spec)
    t2 = time.perf_counter()
    tensors = {f"bs{bs}.{k}": v for bs, out in outputs.items() for k, v in out.items()}
    save_timings: dict[str, float] = {}
    # FOUNDRY_PROFILE_DIR: a host profile of fc.save (where the walk's time per node goes)
    with profiled("demo-save"):
        digest = fc.save(
            args.archive,
            graphs=graphs,
            region=region,
            tensors=tensors,
            fingerprint_model=spec.fingerprint(),
            timings=save_timings,
        )
    t3 = time.perf_counter()
    reference = _replay_all(workload, lambda bs: graphs[f"bs{bs}"].replay(), lambda bs, k: outputs[bs][k])
    # Native replays are timed in the LOAD process, interleaved with the restored ones (run_load);
    # --save-replays also times them here, right after capture, as earlier benches did.
    save_replays = getattr(args, "save_replays", 0)
    replay_us = (
        _time_replays(workload, lambda bs: graphs[f"bs{bs}"].replay(), save_replays) if save_replays else {}
    )
    torch.save(reference, args.reference)
    return {
        "phase": "save",
        "graphs": len(graphs),
        "warmup_s": t1 - t0,
        "capture_only_s": t2 - t1,
        "capture_s": t2 - t0,
        "save_s": t3 - t2,
        "save_breakdown": save_timings,
        "digest": digest,
        "stream_captures": fc.stream_captures(),
        "state_digest": _state_digest(workload),
        "live_segments": [[s.index, s.size, s.label] for s in region.segments() if s.live],
        "replay_us": replay_us,
    }


def run_load(args) -> dict:
    import torch

    import foundry_core as fc

    fc.start_recording(keep_images=False)  # here only to count stream captures: a LOAD must begin none
    spec = _spec_from_args(args)
    # As the engine plugins do: the region reserved first, then modules and graphs rebuilt on a
    # thread while the model is built in it.
    region = fc.Region(args.region_base, args.region_size, spec.device)
    prepared = None if getattr(args, "no_prepare", False) else fc.prepare(args.archive, device=spec.device)
    region, workload = _build(args, spec, region)
    torch.cuda.synchronize()
    captures_before = fc.stream_captures()
    t0 = time.perf_counter()
    restored = fc.load(
        args.archive,
        region=region,
        fingerprint_model=spec.fingerprint(),
        upload=getattr(args, "upload", False),
        prepared=prepared,
    )
    torch.cuda.synchronize()
    restore_s = time.perf_counter() - t0  # with prepared: what is left on the critical path
    reinstantiate_s = _reinstantiate(restored) if getattr(args, "reinstantiate", False) else None
    replay = lambda bs: restored.graphs[f"bs{bs}"].replay()  # noqa: E731
    results = _replay_all(
        workload,
        lambda bs: restored.graphs[f"bs{bs}"].replay(),
        lambda bs, k: restored.tensors[f"bs{bs}.{k}"],
    )
    reference = torch.load(args.reference)
    nodes = sum(g.nodes for g in restored.graphs.values())
    per_bs, mismatched = {}, []
    for bs in spec.batch_sizes:
        keys = [k for k in reference if k.startswith(f"bs{bs}.")]
        bad = [k for k in keys if not torch.equal(reference[k], results[k])]
        per_bs[str(bs)] = not bad
        mismatched += bad
    if getattr(args, "dump_graphs", None):
        from foundry_core.graphs import structure

        dump = {name: structure(g._rebuilt.graph) for name, g in restored.graphs.items()}
        Path(args.dump_graphs).write_text(json.dumps(dump, sort_keys=True))
    restored.wait_rebuilt()  # its timings complete, when graphs were still being built at return
    # Everything a LOAD must not do is counted here, before the bench's native twins are captured.
    captures_after = fc.stream_captures()
    fc.stop_recording()  # counted: the replays timed below run without CUPTI attached, as a server's do
    warmup_forwards = workload.forward_calls
    state_digest = _state_digest(workload)
    replay_us, native_us, host_us, native_host_us, raw_native_us, raw_restored_us = {}, {}, {}, {}, {}, {}
    host_paired, raw_paired = {}, {}
    if args.replays:
        # Replay parity, fairly: native twins captured in this same process, timed alternately with
        # the restored graphs on the same inputs (see _time_interleaved), then their launch cost.
        twins, _ = _warmup_and_capture(workload, region, spec, "twin-")
        native_replay = lambda bs: twins[f"bs{bs}"].replay()  # noqa: E731
        native_us, replay_us = _time_interleaved(workload, native_replay, replay, args.replays)
        native_host_us, host_us, host_paired = _time_host_interleaved(
            workload, native_replay, replay, args.replays
        )
        # The same, both executable graphs launched by one bare driver call: what is left of the
        # difference is the executable graph's own launch cost, not the Python around it.
        raw = _raw_launchers(twins, restored)
        if raw is not None:
            raw_native_us, raw_restored_us, raw_paired = _time_host_interleaved(workload, *raw, args.replays)
    structure_differences = twin_differences = None
    if getattr(args, "check_structure", False):
        # Each restored graph as the driver holds it against the archive's description, exactly;
        # and the native twins (captured here, at other addresses) against it, addresses aside:
        # together, restored = captured, node for node and edge for edge.
        structure_differences = restored.check()
        if args.replays:
            from foundry_core.driver import cu
            from foundry_core.rebuilding import differences

            twin_differences = differences(
                restored.archive,
                lambda name: cu().CUgraph(init_value=twins[name].raw_cuda_graph()),
                addresses=False,
            )
    return {
        "phase": "load",
        "graphs": len(restored.graphs),
        "restore_s": restore_s,
        "restore_breakdown": restored.timings,
        # True only when the thread's rebuild was used (a failed one falls back with a warning).
        "prepared": bool(restored.timings.get("prepared_ok")),
        "restore_background_s": restored.timings.get("prepared_s"),
        "deferred_graphs": int(restored.timings.get("deferred_graphs", 0)),
        "retargeted_graphs": int(restored.timings.get("retargeted_graphs", 0)),
        # graphs still being built when load() returned, and how long their first replays waited
        "tail_graphs": int(restored.timings.get("tail_graphs", 0)),
        "first_replay_wait_s": sum(g.waited_s for g in restored.graphs.values()),
        "builder": restored.builder,
        "load_stream_captures": sum(captures_after.values()),
        "stream_captures_during_load": {k: captures_after[k] - captures_before[k] for k in captures_after},
        "load_warmup_forwards": warmup_forwards,
        "bit_exact": per_bs,
        "bit_exact_all": all(per_bs.values()),
        "mismatched": mismatched,
        "state_digest": state_digest,
        "replay_us": replay_us,
        "replay_us_native_twins": native_us,
        "replay_host_us": host_us,
        "replay_host_us_native_twins": native_host_us,
        "launch_host_us": raw_restored_us,
        "launch_host_us_native_twins": raw_native_us,
        "replay_host_us_paired": host_paired,
        "launch_host_us_paired": raw_paired,
        "structure_differences": structure_differences,
        "twin_structure_differences": twin_differences,
        "reinstantiate_s": reinstantiate_s,
        "nodes": nodes,
    }


def _reinstantiate(restored) -> float:
    """An experiment, not a restore step: give each restored graph a fresh executable graph,
    instantiated now from its graph as it stands (memory nodes re-pointed), in place of the one
    built ahead and re-pointed in place. Whether the launch cost of graphs built ahead comes from
    the in-place re-pointing of their executables shows in the launch timings that follow."""
    from foundry_core.driver import call, cu
    from foundry_core.graphs import INSTANTIATE_FLAGS

    restored.wait_rebuilt()
    t0 = time.perf_counter()
    for graph in restored.graphs.values():
        rebuilt = graph._take()
        fresh = call(cu().cuGraphInstantiate, rebuilt.graph, INSTANTIATE_FLAGS)
        call(cu().cuGraphExecDestroy, rebuilt.exec)
        rebuilt.exec = fresh
    return time.perf_counter() - t0


def _worker_args(args, phase: str, archive: str, reference: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "foundry_tools.demo",
        phase,
        "--archive",
        archive,
        "--reference",
        reference,
        "--replays",
        str(getattr(args, "replays", 0)),
        *(["--no-prepare"] if phase == "load" and getattr(args, "no_prepare", False) else []),
        *(["--upload"] if phase == "load" and getattr(args, "upload", False) else []),
        *(["--check-structure"] if phase == "load" and getattr(args, "check_structure", False) else []),
        *(["--reinstantiate"] if phase == "load" and getattr(args, "reinstantiate", False) else []),
        *workload_argv(args),
    ]


def _run_worker(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FOUNDRY_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"foundry demo: the {cmd[3]} process failed (exit {proc.returncode}); see its output above"
        )
    return json.loads(lines[-1][len("FOUNDRY_RESULT ") :])


def _archive_bytes(path: str) -> int:
    root = os.path.realpath(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def _scaling_row(preset: str, save: dict, load: dict, archive: str) -> dict:
    return {
        "preset": preset,
        "graphs": load["graphs"],
        "nodes": load["nodes"],
        "capture_s": save["capture_s"],
        "restore_s": load["restore_s"],
        "graphs_s": load["restore_breakdown"].get("graphs_s"),
        "us_per_node": 1e6 * load["restore_s"] / load["nodes"] if load["nodes"] else None,
        "speedup": save["capture_s"] / load["restore_s"] if load["restore_s"] else None,
        "restore_breakdown": load["restore_breakdown"],
        "archive_bytes": _archive_bytes(archive),
        "bit_exact_all": load["bit_exact_all"],
        "builder": load.get("builder"),
    }


def _extra_presets(args) -> list[str]:
    """Presets to SAVE and LOAD besides the main one (capture and restore times only, no replay timing)."""
    raw = getattr(args, "presets", None) or os.environ.get("FOUNDRY_BENCH_PRESETS", "")
    names = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
    return [p.strip() for p in names if p.strip() and p.strip() != args.preset]


def orchestrate(args) -> dict:
    """SAVE then LOAD in two fresh processes; returns the combined result.

    With ``args.presets`` (or FOUNDRY_BENCH_PRESETS=tiny,small), other model sizes are saved and
    restored too, without replay timing, for restore time against node count (``scaling``).
    """
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="foundry-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    scaling = []
    for preset in _extra_presets(args):
        sub = argparse.Namespace(**{**vars(args), "preset": preset, "replays": 0})
        subdir = workdir / f"preset-{preset}"
        subdir.mkdir(parents=True, exist_ok=True)
        sub_archive, sub_reference = str(subdir / "archive"), str(subdir / "reference.pt")
        sub_save = _run_worker(_worker_args(sub, "save", sub_archive, sub_reference))
        sub_load = _run_worker(_worker_args(sub, "load", sub_archive, sub_reference))
        scaling.append(_scaling_row(preset, sub_save, sub_load, sub_archive))
    archive = str(Path(args.archive) if args.archive else workdir / "archive")
    reference = str(workdir / "reference.pt")
    save = _run_worker(_worker_args(args, "save", archive, reference))
    load = _run_worker(_worker_args(args, "load", archive, reference))
    scaling.append(_scaling_row(args.preset, save, load, archive))
    scaling.sort(key=lambda row: row["nodes"])
    return {
        "variant": args.variant,
        "preset": args.preset,
        "batch_sizes": list(args.batch_sizes),
        "graphs": load["graphs"],
        "capture_s": save["capture_s"],
        "warmup_s": save["warmup_s"],
        "capture_only_s": save["capture_only_s"],
        "save_s": save["save_s"],
        "save_breakdown": save.get("save_breakdown", {}),
        "restore_s": load["restore_s"],
        "restore_critical_s": load["restore_s"],
        "restore_background_s": load.get("restore_background_s"),
        "prepared": load.get("prepared", False),
        "tail_graphs": load.get("tail_graphs", 0),
        "first_replay_wait_s": load.get("first_replay_wait_s", 0.0),
        "restore_breakdown": load["restore_breakdown"],
        "speedup": save["capture_s"] / load["restore_s"] if load["restore_s"] else None,
        "load_stream_captures": load["load_stream_captures"],
        "load_warmup_forwards": load["load_warmup_forwards"],
        "save_stream_captures": save["stream_captures"],
        "bit_exact": load["bit_exact"],
        "bit_exact_all": load["bit_exact_all"],
        "archive": archive,
        "digest": save["digest"],
        "mismatched": load["mismatched"],
        "state_digest_save": save["state_digest"],
        "state_digest_load": load["state_digest"],
        "live_segments_at_save": save["live_segments"],
        "nodes": load["nodes"],
        "reinstantiate_s": load.get("reinstantiate_s"),
        "structure_differences": load.get("structure_differences"),
        "twin_structure_differences": load.get("twin_structure_differences"),
        "builder": load.get("builder"),
        # Native twins captured and timed in the LOAD process, interleaved with the restored graphs.
        "replay_us_native": load.get("replay_us_native_twins") or save["replay_us"],
        "replay_us_restored": load["replay_us"],
        "replay_us_native_save_process": save["replay_us"],
        "replay_host_us_native": load.get("replay_host_us_native_twins", {}),
        "replay_host_us_restored": load.get("replay_host_us", {}),
        "launch_host_us_native": load.get("launch_host_us_native_twins", {}),
        "launch_host_us_restored": load.get("launch_host_us", {}),
        # restored - native twin of each alternating round: median and quartiles, per size
        "replay_host_us_paired": load.get("replay_host_us_paired", {}),
        "launch_host_us_paired": load.get("launch_host_us_paired", {}),
        "replay_method": (
            "native twins captured in the LOAD process after restore; native and restored replays "
            "alternate, median per batch size"
        ),
        "scaling": scaling,
    }


def paired_text(paired: dict) -> str:
    return f"paired {paired['median']:+.2f} us [{paired['p25']:+.2f}, {paired['p75']:+.2f}]"


def print_summary(result: dict) -> None:
    ok = (
        result["bit_exact_all"]
        and result["load_stream_captures"] == 0
        and result["load_warmup_forwards"] == 0
        and not result.get("structure_differences")  # --check-structure: {} when all agree
        and not result.get("twin_structure_differences")
    )
    print(f"foundry demo: {result['variant']} ({result['preset']}), {result['graphs']} decode graphs")
    print(f"  SAVE  warmup + capture   {result['capture_s']:8.3f} s")
    print(f"  LOAD  restore            {result['restore_s']:8.3f} s   ({result['speedup']:.1f}x faster)")
    if result.get("tail_graphs"):
        print(
            f"  LOAD  finished after it  {result['tail_graphs']:8d} graphs "
            f"(first replays waited {result['first_replay_wait_s']:.3f} s)"
        )
    print(f"  LOAD  stream captures    {result['load_stream_captures']:8d}")
    print(f"  LOAD  warmup forwards    {result['load_warmup_forwards']:8d}")
    exact = sum(result["bit_exact"].values())
    print(f"  bit-exact batch sizes    {exact:8d} / {len(result['bit_exact'])}")
    for key, what in (("structure_differences", "restored"), ("twin_structure_differences", "twins")):
        differences = result.get(key)
        if differences is not None:
            print(f"  {what} = saved graphs   {result['graphs'] - len(differences):8d} / {result['graphs']}")
            for name, why in list(differences.items())[:5]:
                print(f"    {name}: {why}")
    for bs, host in sorted(result.get("replay_host_us_restored", {}).items(), key=lambda kv: int(kv[0])):
        native = result["replay_host_us_native"].get(bs, float("nan"))
        raw = result.get("launch_host_us_restored", {}).get(bs, float("nan"))
        raw_native = result.get("launch_host_us_native", {}).get(bs, float("nan"))
        paired = result.get("launch_host_us_paired", {}).get(bs)
        print(
            f"  replay on the CPU, bs {bs:<4} restored {host:6.2f} us, native {native:6.2f} us; "
            f"bare launch {raw:6.2f} / {raw_native:6.2f} us" + (f", {paired_text(paired)}" if paired else "")
        )
    print("  result: " + ("OK, restored graphs are bit-exact" if ok else "FAILED"))


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foundry_tools.demo",
        description="One phase of foundry demo / bench, in its own process (the parent starts both).",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "phase", choices=("save", "load"), help="SAVE (capture and save) or LOAD (restore and compare)"
    )
    p.add_argument(
        "--reference", required=True, help="the SAVE's reference outputs (written by save, read by load)"
    )
    p.add_argument("--replays", type=int, default=0, help="also time this many replays per batch size")
    p.add_argument(
        "--save-replays", type=int, default=0, help="SAVE: also time native replays right after capture"
    )
    p.add_argument(
        "--dump-graphs", default=None, help="LOAD: write the rebuilt graphs' structure here (JSON)"
    )
    p.add_argument("--upload", action="store_true", help="LOAD: upload each graph as it is restored")
    p.add_argument("--no-prepare", action="store_true", help=NO_PREPARE_HELP)
    p.add_argument("--check-structure", action="store_true", help=CHECK_STRUCTURE_HELP)
    p.add_argument("--reinstantiate", action="store_true", help=REINSTANTIATE_HELP)
    add_arguments(p)
    args = p.parse_args(argv)
    result = run_save(args) if args.phase == "save" else run_load(args)
    sys.stdout.flush()
    print("FOUNDRY_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FOUNDRY_NO_PROGRESS", "1")
    sys.exit(main())
