"""Running the cases: the base SAVE that gives the reference, each case's estimate against the budget,
one case run to its verdict."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_run as cs
from faults_answers import compare_outputs
from faults_archive import archive_state, largest_file, stage_archive
from faults_cases import (
    CaseRun,
    case_archive_replaced,
    case_damaged_cache,
    case_disk_full,
    case_kill_during_save,
    case_read_only_dir,
    case_two_replicas,
)
from faults_catalog import STAGED
from faults_context import MARGIN_S, Ctx
from faults_filesystem import clean_dir
from faults_server import Server
from faults_sustained import case_sustained_load, run_schedule, sustained_requests
from faults_verdicts import verdict

CASE_FUNCS: dict[str, Callable[[Ctx, CaseRun], None]] = {
    "kill_during_save": case_kill_during_save,
    "disk_full": case_disk_full,
    "read_only_dir": case_read_only_dir,
    "two_replicas": case_two_replicas,
    "archive_replaced": case_archive_replaced,
    "damaged_cache": case_damaged_cache,
    "sustained_load": case_sustained_load,
}


def estimate_s(case: str, opts: argparse.Namespace, times: dict[str, float]) -> float:
    """Seconds a case needs, from the measured (or default) SAVE, LOAD and refusal times."""
    s, load, refuse = times["save"], times["load"], times["refuse"]
    return {
        "kill_during_save": s * (len(opts.kill_points) + 1),
        "disk_full": 1.2 * s,
        "read_only_dir": 1.2 * s,
        "two_replicas": 1.3 * s + 20,
        "archive_replaced": 2 * load + 1.2 * s,
        "damaged_cache": s + refuse,
        "sustained_load": load + opts.sustain + 10,
    }[case] + MARGIN_S


def skip_reason(case: str, ctx: Ctx, base_ok: bool) -> str | None:
    if not base_ok:
        return "skipped: the base SAVE did not give a reference and a complete archive"
    need = estimate_s(case, ctx.opts, ctx.times)
    left = ctx.left()
    if left < need:
        return f"skipped: needs about {need:.0f} s, {left:.0f} s of the budget left"
    return None


def run_case(ctx: Ctx, name: str, base_ok: bool, cases: dict[str, Any], flush: Callable[[], Any]) -> None:
    reason = skip_reason(name, ctx, base_ok)
    if reason:
        cases[name] = {"name": name, "verdict": "skipped", "reason": reason}
        flush()
        return
    t0 = time.monotonic()
    print(
        f"[engine_faults] {ctx.engine} {name}: starting ({ctx.left():.0f} s of the budget left)", flush=True
    )
    run = CaseRun(ctx, name)
    run.rec.update(
        started_s=round(t0 - ctx.started, 1), estimate_s=round(estimate_s(name, ctx.opts, ctx.times))
    )
    cases[name] = run.rec
    flush()  # a call killed from outside still shows which case was running
    lock = ctx.staged_lock if name in STAGED else contextlib.nullcontext()
    try:
        with lock:
            CASE_FUNCS[name](ctx, run)
    except BaseException as e:  # the case's record keeps what it got; the benchmark goes on
        run.rec["error"] = f"{type(e).__name__}: {e}"
        run.rec["traceback"] = traceback.format_exc()[-3000:]
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
    finally:
        run.close()
        for m in list(ctx.mounts):
            if str(m).startswith(str(run.dir)):
                ctx.umount(m)
        run.rec["seconds"] = round(time.monotonic() - t0, 1)
        override = run.rec.pop("verdict_override", None)
        run.rec["verdict"] = "error" if run.rec.get("error") else override or verdict(run.rec["checks"])
        failed = [k for k, v in run.rec["checks"].items() if v is not True]
        run.rec["not_passed_checks"] = failed
        print(
            f"[engine_faults] {name}: {run.rec['verdict']} in {run.rec['seconds']} s "
            f"{('(' + ', '.join(failed) + ')') if failed else ''} {run.rec.get('error') or ''}",
            flush=True,
        )
        flush()
        ctx.gpu_settle()


def run_base(ctx: Ctx) -> dict[str, Any]:
    """The reference: a SAVE in auto mode into an empty directory, its outputs and its archive."""
    clean_dir(ctx.workdir / "base")
    shutil.rmtree(ctx.base_cache_root, ignore_errors=True)
    ctx.base_dir.mkdir(parents=True)
    srv = Server(
        ctx,
        "base",
        "save",
        mode="auto",
        archive_dir=ctx.base_dir,
        toml=ctx.base_toml,
        cache_root=ctx.base_cache_root,
    )
    rec: dict[str, Any] = {"server": srv.rec}
    srv.start()
    try:
        if srv.wait_ready(ctx.deadline()):
            first = srv.complete()
            second = srv.complete()
            rec["outputs"] = first
            rec["self_consistent"] = compare_outputs(second, first)
            rec["outputs_differ_between_prompts"] = cs.outputs_differ(first)
            if "sustained_load" in ctx.opts.cases:
                requests = sustained_requests(ctx.opts.max_bs)
                ref = [run_schedule(srv, requests) for _ in range(2)]
                path = ctx.workdir / "base" / "sustained-reference.json"  # large: kept out of the result
                path.write_text(json.dumps(ref))
                rec["sustained_reference"] = {"path": str(path), "requests": len(requests), "passes": 2}
    except (RuntimeError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        srv.stop()
    ctx.gpu_settle()
    state = archive_state(ctx.base_dir, ctx.engine)
    rec["state"] = state
    stage_archive(ctx.base_dir, ctx.pristine)
    graph = state.get("graph") or {}
    other = largest_file([ctx.base_cache_root, ctx.home, ctx.tmp, *map(Path, _glob("/tmp/torchinductor_*"))])
    rec["sizes"] = {
        "archive_max_member": (graph.get("max_member") or {}).get("bytes"),
        "other_max_file": other,
    }
    rec["ok"] = bool(
        rec.get("outputs")
        and state.get("complete")
        and srv.rec.get("mode_logged") == "save"
        and (rec.get("self_consistent") or {}).get("equal")
    )
    return rec


def _glob(pattern: str) -> list[str]:
    import glob

    return sorted(glob.glob(pattern))


def adopt_base(ctx: Ctx, base: dict[str, Any]) -> None:
    ctx.reference = base.get("outputs")
    ref = base.get("sustained_reference") or {}
    with contextlib.suppress(OSError, ValueError, TypeError):
        ctx.sustained_reference = json.loads(Path(ref["path"]).read_text()) if ref.get("path") else None
    ctx.sizes = base.get("sizes") or {}
    ctx.base_state = base.get("state")
    ready = (base.get("server") or {}).get("ready_s")
    if isinstance(ready, int | float):
        ctx.times["save"] = float(ready) + 10.0
