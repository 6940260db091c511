"""Host time of one replay: a restored graph against torch's own, in the same process (a probe).

Issue 13's target "host time per replay of a restored graph <= torch's + 2 us", measured without an
engine around it. A graph of one small kernel (so the GPU finishes each replay before the next one is
launched, and nothing waits on a full launch queue) is SAVEd in one process; a fresh process LOADs it
and captures the same computation with torch as its twin, then times batches of replays of each,
alternating which goes first, with the process pinned to one CPU:

    python benchmarks/replay_host_probe.py --workdir /tmp/replay-probe --out $OUT/replay-host-h200.json

Each batch: ``torch.cuda.synchronize()``, then ``--batch`` calls of ``replay()`` between two
``time.perf_counter_ns()`` reads (the launches only; the GPU is waited for after the second read).
The result gives each side's median host time per replay over ``--rounds`` batches, their spread
((p90 - p10) / median), the difference, and whether the two graphs' outputs are bitwise equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

ELEMENTS = 4096
FINGERPRINT = {"probe": "replay_host", "elements": ELEMENTS}


def _step(x, out):
    # one fused-free elementwise kernel writing into a fixed output: one kernel node per graph
    torch.mul(x, 1.0001, out=out)


def save(archive: str) -> None:
    import foundry_core as fc
    from foundry_core.config import DEFAULT_REGION_BASE

    fc.start_recording()
    region = fc.Region(DEFAULT_REGION_BASE, 8 << 30, device=0)
    with region.routing():
        gen = torch.Generator(device="cuda").manual_seed(7)
        x = torch.randn(ELEMENTS, device="cuda", generator=gen)
        out = torch.empty_like(x)
    region.end_setup()
    with region.routing():
        for _ in range(2):
            _step(x, out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, pool=region.graph_pool_id()):
            _step(x, out)
    fc.save(
        archive, graphs={"g": g}, region=region, tensors={"x": x, "out": out}, fingerprint_model=FINGERPRINT
    )
    fc.stop_recording()


def _pin() -> int | None:
    """Pin this process to one core from the middle of those it may use: unpinned, the scheduler moves
    the timed loop between cores and its time per replay varies between repetitions."""
    cpus = sorted(os.sched_getaffinity(0))
    if not cpus:
        return None
    os.sched_setaffinity(0, {cpus[len(cpus) // 2]})
    return sorted(os.sched_getaffinity(0))[0]


def _time_batch(graph, batch: int) -> float:
    # graph.replay() looked up at every call, as a serving loop calls it
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(batch):
        graph.replay()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (t1 - t0) / batch / 1000.0


def _stats(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10)
    med = statistics.median(values)
    return {
        "median_us": round(med, 3),
        "p10_us": round(q[0], 3),
        "p90_us": round(q[-1], 3),
        "spread": round((q[-1] - q[0]) / med, 4),
    }


def load(archive: str, rounds: int, batch: int) -> dict:
    import foundry_core as fc
    from foundry_core.config import DEFAULT_REGION_BASE

    cpu = _pin()
    region = fc.Region(DEFAULT_REGION_BASE, 8 << 30, device=0)
    with region.routing():  # SAVE's setup, in SAVE's order
        gen = torch.Generator(device="cuda").manual_seed(7)
        setup = [torch.randn(ELEMENTS, device="cuda", generator=gen)]
        setup.append(torch.empty_like(setup[0]))
    restored = fc.load(archive, region=region, fingerprint_model=FINGERPRINT)
    restored_graph = restored.graphs["g"]
    x, out = restored.tensors["x"], restored.tensors["out"]
    # torch's twin, captured here from a copy of the same input
    x_native, out_native = x.clone(), torch.empty_like(x)
    for _ in range(2):
        _step(x_native, out_native)
    torch.cuda.synchronize()
    native = torch.cuda.CUDAGraph()
    with torch.cuda.graph(native):
        _step(x_native, out_native)
    restored_graph.replay()
    native.replay()
    torch.cuda.synchronize()
    equal = bool(torch.equal(out, out_native))
    sides = {"restored": restored_graph, "torch": native}
    for graph in sides.values():  # settle: first replays (the restored graph's closure is in place)
        for _ in range(3):
            _time_batch(graph, batch)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(_time_batch(sides[name], batch))
    stats = {name: _stats(v) for name, v in times.items()}
    diffs = [a - b for a, b in zip(times["restored"], times["torch"])]
    return {
        "cpu": cpu,
        "rounds": rounds,
        "batch": batch,
        "elements": ELEMENTS,
        "outputs_equal": equal,
        "host_us_per_replay": stats,
        "restored_minus_torch_us": round(stats["restored"]["median_us"] - stats["torch"]["median_us"], 3),
        # each round's restored batch minus its torch batch, measured side by side
        "paired_difference_us": {
            "median": round(statistics.median(diffs), 3),
            "p10": round(statistics.quantiles(diffs, n=10)[0], 3),
            "p90": round(statistics.quantiles(diffs, n=10)[-1], 3),
        },
        "target_met": stats["restored"]["median_us"] <= stats["torch"]["median_us"] + 2.0,
        "replay_is_closure": "replay" in vars(restored_graph),
        "setup_tensors": len(setup),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/replay-probe")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--commit", default=os.environ.get("FOUNDRY_COMMIT"))
    p.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    args = p.parse_args()
    archive = str(Path(args.workdir) / "archive")
    if args.phase == "save":
        save(archive)
        return 0
    if args.phase == "load":
        Path(args.out).write_text(json.dumps(load(archive, args.rounds, args.batch), indent=1) + "\n")
        return 0
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    base = [sys.executable, __file__, "--workdir", args.workdir, "--out", args.out]
    subprocess.run([*base, "--phase", "save"], check=True)
    measured = args.out + ".load"
    subprocess.run([sys.executable, __file__, "--workdir", args.workdir, "--out", measured, "--phase", "load",
                    "--rounds", str(args.rounds), "--batch", str(args.batch)], check=True)  # fmt: skip
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/replay_host_probe.py", *sys.argv[1:]]),
        **json.loads(Path(measured).read_text()),
    }
    os.unlink(measured)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("host_us_per_replay", "restored_minus_torch_us", "target_met", "outputs_equal")
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
