"""``foundry soak``: long replay of restored graphs, load/unload cycles, and the CPU reliability suite.

One command, three processes that matter (the parent itself never touches the GPU):

* **SAVE** (``python -m foundry_tools.soak save``): builds the embedded model, warms up and captures
  one decode graph per batch size exactly as ``foundry demo`` does, saves the archive, then runs
  the *soak sequence* on the native graphs and records its baseline.
* **LOAD** (``python -m foundry_tools.soak load``, a fresh process that never captured): restores
  the archive, runs the same soak sequence on the restored graphs and compares it with the
  baseline; unloads; then does ``--cycles`` more load/unload cycles in the same process, measuring
  device and host memory after each.
* **CPU suite** (``python -m foundry_tools.soak cpu-suite --tests DIR``, started first, run
  alongside with no GPU visible): the tamper matrix, the damage fuzzing and the SIGKILL crash test,
  with a small pytest plugin that *counts* what ran (matrix rows refused, Hypothesis test cases
  executed, kills performed and what each left behind). Nothing in the result is copied from
  documentation. Those tests live in the repository, not in the installed package, so this phase
  runs only when ``--tests`` names the repository's ``tests/`` folder; without it the phase is
  skipped (with a line saying so) and its criteria are left out of the record.

The soak sequence and why its baseline is sound
-----------------------------------------------
Replay ``i`` (``0 <= i < replays``) uses batch size ``sizes[i % len(sizes)]`` with that size's
fixed inputs (``Workload.set_inputs(bs, 0)``), after ``Workload.reset_state()`` and
``torch.cuda.manual_seed(SOAK_SEED)``. Each graph ends by sampling with Philox random numbers; its
replay publishes the generator's (seed, offset) and advances the offset by the graph's increment,
so the sampled tokens of replay ``i`` depend on every replay before it. Two checks:

* **Tokens, every replay, against a recorded sequence.** SAVE runs the identical sequence (same
  schedule, same seed, same start state) on the native graphs and records all sampled tokens
  (``sum(schedule)`` int64 values, a few MB). LOAD must reproduce each replay's tokens exactly.
* **Logits, every replay, bit for bit.** Logits do not depend on the RNG, and with fixed inputs
  they are the same at every replay of one batch size: the decode step writes the KV entry of each
  row at that row's position and reads only that row's cache, so what a replay reads was written
  by the replay itself, whatever ran before. This is not assumed: SAVE compares every native
  replay's logits with that size's first replay and records the count (``native_logit_mismatches``,
  0 or the method is void and the run fails). SAVE keeps a sha256 of each size's first logits; LOAD
  checks its own first logits against those digests, then compares every later replay's logits on
  the device with its own first ones (bit patterns, so -0.0/+0.0 or NaN payloads count too).

A replay counts as a mismatch if its logits or its tokens differ; ``soak_mismatches`` must be 0.

Load/unload cycles and the pass criteria
----------------------------------------
After the soak's own LOAD is unloaded, cycle ``c = 1..cycles`` loads the archive again, replays
each batch size once from the start state (logits and tokens must equal the soak's first pass:
a reloaded archive must still be right, not merely fit), measures, unloads, and measures again.
Each measurement: ``torch.cuda.memory_allocated`` / ``memory_reserved``, device bytes in use from
``cuMemGetInfo`` (total - free: everything the process holds on the GPU, torch's cache, Foundry's
mapped segments, modules, graph executables and the driver's own), and the process RSS from
``/proc/self/status``. Growth is ``curve[last] - curve[warmup]``: the first ``--warmup-cycles``
cycles (default 1) may settle lazily created driver and allocator state once.

* Device: ``device_mem_growth_bytes`` (cuMemGetInfo, after unload) must be **0**. Physical memory
  is handed out in 2 MiB granules, and a LOAD maps hundreds of MB; anything a cycle kept (a
  segment left mapped, a module left loaded, a graph executable not destroyed) shows as at least
  one granule every cycle, so there is no noise floor to allow for on a GPU this process owns.
* Host: RSS growth after the warm-up must stay under ``--host-growth-limit-mib`` (default 64 MiB).
  Each LOAD reads the whole archive (about 170 MB of code images, plus graph descriptions) into
  host memory; a cycle that kept any of it would add tens of MB per cycle, hundreds over 19. What
  the limit does allow for is allocator noise: glibc and pymalloc keep freed memory for reuse and
  return it to the system in no fixed rhythm.

The run fails (exit 1) if any of these is not met: ``soak_mismatches == 0``,
``native_logit_mismatches == 0``, all cycles completed, ``cycle_mismatches == 0``, device growth 0,
host growth under the limit, every tamper matrix row refused, ``kill_loadable_partial == 0`` and
the CPU suite passed (these last three only where the CPU suite ran).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .options import (  # noqa: F401  (re-exported: the soak's defaults and options)
    DEFAULT_CYCLES,
    DEFAULT_HOST_GROWTH_LIMIT_MIB,
    DEFAULT_REPLAYS,
    DEFAULT_WARMUP_CYCLES,
    HelpFormatter,
    add_arguments,
    add_soak_arguments,
    workload_argv,
)

SOAK_SEED = 4321
RESULT_PREFIX = "FOUNDRY_RESULT "

# The CPU suite's test files, by name, in the folder given with ``--tests`` (the repository's tests/).
TAMPER_FILE = "test_tamper_matrix.py"
FUZZ_FILE = "test_archive_fuzz.py"
CRASH_FILE = "test_archive_crash.py"
CPU_SUITE_FILES = (TAMPER_FILE, FUZZ_FILE, CRASH_FILE)
KILL_TEST = "test_sigkill_during_save_never_leaves_a_partial_archive"
SWEEP_TEST = "test_every_flipped_manifest_byte"
MATRIX_TEST = "test_tamper_matrix"


# ------------------------------------------------------------------------------------------ pure parts


def soak_schedule(sizes, replays: int) -> list[int]:
    """Batch size of each replay: round robin over ``sizes``."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError("no batch sizes")
    return [sizes[i % len(sizes)] for i in range(int(replays))]


