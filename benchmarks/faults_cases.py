"""The fault cases that start servers around an archive directory (kill_during_save, disk_full,
read_only_dir, two_replicas, archive_replaced, damaged_cache) and one case's folder, servers and
record; sustained_load is in faults_sustained."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from faults_archive import RANK, archive_state, flip_byte, quick_state, rlimit_threshold, stage_archive
from faults_catalog import SRC
from faults_context import Ctx
from faults_filesystem import clean_dir, read_only_mounts, run_command, writable
from faults_log import ENGINE_PATTERNS
from faults_server import Server, write_toml
from faults_verdicts import refused_cleanly, requests_equal, restart_ok


class CaseRun:
    """One case's folder, servers and record."""

    def __init__(self, ctx: Ctx, name: str):
        self.ctx, self.name = ctx, name
        self.dir = ctx.workdir / "cases" / name
        clean_dir(self.dir)
        self.dir.mkdir(parents=True)
        self.rec: dict[str, Any] = {"name": name, "checks": {}, "details": {}, "servers": {}}
        self.servers: list[Server] = []

    def server(self, label: str, **kwargs: Any) -> Server:
        s = Server(self.ctx, self.name, label, **kwargs)
        self.servers.append(s)
        self.rec["servers"][label] = s.rec
        return s

    def close(self) -> None:
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()


def _serve_and_check(srv: Server, ref: dict[str, Any] | None, deadline: float) -> bool:
    if not srv.wait_ready(deadline):
        return False
    srv.check(ref)
    return True


def _auto_beside_save(ctx: Ctx, auto: Server, save: Server, expected: str) -> tuple[bool, str]:
    """Start an ``auto`` and a ``save`` server at once (the KV caches are pinned, so both fit):
    whether ``auto`` served the reference outputs, and how the ``save`` start ended
    (``expected``: the outcome its case wants, as ``wait_exit_or_ready`` names it)."""

    def auto_job() -> bool:
        auto.start()
        ok = _serve_and_check(auto, ctx.reference, ctx.deadline())
        auto.stop()
        return ok

    def save_job() -> str:
        save.start()
        outcome = save.wait_exit_or_ready(ctx.deadline(), expected)
        save.stop()
        return outcome

    served, outcome = _together(auto_job, save_job)
    return served, outcome


def _together(*jobs: Callable[[], Any]) -> list[Any]:
    """Run the jobs on threads and return their results once all have ended; the first exception a
    job raised is raised then."""
    results: list[Any] = [None] * len(jobs)

    def one(i: int, job: Callable[[], Any]) -> None:
        try:
            results[i] = job()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def reach_point(srv: Server, point: str, deadline: float, kill_delay: float) -> dict[str, Any]:
    """Wait until ``point`` of srv's SAVE and SIGKILL it there; the record says how it was seen. The
    point is looked for before whether the server ended or became ready (both can come within
    milliseconds of a record written last)."""
    engine = srv.ctx.engine
    pats = ENGINE_PATTERNS[engine]
    begin = srv.pump.watch(pats["capture_begin"])
    ready = srv.pump.watch(pats["ready"])
    before = quick_state(srv.archive_dir, engine)
    out: dict[str, Any] = {"point": point, "reached": False}
    while time.monotonic() < deadline:
        ended = srv.proc.poll() is not None
        if begin.is_set() and point == "capture":
            time.sleep(kill_delay)
            out.update(reached=True, how=f"capture line: {begin.line[-200:]}", t_s=srv.kill9())
            return out
        if begin.is_set():
            now = quick_state(srv.archive_dir, engine)
            fresh = [s for s in now["scratch"] if s not in before["scratch"]]
            published = now["link"] is not None and now["link"] != before["link"]
            if point == "persisting" and fresh:
                out.update(reached=True, how=f"graph archive scratch directory {fresh[0]} present")
            elif point == "published" and published and not now["record"]:
                out.update(reached=True, how=f"graph archive published ({now['link']}), no record yet")
            elif point == "complete" and now["record"]:
                out.update(reached=True, how="record written")
            elif point in ("persisting", "published") and (
                now["record"] or (point == "persisting" and published)
            ):
                out.update(why="the SAVE got past this point between two looks", late=True)
            if out["reached"] or out.get("late"):
                out["t_s"] = srv.kill9()
                return out
        if ended:
            out["why"] = f"server exited with status {srv.proc.returncode} first"
            return out
        if ready.is_set():
            out["why"] = "server became ready first"
            return out
        time.sleep(0.005 if begin.is_set() else 0.05)
    out["why"] = "timed out before the point"
    return out


