"""sustained_load: the request schedule (load generation), one pass of it against a server, the
server's device memory, and the case itself (a LOAD under load beside a stock server)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import engine_run as cs
from faults_answers import (
    answer_digest,
    compare_outputs,
    compare_passes,
    compare_with_stock,
    sustained_output_checks,
)
from faults_cases import CaseRun, stage_base, start_staged
from faults_context import MARGIN_S, Ctx
from faults_server import Server

SUSTAIN_SIZES = (1, 3, 8, 16, 32, 64)


def sustained_requests(max_bs: int) -> list[list[list[int]]]:
    """sustained_load's schedule: one request per batch size, each prompt different in ids and length."""
    sizes = [k for k in SUSTAIN_SIZES if k <= max(max_bs or 512, 1)]
    words, first = cs.TOKENIZER_WORDS, len(cs.TOKENIZER_SPECIALS)
    return [
        [[first + (53 * i + 7 * j + 13 * k) % words for j in range(4 + (7 * i + k) % 24)] for i in range(k)]
        for k in sizes
    ]


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry))
    return pids


def gpu_memory_of(pgid: int) -> dict[str, Any]:
    """Device memory (MiB) used by a server's processes where nvidia-smi names them, and the device's."""
    pids = set(_group_pids(pgid))
    mine = None
    rows = cs._nvidia_smi("compute-apps=pid,used_memory")
    with contextlib.suppress(ValueError):
        used = [int(r.split(",")[1]) for r in rows if int(r.split(",")[0]) in pids]
        mine = sum(used) if used else None
    return {"server_mib": mine, "device_mib": cs.gpu_memory_used_mib()}


def run_schedule(srv: Server, requests: list[list[list[int]]]) -> list[dict[str, Any]]:
    """One pass of the sustained schedule; each entry the request's outputs or its error."""
    out = []
    for prompts in requests:
        try:
            out.append(srv.complete(prompts))
        except (RuntimeError, OSError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def memory_growth(samples: list[dict[str, Any]], key: str) -> float | None:
    """Largest rise over the first sample taken after the first pass (None without two samples)."""
    values = [s[key] for s in samples if isinstance(s.get(key), int | float)]
    return None if len(values) < 2 else float(max(values) - values[0])


def _stock_answers(ctx: Ctx, stock: Server, requests: list[list[list[int]]], into: dict[str, Any]) -> None:
    """The stock server's answers to two passes of the schedule (``into["passes"]``), then its stop."""
    try:
        if stock.wait_ready(ctx.deadline()):
            into["passes"] = [run_schedule(stock, requests) for _ in range(2)]
    finally:
        stock.stop()


def case_sustained_load(ctx: Ctx, run: CaseRun) -> None:
    archive = stage_base(ctx, run)
    srv = start_staged(run, archive, "load", "auto")
    requests = sustained_requests(ctx.opts.max_bs)
    # A stock server (no --enable-foundry) starts beside it and answers two passes of the same
    # schedule while the load runs: the LOAD's answers are compared with stock's, not only with the
    # base SAVE's (itself a Foundry server).
    stock = run.server(
        "stock", mode="stock", archive_dir=run.dir / "stock", toml=run.dir / "stock.toml", stock=True
    ).start(write=False)
    stock_out: dict[str, Any] = {}
    asking = threading.Thread(target=_stock_answers, args=(ctx, stock, requests, stock_out), daemon=True)
    asking.start()
    checks = run.rec["checks"]
    if not srv.wait_ready(ctx.deadline()):
        checks["served"] = False
        return
    refs = ctx.sustained_reference
    load_first: list[list[dict[str, Any]]] = []  # the LOAD's answers of its first two passes
    # Without a base reference, stock's passes are the reference, and they come late (stock may be
    # ready long after the LOAD): every LOAD pass is kept as one digest per answer, made on another
    # thread so that the request loop's timing stays as it is.
    digests: list[concurrent.futures.Future] = []
    duration = max(0.0, min(ctx.opts.sustain, ctx.left() - MARGIN_S - 15))
    t_end = time.monotonic() + duration
    samples: list[dict[str, Any]] = []
    passes = mismatches = errors = tokens = 0
    first_mismatch = None
    next_sample = 0.0
    t0 = time.monotonic()

    def sample() -> None:
        samples.append(
            {"t_s": round(time.monotonic() - t0, 1), "pass": passes, **gpu_memory_of(srv.proc.pid)}
        )

    with concurrent.futures.ThreadPoolExecutor(1) as digesting:
        # At least two passes, however short --sustain: stock's two passes are compared with the
        # LOAD's first two.
        while (passes < 2 or time.monotonic() < t_end) and srv.alive():
            got = run_schedule(srv, requests)
            if len(load_first) < 2:
                load_first.append(got)
            if not refs:
                digests.append(digesting.submit(lambda got=got: [answer_digest(g) for g in got]))
            want = refs[min(passes, len(refs) - 1)] if refs else None
            for i, g in enumerate(got):
                if "error" in g:
                    errors += 1
                    continue
                tokens += sum(len(t) for t in g["tokens"])
                cmp = compare_outputs(g, want[i] if want else None)
                if cmp["equal"] is False:
                    mismatches += 1
                    first_mismatch = first_mismatch or {"pass": passes, "request": i, **cmp}
            passes += 1
            if passes == 1 or time.monotonic() >= next_sample:
                sample()
                next_sample = time.monotonic() + ctx.opts.sample_every
        # The end state too, whatever the sampling interval: growth needs the last pass's memory
        # (a short run whose passes all fell inside one interval had only its first sample).
        if samples and samples[-1]["pass"] != passes and srv.alive():
            sample()
        wall = time.monotonic() - t0
    srv.stop()
    asking.join(max(0.0, ctx.deadline() - time.monotonic()))  # deadline() is on the monotonic clock
    stock.stop()  # also when it was not ready by the deadline
    stock_passes = stock_out.get("passes")
    vs_load = compare_passes(load_first, stock_passes)
    vs_reference = compare_passes(refs[:2] if refs else [], stock_passes)
    reference = "base SAVE server" if refs else None
    if not refs:
        vs_stock = compare_with_stock(load_first, [f.result() for f in digests], stock_passes)
        mismatches, first_mismatch = vs_stock["mismatches"], vs_stock["first_mismatch"]
        reference = "stock server" if stock_passes else None
    key = "server_mib" if any(s.get("server_mib") for s in samples) else "device_mib"
    growth = memory_growth(samples, key)
    run.rec["details"].update(
        seconds=round(wall, 1),
        passes=passes,
        requests=passes * len(requests),
        errors=errors,
        batch_sizes=[len(r) for r in requests],
        tokens=tokens,
        tokens_per_s=round(tokens / wall, 1) if wall else None,
        mismatches=mismatches,
        first_mismatch=first_mismatch,
        reference=reference,
        memory_samples=samples[:200],
        memory_key=key,
        memory_growth_mib=growth,
        stock={
            "ready_s": stock.rec.get("ready_s"),
            "passes": len(stock_passes or []),
            "vs_load": vs_load,
            "vs_reference": vs_reference,
        },
    )
    checks.update(
        loaded=srv.rec.get("mode_logged") == "load",
        no_request_errors=errors == 0,
        **sustained_output_checks(bool(refs), mismatches, bool(stock_passes), vs_load, vs_reference),
        memory_growth_under_256_mib=None if growth is None else growth <= 256,
    )