def growth(curve: list[int], warmup: int) -> int | None:
    """``curve[-1] - curve[w - 1]`` with ``w = max(warmup, 1)``: from the end of the warm-up to the last cycle.

    ``curve[k]`` is the value measured after cycle ``k + 1``. None when the curve has no point
    past the warm-up (nothing to compare).
    """
    base = max(int(warmup), 1) - 1
    if len(curve) < base + 2:
        return None
    return int(curve[-1]) - int(curve[base])


def parse_hypothesis_statistics(text: str) -> dict[str, int]:
    """Test cases Hypothesis executed, from the statistics it attaches to a pytest item.

    Counts the explicit, reuse and generate phases (shrinking only happens after a failure and
    re-runs variations of it). Accepts both the current wording (``N passing, M failing, and K
    invalid test cases``) and the older one (``N passing examples, M failing examples, ...``).
    """
    counts = {"passing": 0, "failing": 0, "invalid": 0}
    pattern = re.compile(
        r"during (\w+) phase.*?(\d+) passing(?: examples?)?, (\d+) failing(?: examples?)?,"
        r" (?:and )?(\d+) invalid",
        re.S,
    )
    for phase, passing, failing, invalid in pattern.findall(text or ""):
        if phase == "shrink":
            continue
        counts["passing"] += int(passing)
        counts["failing"] += int(failing)
        counts["invalid"] += int(invalid)
    return counts


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


def memory_growth(curves: dict[str, list[dict]], warmup: int) -> dict:
    """Growth of every measured quantity on the loaded and unloaded curves."""
    out = {}
    for phase, points in curves.items():
        for key in ("device_used", "torch_allocated", "torch_reserved", "host_rss"):
            out[f"{phase}.{key}"] = growth([p[key] for p in points], warmup)
    return out


def criteria(record: dict, host_limit_bytes: int) -> dict[str, bool]:
    """Each pass criterion, by name (see the module docstring for why each is what it is)."""
    cycles_ok = record.get("cycles_completed") == record.get("cycles") and not record.get("cycle_error")
    dev = record.get("device_mem_growth_bytes")
    host = record.get("host_rss_growth_bytes")
    cpu = record.get("cpu_suite") or {}
    out = {
        "soak_mismatches == 0": record.get("soak_mismatches") == 0 and bool(record.get("soak_replays")),
        "native_logit_mismatches == 0": record.get("native_logit_mismatches") == 0,
        "all cycles completed": bool(cycles_ok),
        "cycle_mismatches == 0": record.get("cycle_mismatches") == 0,
        "device_mem_growth_bytes == 0": dev == 0,
        "host_rss_growth_bytes < limit": host is not None and host < host_limit_bytes,
    }
    if cpu.get("exit_status") is not None:  # the CPU suite ran (not skipped with --no-cpu-suite)
        out["tamper_refused == tamper_cases"] = bool(record.get("tamper_cases")) and record.get(
            "tamper_refused"
        ) == record.get("tamper_cases")
        out["kill_loadable_partial == 0"] = (
            bool(record.get("kill_points")) and record.get("kill_loadable_partial") == 0
        )
        out["cpu suite passed"] = cpu.get("exit_status") == 0
    return out