def case_kill_during_save(ctx: Ctx, run: CaseRun) -> None:
    archive = run.dir / "archive"
    toml = run.dir / "foundry.toml"
    kills: list[dict[str, Any]] = []
    final: Server | None = None
    for i, point in enumerate(ctx.opts.kill_points):
        srv = run.server(f"target{i}-{point}", mode="auto", archive_dir=archive, toml=toml).start()
        hit = reach_point(srv, point, ctx.deadline(), ctx.opts.kill_delay)
        if not hit["reached"] and not hit.get("late"):
            kills.append({**hit, "server": srv.label})
            final = srv if "ready" in hit.get("why", "") else None
            break
        srv.stop()
        ctx.gpu_settle()
        hit["state_after"] = archive_state(archive, ctx.engine)
        hit["server"] = srv.label
        kills.append(hit)
    if final is None and (not kills or kills[-1].get("t_s") is not None):
        final = run.server("restart", mode="auto", archive_dir=archive, toml=toml).start()
    served = False
    if final is not None:
        served = _serve_and_check(final, ctx.reference, ctx.deadline())
        final.stop()
    # Each kill's restart: the next target, or the final server.
    order = [s for s in run.servers]
    for k in kills:
        idx = next((j for j, s in enumerate(order) if s.label == k["server"]), None)
        nxt = order[idx + 1] if idx is not None and idx + 1 < len(order) else None
        k["restart"] = nxt.label if nxt else None
        k["restart_mode"] = nxt.rec.get("mode_logged") if nxt else None
        k["restart_ok"] = restart_ok(k, k["restart_mode"]) if k.get("t_s") is not None else None
    state = archive_state(archive, ctx.engine)
    run.rec["details"].update(kills=kills, state_after_restart=state)
    checks = run.rec["checks"]
    for k in kills:
        # A kill that landed past its point (the SAVE outran the 5 ms polling) is no fault of Foundry's.
        checks[f"kill_{k['point']}_reached"] = (
            True if k.get("reached") else (None if k.get("late") else False)
        )
        checks[f"restart_after_{k['point']}_saves_or_loads_only_complete"] = k.get("restart_ok")
        if k.get("state_after"):
            checks[f"no_loadable_partial_after_{k['point']}"] = not k["state_after"].get("loadable_partial")
    checks["restart_served"] = served
    checks["restart_outputs_equal_reference"] = requests_equal(final.rec) if final else None
    checks["archive_complete_and_consistent_after_restart"] = bool(state.get("consistent"))
    merge_earlier_kills(run.rec, ctx.earlier_cases.get("kill_during_save"))


def merge_earlier_kills(rec: dict[str, Any], earlier: dict[str, Any] | None) -> None:
    """--resume with other kill points: keep the earlier call's kills at points this call did not
    run, with their checks, so that one call per point covers the chain where one call cannot hold
    it (SGLang's SAVE starts take 110-175 s). A check both calls made is false if either was false."""
    if not earlier or earlier.get("verdict") not in ("pass", "fail", "inconclusive"):
        return
    details = rec["details"]
    now = [k.get("point") for k in details.get("kills", []) if k.get("point") is not None]
    kept = [k for k in (earlier.get("details") or {}).get("kills", []) if k.get("point") not in now]
    if not kept:
        return
    details["kills"] = [{**k, "call": "earlier"} for k in kept] + details.get("kills", [])
    labels = {k.get("server") for k in kept}
    for label, server in (earlier.get("servers") or {}).items():
        if label in labels:
            rec["servers"][f"earlier-{label}"] = server
    details["kill_points_by_call"] = {
        "earlier": [k.get("point") for k in kept],
        "last": now,
    }
    checks = rec["checks"]
    for key, value in (earlier.get("checks") or {}).items():
        if key not in checks:
            checks[key] = value
        elif value is False or (value is None and checks[key] is True):
            checks[key] = value


