"""The GPU side of ``foundry soak``: the SAVE and the LOAD worker processes.

The soak sequence (the replay schedule, the bitwise logits and token checks), the load/unload
cycles and the device and host memory measurements. soak.py explains the method and the pass
criteria; ``python -m foundry_tools.soak save|load`` runs these workers.
"""

from __future__ import annotations

import gc
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

SOAK_SEED = 4321


# ------------------------------------------------------------------------------------------ pure parts


def soak_schedule(sizes, replays: int) -> list[int]:
    """Batch size of each replay: round robin over ``sizes``."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("no batch sizes")
    return [sizes[i % len(sizes)] for i in range(int(replays))]


def token_mismatches(schedule: list[int], expected, got) -> list[bool]:
    """Per replay: do its sampled tokens differ? (``expected``/``got``: concatenated int64 tensors)."""
    import torch

    n = len(schedule)
    if expected.shape != got.shape or int(expected.numel()) != sum(schedule):
        return [True] * n
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(schedule, dtype=torch.long))
    differ = torch.bincount(owner[expected.ne(got)], minlength=n)
    return [bool(x) for x in differ.gt(0).tolist()]


def combine_mismatches(
    schedule: list[int], logit_bad: list[bool], token_bad: list[bool], first_bad: dict[int, bool]
) -> dict:
    """One verdict per replay: logits (later replays vs the first, first replay vs SAVE's digest) or tokens."""
    firsts: dict[int, int] = {}
    for i, bs in enumerate(schedule):
        firsts.setdefault(bs, i)
    logits = [bool(b) for b in logit_bad]
    for bs, i in firsts.items():
        logits[i] = logits[i] or bool(first_bad.get(bs, False))
    per_replay = [a or b for a, b in zip(logits, token_bad)]
    bad = [i for i, b in enumerate(per_replay) if b]
    per_bs: dict[str, int] = {}
    for i in bad:
        per_bs[str(schedule[i])] = per_bs.get(str(schedule[i]), 0) + 1
    return {
        "soak_replays": len(schedule),
        "soak_mismatches": len(bad),
        "logit_mismatches": sum(logits),
        "token_mismatches": sum(bool(b) for b in token_bad),
        "first_mismatches": [[i, schedule[i]] for i in bad[:10]],
        "mismatches_per_batch_size": per_bs,
    }


# ---------------------------------------------------------------------------------- measurements


def host_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(device: int) -> dict:
    """Device and host memory of this process now (after a GC and a device synchronize)."""
    import torch

    from foundry_core.driver import call, cu

    gc.collect()
    torch.cuda.synchronize(device)
    free, total = call(cu().cuMemGetInfo)
    return {
        "torch_allocated": int(torch.cuda.memory_allocated(device)),
        "torch_reserved": int(torch.cuda.memory_reserved(device)),
        "device_used": int(total) - int(free),
        "host_rss": host_rss_bytes(),
    }


def machine_info(device: int) -> str:
    import torch

    from foundry_core.driver import call, cu

    driver = None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={device}", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    if driver is None:
        try:
            text = Path("/proc/driver/nvidia/version").read_text()
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
            driver = m.group(1) if m else None
        except OSError:
            pass
    v = int(call(cu().cuDriverGetVersion))
    api = f"{v // 1000}.{(v % 1000) // 10}"
    return (
        f"{torch.cuda.get_device_name(device)}, driver {driver or 'unknown'} (CUDA driver API {api}), "
        f"torch {torch.__version__}"
    )


# ------------------------------------------------------------------------------ the soak sequence


def _bits(t):
    """The tensor's bit patterns as integers (bitwise comparison, NaN payloads and signed zeros included)."""
    import torch

    if t.is_floating_point():
        return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def logits_digest(t) -> str:
    return hashlib.sha256(_bits(t).contiguous().cpu().numpy().tobytes()).hexdigest()


def run_sequence(step, schedule: list[int], device) -> tuple[dict, object, list[bool]]:
    """Replay ``schedule``; ``step(bs)`` sets the inputs, replays, and returns (logits, tokens).

    Returns each size's first logits (a device copy), all sampled tokens concatenated (on the CPU),
    and per replay whether its logits differ bitwise from that size's first ones. Nothing
    synchronizes inside the loop: comparisons and token copies are queued behind each replay.
    """
    import torch

    tokens = torch.empty(sum(schedule), dtype=torch.int64, device=device)
    bad = torch.zeros(len(schedule), dtype=torch.bool, device=device)
    first: dict[int, object] = {}
    offset = 0
    for i, bs in enumerate(schedule):
        logits, toks = step(bs)
        if bs not in first:
            first[bs] = logits.detach().clone()
        else:
            bad[i] = _bits(logits).ne(_bits(first[bs])).any()
        tokens[offset : offset + bs].copy_(toks.reshape(-1))
        offset += bs
    return first, tokens.cpu(), [bool(b) for b in bad.cpu().tolist()]


def _start_state(workload) -> None:
    import torch

    workload.reset_state()
    torch.cuda.manual_seed(SOAK_SEED)


def _stepper(workload, replay, out):
    def step(bs: int):
        workload.set_inputs(bs, 0)
        replay(bs)
        return out(bs, "logits"), out(bs, "tokens")

    return step


def run_save(args) -> dict:
    """SAVE as ``foundry demo`` does, then the soak sequence on the native graphs (the baseline)."""
    import torch

    import foundry_core as fc

    from .demo import _build, _capture, _spec_from_args, _warmup

    fc.start_recording()
    spec = _spec_from_args(args)
    region, workload = _build(args, spec)
    region.end_setup()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _warmup(workload, region, spec)
    graphs, outputs = _capture(workload, region, spec)
    t1 = time.perf_counter()
    tensors = {f"bs{bs}.{k}": v for bs, out in outputs.items() for k, v in out.items()}
    digest = fc.save(
        args.archive,
        graphs=graphs,
        region=region,
        tensors=tensors,
        fingerprint_model=spec.fingerprint(),
        progress=False,
    )
    t2 = time.perf_counter()
    schedule = soak_schedule(spec.batch_sizes, args.replays)
    _start_state(workload)
    step = _stepper(workload, lambda bs: graphs[f"bs{bs}"].replay(), lambda bs, k: outputs[bs][k])
    first, tokens, logit_bad = run_sequence(step, schedule, workload.device)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    digests = {str(bs): logits_digest(t) for bs, t in first.items()}
    torch.save(
        {"schedule": schedule, "tokens": tokens, "logits_sha256": digests, "seed": SOAK_SEED}, args.baseline
    )
    return {
        "phase": "save",
        "graphs": len(graphs),
        "capture_s": t1 - t0,
        "save_s": t2 - t1,
        "digest": digest,
        "soak_s": t3 - t2,
        "replays": len(schedule),
        "native_logit_mismatches": sum(logit_bad),
        "machine": machine_info(spec.device),
    }


def run_load(args) -> dict:
    """LOAD in this fresh process, the soak against SAVE's baseline, then the load/unload cycles."""
    import torch

    import foundry_core as fc

    from .demo import _build, _spec_from_args

    # No start_recording() here: recording keeps a host copy of every module image loaded, the
    # archive's own included, which would add the archive's code to the RSS at every cycle.
    spec = _spec_from_args(args)
    baseline = torch.load(args.baseline)
    schedule = list(baseline["schedule"])
    region, workload = _build(args, spec)
    torch.cuda.synchronize()
    result: dict = {"phase": "load", "machine": machine_info(spec.device)}

    def load():
        return fc.load(args.archive, region=region, fingerprint_model=spec.fingerprint(), progress=False)

    def stepper(restored):
        return _stepper(
            workload,
            lambda bs: restored.graphs[f"bs{bs}"].replay(),
            lambda bs, k: restored.tensors[f"bs{bs}.{k}"],
        )

    t0 = time.perf_counter()
    restored = load()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    result["restore_s"] = t1 - t0
    result["graphs"] = len(restored.graphs)
    _start_state(workload)
    first, tokens, logit_bad = run_sequence(stepper(restored), schedule, workload.device)
    torch.cuda.synchronize()
    result["soak_s"] = time.perf_counter() - t1
    first_bad = {bs: logits_digest(t) != baseline["logits_sha256"].get(str(bs)) for bs, t in first.items()}
    result["soak"] = combine_mismatches(
        schedule, logit_bad, token_mismatches(schedule, baseline["tokens"], tokens), first_bad
    )
    result["soak"]["first_logits_digest_mismatches"] = sorted(bs for bs, b in first_bad.items() if b)
    restored.unload()
    del restored
    result["after_soak_unload"] = measure(spec.device)

    # Cycles: load, check one replay per size from the start state, measure, unload, measure.
    sizes = list(spec.batch_sizes)
    first_pass = soak_schedule(sizes, len(sizes))
    expected_tokens = baseline["tokens"][: sum(first_pass)]
    curves: dict[str, list[dict]] = {"loaded": [], "unloaded": []}
    load_s, cycle_bad, completed, error = [], 0, 0, None
    for cycle in range(1, args.cycles + 1):
        try:
            t = time.perf_counter()
            restored = load()
            torch.cuda.synchronize()
            load_s.append(time.perf_counter() - t)
        except Exception as e:  # recorded, not raised: the soak's results still get written
            error = f"cycle {cycle}: load failed: {type(e).__name__}: {e}"
            break
        _start_state(workload)
        again, toks, _ = run_sequence(stepper(restored), first_pass, workload.device)
        bad = [bs for bs in sizes if not torch.equal(_bits(again[bs]), _bits(first[bs]))]
        bad_tokens = sum(token_mismatches(first_pass, expected_tokens, toks))
        cycle_bad += len(bad) + bad_tokens
        del again, toks
        curves["loaded"].append({"cycle": cycle, **measure(spec.device)})
        restored.unload()
        del restored
        curves["unloaded"].append({"cycle": cycle, **measure(spec.device)})
        completed = cycle
        print(
            f"foundry soak: cycle {cycle}/{args.cycles}: load {load_s[-1]:.2f} s, "
            f"device used {curves['unloaded'][-1]['device_used']} B, rss {curves['unloaded'][-1]['host_rss']} B",
            file=sys.stderr,
            flush=True,
        )
    result.update(
        curves=curves,
        cycles_completed=completed,
        cycle_error=error,
        cycle_mismatches=cycle_bad,
        load_s_per_cycle=load_s,
    )
    return result