def assemble(
    *,
    args_command: str,
    commit: str,
    save: dict | None,
    load: dict | None,
    cpu: dict | None,
    cycles: int,
    warmup: int,
    host_limit_bytes: int,
    errors: list[str],
    date: str | None = None,
) -> dict:
    """The reliability record (benchmarks/results/reliability-h200.json) from the three processes' results."""
    save, load, cpu = save or {}, load or {}, cpu or {}
    curves = load.get("curves", {"loaded": [], "unloaded": []})
    grown = memory_growth(curves, warmup)
    counts = cpu.get("counts", {})
    record = {
        "date": date or datetime.date.today().isoformat(),
        "commit": commit,
        "machine": load.get("machine") or save.get("machine"),
        "command": args_command,
        "tamper_cases": counts.get("tamper_cases"),
        "tamper_refused": counts.get("tamper_refused"),
        "fuzz_cases": counts.get("fuzz_cases"),
        "kill_points": counts.get("kill_points"),
        "kill_loadable_partial": counts.get("kill_loadable_partial"),
        "soak_replays": load.get("soak", {}).get("soak_replays"),
        "soak_mismatches": load.get("soak", {}).get("soak_mismatches"),
        "cycles": cycles,
        "cycles_completed": load.get("cycles_completed"),
        "cycle_error": load.get("cycle_error"),
        "cycle_mismatches": load.get("cycle_mismatches"),
        "warmup_cycles": warmup,
        "device_mem_growth_bytes": grown.get("unloaded.device_used"),
        "host_rss_growth_bytes": grown.get("unloaded.host_rss"),
        "host_rss_growth_limit_bytes": host_limit_bytes,
        "memory_growth": grown,
        "memory_curves": curves,
        "native_logit_mismatches": save.get("native_logit_mismatches"),
        "soak": load.get("soak"),
        "soak_s": {"save_native": save.get("soak_s"), "load_restored": load.get("soak_s")},
        "restore_s": load.get("restore_s"),
        "load_s_per_cycle": load.get("load_s_per_cycle"),
        "save": {k: v for k, v in save.items() if k not in ("phase",)},
        "cpu_suite": cpu,
        "errors": errors,
    }
    record["criteria"] = criteria(record, host_limit_bytes)
    record["pass"] = all(record["criteria"].values()) and not errors
    return record


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


# ------------------------------------------------------------------------------- the CPU suite