def _disk_full_dirs(ctx: Ctx, run: CaseRun) -> dict[str, Any]:
    """Two size-limited archive directories (auto, save) and how they are limited."""
    size = ctx.opts.disk_full_size
    graph_bytes = ((ctx.base_state or {}).get("graph") or {}).get("bytes")
    if graph_bytes:  # never larger than half the archive a SAVE writes, so it cannot fit
        size = str(min(parse_size(size), max(64 << 10, graph_bytes // 2)))
    dirs = {label: run.dir / label / "archive" for label in ("auto", "save")}
    how: dict[str, Any] = {"method": None, "dirs": {k: str(d) for k, d in dirs.items()}, "mount": {}}
    for d in dirs.values():
        d.mkdir(parents=True)
    for label, d in dirs.items():
        ok, detail = ctx.mount(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "faults-disk-full", str(d)], d
        )
        how["mount"][label] = detail or "ok"
        if not ok:  # both or neither: undo the one that worked
            for m in [m for m in list(ctx.mounts) if m in dirs.values()]:
                ctx.umount(m)
            break
    else:
        how.update(method="tmpfs", size=size)
        return how
    limit, why = rlimit_threshold(
        ctx.sizes.get("archive_max_member"), ctx.sizes.get("other_max_file", {}).get("bytes")
    )
    how.update(method="rlimit" if limit else None, rlimit=limit, rlimit_why=why)
    return how


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def case_disk_full(ctx: Ctx, run: CaseRun) -> None:
    how = _disk_full_dirs(ctx, run)
    run.rec["details"]["limit"] = how
    if how["method"] is None:
        run.rec["verdict_override"] = "skipped"
        run.rec["reason"] = f"no way to fill a disk here: {how.get('rlimit_why')}"
        return
    pre = how["rlimit"] if how["method"] == "rlimit" else None
    auto = run.server(
        "auto",
        mode="auto",
        archive_dir=Path(how["dirs"]["auto"]),
        toml=run.dir / "auto.toml",
        fsize_limit=pre,
    )
    save = run.server(
        "save",
        mode="save",
        archive_dir=Path(how["dirs"]["save"]),
        toml=run.dir / "save.toml",
        fsize_limit=pre,
    )

    served, outcome = _auto_beside_save(ctx, auto, save, "no_space")
    sa, ss = (archive_state(Path(how["dirs"][k]), ctx.engine) for k in ("auto", "save"))
    run.rec["details"].update(save_outcome=outcome, state_auto=sa, state_save=ss)
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    checks = run.rec["checks"]
    checks.update(
        auto_saved_then_failed=auto.rec.get("mode_logged") == "save" and "save_failed" in lines,
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
        auto_left_no_archive=not sa.get("any_archive"),
    )
    refusal = refused_cleanly(save.rec, "no_space")
    checks.update({f"save_{k}": v for k, v in refusal.items()})
    checks["save_left_no_archive"] = not ss.get("any_archive")
    run.rec["details"]["save_tracebacks"] = (
        (save.rec.get("facts") or {}).get("counts", {}).get("traceback", 0)
    )


def _read_only_dir(ctx: Ctx, path: Path) -> tuple[Path | None, str, list[str]]:
    """A directory nobody here can write into, and how it was made so."""
    notes: list[str] = []
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o555)
    if not writable(path):
        return path, "chmod 0555", notes
    notes.append("chmod 0555 changes nothing for root (it ignores permission bits)")
    os.chmod(path, 0o755)
    ok, detail = ctx.mount(["mount", "--bind", str(path), str(path)], path)
    if ok:
        ok, detail = run_command(["mount", "-o", "remount,bind,ro", str(path)])
        if ok and not writable(path):
            return path, "read-only bind mount", notes
        notes.append(f"read-only remount failed: {detail}")
        ctx.umount(path)
    else:
        notes.append(f"bind mount not possible: {detail}")
    for m in read_only_mounts():
        if m.is_dir() and not writable(m):
            return m, f"existing read-only mount {m}", notes
    proc = Path("/proc/foundry-faults-archive")
    if not writable(proc):
        return proc, "a path under /proc (cannot be created)", notes
    return None, "none found", notes


def case_read_only_dir(ctx: Ctx, run: CaseRun) -> None:
    dirs: dict[str, Any] = {}
    for label in ("auto", "save"):
        d, method, notes = _read_only_dir(ctx, run.dir / label / "archive")
        dirs[label] = {"dir": str(d) if d else None, "method": method, "notes": notes}
    run.rec["details"]["dirs"] = dirs
    if not all(v["dir"] for v in dirs.values()):
        run.rec["verdict_override"] = "skipped"
        run.rec["reason"] = "no read-only location found"
        return
    auto = run.server("auto", mode="auto", archive_dir=Path(dirs["auto"]["dir"]), toml=run.dir / "auto.toml")
    save = run.server("save", mode="save", archive_dir=Path(dirs["save"]["dir"]), toml=run.dir / "save.toml")

    served, outcome = _auto_beside_save(ctx, auto, save, "save_refused")
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    checks = run.rec["checks"]
    checks.update(
        auto_warned=any(k in lines for k in ("not_writable", "save_failed")),
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
    )
    checks.update({f"save_{k}": v for k, v in refused_cleanly(save.rec, "save_refused").items()})
    for label in ("auto", "save"):
        path = Path(dirs[label]["dir"])
        if dirs[label]["method"] in ("chmod 0555", "read-only bind mount"):
            checks[f"{label}_wrote_nothing"] = not any(path.iterdir()) if path.is_dir() else True
    run.rec["details"].update(
        save_outcome=outcome,
        save_refusal_s=save.rec.get("exited_s"),
        auto_mode=auto.rec.get("mode_logged"),
        save_tracebacks=(save.rec.get("facts") or {}).get("counts", {}).get("traceback", 0),
    )


def _published(srv: Server) -> bool | None:
    """Whether this server's SAVE finished (its record written): its report says saved."""
    report = srv.rec.get("report") or {}
    if "saved" in report:
        return report["saved"] is True
    lines = (srv.rec.get("facts") or {}).get("lines") or {}
    if srv.ctx.engine == "sglang" and "published" in lines:
        return True
    return None if srv.rec.get("mode_logged") == "save" else False


def cli_verify(path: Path) -> dict[str, Any]:
    """``python -m foundry_core.cli verify``: integrity and this machine's fingerprint (GPU)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "foundry_core.cli", "verify", str(path)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    except (OSError, subprocess.SubprocessError) as e:
        return {"ok": None, "error": str(e)}
    return {
        "ok": done.returncode == 0,
        "rc": done.returncode,
        "output": (done.stdout + done.stderr).strip()[-800:],
    }


def case_two_replicas(ctx: Ctx, run: CaseRun) -> None:
    archive = run.dir / "archive"
    archive.mkdir()
    toml = run.dir / "foundry.toml"
    write_toml(toml, archive, "auto", ctx.opts.region_size)
    a = run.server("replica-a", mode="auto", archive_dir=archive, toml=toml)
    b = run.server("replica-b", mode="auto", archive_dir=archive, toml=toml)
    a.start(write=False)
    b.start(write=False)
    run.rec["details"]["spawn_skew_s"] = round(b.t0 - a.t0, 3)
    deadline = ctx.deadline()
    ready = _together(lambda: a.wait_ready(deadline), lambda: b.wait_ready(deadline))
    for srv, ok in zip((a, b), ready):
        if ok:
            srv.check(ctx.reference)
    a.stop()
    b.stop()
    ctx.gpu_settle()
    state = archive_state(archive, ctx.engine)
    verify = cli_verify(archive / f"rank{RANK}") if state["graph"].get("present") else {"ok": False}
    published = {s.label: _published(s) for s in (a, b)}
    timeline = {}
    for s in (a, b):
        lines = (s.rec.get("facts") or {}).get("lines") or {}
        timeline[s.label] = {
            k: round(lines[k]["t_s"] + s.rec["spawn_offset_s"], 3)
            for k in ("published", "caches_saved", "save_failed", "lock_held")
            if k in lines
        }
    run.rec["details"].update(state=state, cli_verify=verify, published=published, timeline_s=timeline)
    checks = run.rec["checks"]
    checks.update(
        both_ready=all(ready),
        both_outputs_equal_reference=all(requests_equal(s.rec) for s in (a, b)) if all(ready) else False,
        exactly_one_published=sum(1 for v in published.values() if v) == 1
        if None not in published.values()
        else None,
        archive_consistent=bool(state.get("consistent")),
        cli_verify_ok=verify.get("ok"),
    )


def stage_base(ctx: Ctx, run: CaseRun) -> Path:
    """Put a fresh copy of the base archive back at the base's own path (see Ctx.base_cache_root)."""
    stage_archive(ctx.pristine, ctx.base_dir)
    run.rec["details"]["archive_dir"] = str(ctx.base_dir)
    return ctx.base_dir


def start_staged(run: CaseRun, archive: Path, label: str, mode: str) -> Server:
    """A server on the staged base archive, started in ``mode``. Its settings go into the base's
    own TOML path (the path is part of vLLM's fingerprint), rewritten for this start."""
    ctx = run.ctx
    srv = run.server(
        label, mode=mode, archive_dir=ctx.base_dir, toml=ctx.base_toml, cache_root=ctx.base_cache_root
    )
    write_toml(ctx.base_toml, archive, mode, ctx.opts.region_size)
    srv.start(write=False)
    return srv


def case_archive_replaced(ctx: Ctx, run: CaseRun) -> None:
    archive = stage_base(ctx, run)
    before = archive_state(archive, ctx.engine)
    load = start_staged(run, archive, "load", "auto")
    checks = run.rec["checks"]
    if not load.wait_ready(ctx.deadline()):
        checks["load_served"] = False
        return
    load.check(ctx.reference, "before the new SAVE")
    save = start_staged(run, archive, "save", "save")
    deadline = ctx.deadline()
    probes = 0
    save_ready = save.pump.watch(ENGINE_PATTERNS[ctx.engine]["ready"])
    while time.monotonic() < deadline and save.alive() and not save_ready.event.wait(5.0):
        load.check(ctx.reference, f"while the new SAVE starts ({save.elapsed():.0f} s)")
        probes += 1
    saved = save.wait_ready(deadline)
    if saved:
        save.check(ctx.reference)
    load.check(ctx.reference, "after the new archive was published")
    save.stop()
    after = archive_state(archive, ctx.engine)
    nxt = start_staged(run, archive, "next", "auto")
    if nxt.wait_ready(ctx.deadline()):
        nxt.check(ctx.reference)
        ctx.times["load"] = nxt.rec["ready_s"]
    load.check(ctx.reference, "after the next start")
    nxt.stop()
    load.stop()
    digest = lambda s, k: (s.get(k) or {}).get("digest")  # noqa: E731
    next_caches = ((nxt.rec.get("report") or {}).get("caches") or {}).get("digest")
    run.rec["details"].update(
        probes_while_saving=probes, state_before=before, state_after=after, next_caches_digest=next_caches
    )
    checks.update(
        load_loaded=load.rec.get("mode_logged") == "load",
        load_outputs_equal_reference_throughout=requests_equal(load.rec),
        save_served=saved,
        save_published=_published(save),
        graph_digest_changed=None
        if not after["graph"].get("ok")
        else digest(after, "graph") != digest(before, "graph"),
        next_loaded=nxt.rec.get("mode_logged") == "load",
        next_outputs_equal_reference=requests_equal(nxt.rec),
        next_report_caches_digest_is_the_new_one=None
        if next_caches is None
        else next_caches == digest(after, "caches") and next_caches != digest(before, "caches"),
    )


def case_damaged_cache(ctx: Ctx, run: CaseRun) -> None:
    archive = stage_base(ctx, run)
    run.rec["details"]["flipped"] = flip_byte(archive / f"rank{RANK}.caches")
    run.rec["details"]["state"] = archive_state(archive, ctx.engine)
    auto = start_staged(run, archive, "auto", "auto")
    served = _serve_and_check(auto, ctx.reference, ctx.deadline())
    auto.stop()
    ctx.gpu_settle()
    load = start_staged(run, archive, "load", "load")
    outcome = load.wait_exit_or_ready(ctx.deadline(), "caches_refused_load")
    load.stop()
    lines = (auto.rec.get("facts") or {}).get("lines") or {}
    reason = (lines.get("caches_refused_auto") or {}).get("reason") or ""
    report_caches = (auto.rec.get("report") or {}).get("caches") or {}
    compiled = (report_caches.get("new_files") or {}).get("total")
    run.rec["details"].update(
        load_outcome=outcome,
        auto_refusal_reason=reason,
        auto_compiled_files=compiled,
        load_tracebacks=(load.rec.get("facts") or {}).get("counts", {}).get("traceback", 0),
    )
    checks = run.rec["checks"]
    checks.update(
        auto_warned_naming_the_damage="sha256" in reason or "damaged" in reason,
        auto_loaded_graphs=auto.rec.get("mode_logged") == "load",
        auto_served=served,
        auto_outputs_equal_reference=requests_equal(auto.rec),
        auto_compiled_as_usual=None if compiled is None else compiled > 0,
    )
    checks.update({f"load_{k}": v for k, v in refused_cleanly(load.rec, "caches_refused_load").items()})
