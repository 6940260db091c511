"""What a subscribed CUPTI costs the launches that follow it, in one process (needs a GPU).

Foundry subscribes CUPTI (module-loaded and stream-capture callbacks only) while a SAVE records
code modules or a LOAD counts captures, and detaches it with ``foundry_core.stop_recording()``.
This times the same small eager workload and the same graph replay in alternating states:
never subscribed, subscribed, stopped, subscribed again, stopped again. Each state: the median of
``--rounds`` rounds of ``--launches`` launches.

    python benchmarks/cupti_overhead.py --out benchmarks/results/cupti-overhead-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="cupti-overhead.json")
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=15)
    opts = p.parse_args(argv)

    import torch

    import foundry_core as fc
    from foundry_tools.commands import git_commit as _git_commit
    from foundry_tools.soak_gpu import machine_info

    x = torch.zeros(256, device="cuda")
    host = torch.zeros(256, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        for _ in range(64):
            x.mul_(1.0001)
    torch.cuda.synchronize()

    def eager_us() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(opts.launches):
            x.add_(1)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / opts.launches * 1e6

    def copy_us() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(opts.launches // 4):
            host.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (opts.launches // 4) * 1e6

    def replay_us() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(opts.launches // 8):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (opts.launches // 8) * 1e6

    def measure() -> dict[str, float]:
        for f in (eager_us, copy_us, replay_us):  # warm
            f()
        return {
            name: round(statistics.median(f() for _ in range(opts.rounds)), 3)
            for name, f in (
                ("eager_launch_us", eager_us),
                ("d2h_copy_us", copy_us),
                ("graph_replay_us", replay_us),
            )
        }

    states = []
    states.append({"state": "never subscribed", **measure()})
    fc.start_recording(keep_images=False)
    states.append({"state": "subscribed", **measure()})
    fc.stop_recording()
    states.append({"state": "stopped", **measure()})
    fc.start_recording(keep_images=False)
    states.append({"state": "subscribed again", **measure()})
    fc.stop_recording()
    states.append({"state": "stopped again", **measure()})

    base = states[0]
    for st in states:
        st["eager_ratio"] = round(st["eager_launch_us"] / base["eager_launch_us"], 3)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git_commit(),
        "machine": machine_info(torch.cuda.current_device()),
        "command": "python benchmarks/cupti_overhead.py " + " ".join(argv or []),
        "launches": opts.launches,
        "rounds": opts.rounds,
        "graph_kernels": 64,
        "states": states,
    }
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)
    for st in states:
        print(
            f"{st['state']:>18}: eager {st['eager_launch_us']:7.2f} us  d2h {st['d2h_copy_us']:7.2f} us"
            f"  replay(64) {st['graph_replay_us']:7.2f} us  eager x{st['eager_ratio']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