class SuiteCounter:
    """A pytest plugin that counts what the reliability tests did while they ran.

    * tamper matrix: each ``test_tamper_matrix[<row>]`` case (every row expects a refusal; the test
      passes only if the refusal came, with the right type and message, before any GPU step);
    * manifest sweep: refusals seen by ``open_archive`` inside ``test_every_flipped_manifest_byte``
      (one pinned and one unpinned per flipped byte);
    * fuzzing: test cases Hypothesis executed (its own statistics on each item);
    * crash test: every ``kill_at`` call (one SIGKILLed SAVE each) and what the ``check_complete``
      that follows it found: a complete archive, no archive, an archive refused as damaged, or an
      archive that opened but was not exactly one SAVE's content (a loadable partial archive).
    """

    def __init__(self):
        self.outcomes: dict[str, str] = {}
        self.fuzz: dict[str, dict] = {}
        self.kills: list[str] = []
        self.after_kill: dict[str, int] = {"complete": 0, "absent": 0, "refused": 0, "loadable_partial": 0}
        self.sweep = {"refused_pinned": 0, "refused_unpinned": 0}
        self._pending_kill = False

    def pytest_runtest_logreport(self, report):
        """One outcome per test: failed if any phase failed, else skipped if skipped, else passed."""
        previous = self.outcomes.get(report.nodeid)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped and previous != "failed":
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call" and previous is None:
            self.outcomes[report.nodeid] = "passed"

    def note_statistics(self, item, when: str) -> None:
        text = getattr(item, "hypothesis_statistics", None)
        if when == "call" and text:
            self.fuzz[item.nodeid] = parse_hypothesis_statistics(text)

    def _wrap_crash(self, module):
        import foundry_core.archive as archive

        kill_at, check_complete = module.kill_at, module.check_complete

        def counted_kill_at(*a, **k):
            phase, ev = kill_at(*a, **k)
            self.kills.append(phase)
            self._pending_kill = True
            return phase, ev

        def counted_check_complete(*a, **k):
            pending, self._pending_kill = self._pending_kill, False
            try:
                got = check_complete(*a, **k)
            except archive.ArchiveNotFound:
                self.after_kill["absent"] += pending
                raise
            except archive.ArchiveError:
                self.after_kill["refused"] += pending
                raise
            except AssertionError:
                self.after_kill["loadable_partial"] += pending
                raise
            self.after_kill["complete"] += pending
            return got

        module.kill_at, module.check_complete = counted_kill_at, counted_check_complete
        return lambda: (
            setattr(module, "kill_at", kill_at),
            setattr(module, "check_complete", check_complete),
        )

    def _wrap_sweep(self, module):
        import foundry_core.archive as archive

        open_archive = module.open_archive

        def counted(*a, **k):
            try:
                return open_archive(*a, **k)
            except archive.ArchiveError:
                self.sweep["refused_pinned" if k.get("expected_digest") else "refused_unpinned"] += 1
                raise

        module.open_archive = counted
        return lambda: setattr(module, "open_archive", open_archive)

    def counts(self) -> dict:
        def of(file: str, name: str | None = None) -> list[str]:
            # Node ids are relative to pytest's rootdir ("tests/test_x.py::test_y[row]"): match the file by name.
            return [
                o
                for nid, o in self.outcomes.items()
                if nid.split("::", 1)[0].rsplit("/", 1)[-1] == file
                and (name is None or nid.split("::")[-1].split("[")[0] == name)
            ]

        rows = of(TAMPER_FILE, MATRIX_TEST)
        fuzz_total = sum(c["passing"] for c in self.fuzz.values()) if self.fuzz else None
        kill_test = of(CRASH_FILE, KILL_TEST)
        return {
            "tamper_cases": len(rows),
            "tamper_refused": rows.count("passed"),
            "tamper_file_tests": len(of(TAMPER_FILE)),
            "tamper_file_passed": of(TAMPER_FILE).count("passed"),
            "manifest_flips_refused_pinned": self.sweep["refused_pinned"],
            "manifest_flips_refused_unpinned": self.sweep["refused_unpinned"],
            "fuzz_cases": fuzz_total,
            "fuzz_invalid_cases": sum(c["invalid"] for c in self.fuzz.values()) if self.fuzz else None,
            "fuzz_failing_cases": sum(c["failing"] for c in self.fuzz.values()) if self.fuzz else None,
            "fuzz_tests": {nid.split("::")[-1]: c["passing"] for nid, c in sorted(self.fuzz.items())},
            "fuzz_file_tests": len(of(FUZZ_FILE)),
            "fuzz_file_passed": of(FUZZ_FILE).count("passed"),
            "kill_points": len(self.kills),
            "kill_phases": {p: self.kills.count(p) for p in sorted(set(self.kills))},
            "kill_outcomes": dict(self.after_kill),
            "kill_loadable_partial": self.after_kill["loadable_partial"],
            "kill_test": kill_test[0] if kill_test else "not run",
            "crash_file_tests": len(of(CRASH_FILE)),
            "crash_file_passed": of(CRASH_FILE).count("passed"),
        }


def _make_plugin():
    import pytest

    class Plugin(SuiteCounter):
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            undo = None
            if item.name == KILL_TEST:
                undo = self._wrap_crash(item.module)
            elif item.name == SWEEP_TEST:
                undo = self._wrap_sweep(item.module)
            try:
                yield
            finally:
                if undo:
                    undo()

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            # A firstresult hook: run before pytest's own implementation and return None.
            self.note_statistics(item, call.when)

    return Plugin()


def run_cpu_suite(out_json: str, tests: str | Path) -> int:
    """Run the reliability tests in the folder ``tests`` here (in this process); write what they did to ``out_json``.

    ``tests`` is the repository's ``tests/`` folder, named by the caller: the installed package has
    no tests of its own. pytest runs from the folder above it (the checkout, whose pyproject.toml
    configures pytest), on the files of ``CPU_SUITE_FILES`` that are there.
    """
    import importlib.util

    import pytest

    started = datetime.datetime.now(datetime.timezone.utc)
    tests = Path(tests).resolve()
    root = tests.parent
    present = [f for f in CPU_SUITE_FILES if (tests / f).is_file()]
    notes = []
    if importlib.util.find_spec("hypothesis") is None:
        present = [f for f in present if f != FUZZ_FILE]
        notes.append("hypothesis is not installed here: the fuzz tests did not run, fuzz_cases is null")
    missing = [f for f in CPU_SUITE_FILES if not (tests / f).is_file()]
    if missing:
        notes.append(f"not found in {tests}: {', '.join(missing)}")
    files = [str((tests / f).relative_to(root)) for f in present]
    plugin = _make_plugin()
    t0 = time.perf_counter()
    status = 5  # pytest's "no tests were collected"
    if files:  # never a bare pytest.main([]): that would run whatever the folder's configuration names
        cwd = os.getcwd()
        os.chdir(root)
        try:
            status = int(pytest.main([*files, "-q", "-p", "no:cacheprovider"], plugins=[plugin]))
        finally:
            os.chdir(cwd)
    versions = {}
    for name in ("pytest", "hypothesis", "torch"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    result = {
        "where": f"{socket.gethostname()} ({platform.platform()}, Python {platform.python_version()}), "
        "no GPU visible (CUDA_VISIBLE_DEVICES='')",
        "started_utc": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "command": f"cd {root} && python -m pytest "
        + " ".join(files)
        + " -q  (with foundry_tools.soak's counting plugin)",
        "versions": versions,
        "exit_status": 0 if status == 0 and not missing else (status or 1),
        "outcomes": {
            o: list(plugin.outcomes.values()).count(o) for o in sorted(set(plugin.outcomes.values()))
        },
        "failed": sorted(n for n, o in plugin.outcomes.items() if o == "failed"),
        "counts": plugin.counts(),
        "notes": notes,
    }
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result["exit_status"]


# ------------------------------------------------------------------------------------ orchestration


def _worker_cmd(args, phase: str, archive: str, baseline: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "foundry_tools.soak",
        phase,
        "--archive",
        archive,
        "--baseline",
        baseline,
        "--replays",
        str(args.replays),
        "--cycles",
        str(args.cycles),
        *workload_argv(args),
    ]


def _run_worker(cmd: list[str], errors: list[str]) -> dict | None:
    print(f"foundry soak: {cmd[3]} process: {shlex.join(cmd[1:4])} ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            print(line)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        errors.append(f"the {cmd[3]} process failed (exit {proc.returncode}); its stderr is in the log")
        return None
    print(f"foundry soak: {cmd[3]} process done in {time.perf_counter() - t0:.1f} s", flush=True)
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def print_summary(r: dict) -> None:
    mib = 1 << 20

    def show(v):
        return "n/a" if v is None else v

    print("foundry soak:")
    print(f"  soak replays / mismatches      {show(r['soak_replays'])} / {show(r['soak_mismatches'])}")
    print(f"  native logit mismatches (SAVE) {show(r['native_logit_mismatches'])}")
    print(f"  cycles completed               {show(r['cycles_completed'])} / {r['cycles']}")
    if r.get("cycle_error"):
        print(f"  cycle error                    {r['cycle_error']}")
    print(f"  device growth (cuMemGetInfo)   {show(r['device_mem_growth_bytes'])} B")
    host = r["host_rss_growth_bytes"]
    print(f"  host RSS growth                {'n/a' if host is None else f'{host / mib:.1f} MiB'}")
    print(f"  tamper refused / cases         {show(r['tamper_refused'])} / {show(r['tamper_cases'])}")
    print(f"  fuzz cases                     {show(r['fuzz_cases'])}")
    print(f"  kill points / loadable partial {show(r['kill_points'])} / {show(r['kill_loadable_partial'])}")
    for name, ok in r["criteria"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for e in r["errors"]:
        print(f"  error: {e}")
    print("  result: " + ("PASS" if r["pass"] else "FAIL"))


def orchestrate(args, commit: str, command: str) -> tuple[dict, int]:
    """SAVE, then LOAD in a fresh process, with the CPU suite alongside; returns (record, exit status)."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="foundry-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    archive = str(Path(args.archive) if args.archive else workdir / "archive")
    baseline = str(workdir / "baseline.pt")
    errors: list[str] = []
    cpu_proc = None
    cpu_json = workdir / "cpu-suite.json"
    cpu_log = workdir / "cpu-suite.log"
    tests = getattr(args, "tests", None)
    skipped = None
    if args.no_cpu_suite:
        skipped = "not run (--no-cpu-suite)"
    elif tests is None:
        skipped = "not run (no --tests: the CPU suite's tests are in the repository, not in the package)"
        print(
            "foundry soak: CPU suite skipped: no --tests given. To run the tamper, fuzz and crash tests "
            "alongside, pass the repository's tests folder (from a checkout: foundry soak --tests tests ...), "
            "or run them on their own: python -m foundry_tools.soak cpu-suite --tests tests --json cpu-suite.json",
            flush=True,
        )
    else:
        tests_dir = Path(tests).resolve()
        if not tests_dir.is_dir():
            raise SystemExit(f"foundry soak: --tests {tests}: no such folder")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", FOUNDRY_NO_PROGRESS="1")
        # The CPU suite and the tests it runs import the very foundry_core and foundry_tools this process runs.
        import foundry_core

        here = {str(Path(f).resolve().parents[1]) for f in (foundry_core.__file__, __file__)}
        env["PYTHONPATH"] = os.pathsep.join([*sorted(here), *filter(None, [env.get("PYTHONPATH")])])
        with open(cpu_log, "w") as log:
            cpu_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "foundry_tools.soak",
                    "cpu-suite",
                    "--tests",
                    str(tests_dir),
                    "--json",
                    str(cpu_json),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(tests_dir.parent),
            )
        print(f"foundry soak: CPU suite started alongside (pid {cpu_proc.pid}, log {cpu_log})", flush=True)
    save = _run_worker(_worker_cmd(args, "save", archive, baseline), errors)
    load = _run_worker(_worker_cmd(args, "load", archive, baseline), errors) if save else None
    cpu = None
    if cpu_proc is not None:
        rc = cpu_proc.wait()
        tail = cpu_log.read_text().splitlines()[-15:]
        print("foundry soak: CPU suite: " + (tail[-1] if tail else "(no output)"), flush=True)
        if cpu_json.exists():
            cpu = json.loads(cpu_json.read_text())
        else:
            errors.append(f"the CPU suite wrote no result (exit {rc}); see {cpu_log}")
        if rc != 0:
            print("\n".join(tail))
    else:
        cpu = {"exit_status": None, "notes": [skipped], "counts": {}}
    record = assemble(
        args_command=command,
        commit=commit,
        save=save,
        load=load,
        cpu=cpu,
        cycles=args.cycles,
        warmup=args.warmup_cycles,
        host_limit_bytes=args.host_growth_limit_mib << 20,
        errors=errors,
    )
    record["preset"], record["variant"] = args.preset, args.variant
    record["batch_sizes"] = list(args.batch_sizes)
    return record, 0 if record["pass"] else 1


def main(argv=None) -> int:
    """Workers: ``save`` / ``load`` (one GPU phase each) and ``cpu-suite``."""
    p = argparse.ArgumentParser(prog="python -m foundry_tools.soak")
    sub = p.add_subparsers(dest="phase", required=True)
    for phase in ("save", "load"):
        w = sub.add_parser(phase, formatter_class=HelpFormatter)
        add_arguments(w)
        w.add_argument(
            "--baseline", required=True, help="the SAVE's soak baseline (written by save, read by load)"
        )
        w.add_argument(
            "--replays", type=int, default=DEFAULT_REPLAYS, help="soak replays in all (round robin)"
        )
        w.add_argument(
            "--cycles", type=int, default=DEFAULT_CYCLES, help="LOAD: load/unload cycles after the soak"
        )
    c = sub.add_parser(
        "cpu-suite",
        help="the tamper, fuzz and crash tests of a repository's tests/ folder, counted",
        formatter_class=HelpFormatter,
    )
    c.add_argument("--tests", required=True, metavar="DIR", help="the repository's tests/ folder")
    c.add_argument("--json", required=True, help="write what ran, counted, here")
    args = p.parse_args(argv)
    if args.phase == "cpu-suite":
        return run_cpu_suite(args.json, args.tests)
    if args.archive is None:
        p.error("--archive is required")
    result = run_save(args) if args.phase == "save" else run_load(args)
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FOUNDRY_NO_PROGRESS", "1")
    sys.exit(main())
