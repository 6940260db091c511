"""One engine server as engine_faults starts it: its command line and TOML, its process group, its log,
its requests, its stop and what its log and start report say."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import engine_run as cs
from faults_answers import compare_outputs
from faults_archive import RANK, START_REPORT
from faults_log import ENGINE_PATTERNS, LOG_PATTERNS, Pump, excerpt, log_facts

if TYPE_CHECKING:
    from faults_context import Ctx

REFUSAL_GRACE_S = 60.0  # a start that printed its refusal has this long to end by itself
#: A stock server's additions to its environment: the Inductor defaults both plugins pin in the
#: engine's processes (foundry_core.engine.inductor.PINNED, spelled out; a test keeps them equal).
STOCK_ENV = {"TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK": "0"}


def set_arg(argv: list[str], flag: str, value: Any) -> list[str]:
    """``argv`` with ``flag``'s value replaced, or the pair added before the Foundry flags."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
        return argv
    at = argv.index("--enable-foundry") if "--enable-foundry" in argv else len(argv)
    argv[at:at] = [flag, str(value)]
    return argv


def kv_sizes(config: dict[str, Any], gib: float, max_model_len: int = 4096) -> tuple[int | None, int | None]:
    """(SGLang max_total_tokens, vLLM kv_cache_memory_bytes) for ``gib`` GiB of bf16 KV cache, each at
    least two full-length requests; (None, None) for 0 (the engines profile memory themselves)."""
    if gib <= 0:
        return None, None
    heads = int(config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", heads)) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    per_token = int(config.get("num_hidden_layers", 1)) * kv_heads * head_dim * 2 * 2
    context = int(config.get("max_position_embeddings") or max_model_len)
    tokens = max(int(gib * (1 << 30)) // per_token, 2 * context)
    return tokens, max(int(gib * (1 << 30)), 2 * max_model_len * per_token)


def server_argv(
    engine: str,
    model_dir: Path,
    port: int,
    toml: Path | None,
    *,
    dummy: bool,
    max_bs: int,
    kv_tokens: int | None,
    kv_bytes: int | None,
) -> list[str]:
    argv = cs.server_command(engine, model_dir, port, toml, dummy=dummy)
    if engine == "sglang":
        argv = set_arg(argv, "--cuda-graph-max-bs-decode", max_bs) if max_bs else argv
        argv = set_arg(argv, "--max-total-tokens", kv_tokens) if kv_tokens else argv
    else:
        argv = set_arg(argv, "--max-num-seqs", max_bs) if max_bs else argv
        argv = set_arg(argv, "--kv-cache-memory-bytes", kv_bytes) if kv_bytes else argv
    return argv


def write_toml(path: Path, archive_dir: Path, mode: str, region_size: str) -> None:
    text = cs.foundry_toml(archive_dir, region_size).replace('mode = "auto"', f'mode = "{mode}"')
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Server:
    """One engine server with Foundry (``mode`` in the TOML), its own port, log, cache root and
    report folder, in its own process group."""

    def __init__(
        self,
        ctx: Ctx,
        case: str,
        label: str,
        *,
        mode: str,
        archive_dir: Path,
        toml: Path,
        fsize_limit: int | None = None,
        cache_root: Path | None = None,
        stock: bool = False,
    ):
        self.ctx, self.case, self.label, self.mode = ctx, case, label, mode
        # stock: the same server without --enable-foundry (no TOML, no plugin), with a HOME and
        # TMPDIR of its own so that what it compiles stays out of the Foundry servers' caches.
        self.stock = stock
        self.archive_dir, self.toml, self.fsize_limit = archive_dir, toml, fsize_limit
        self.rundir = ctx.workdir / "runs" / case / label
        self.cache_root = cache_root or self.rundir / "caches"
        self.log_name = f"{case}-{label}.log"
        self.proc: subprocess.Popen | None = None
        self.pump: Pump | None = None
        self.t0 = 0.0
        self.port = 0
        self.rec: dict[str, Any] = {"label": label, "mode_requested": mode, "archive_dir": str(archive_dir)}
        self.model_id: str | None = None
        self.finished = False
        self._reports: dict[int, dict] = {}
        self._stop_watch = threading.Event()

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, *, write: bool = True) -> Server:
        ctx = self.ctx
        shutil.rmtree(self.rundir, ignore_errors=True)
        self.rundir.mkdir(parents=True)
        if write and not self.stock:
            write_toml(self.toml, self.archive_dir, self.mode, ctx.opts.region_size)
        self.port = cs.free_port()
        argv = server_argv(
            ctx.engine,
            ctx.bench.model_dir,
            self.port,
            None if self.stock else self.toml,
            dummy=ctx.bench.dummy_weights,
            max_bs=ctx.opts.max_bs,
            kv_tokens=ctx.kv_tokens,
            kv_bytes=ctx.kv_bytes,
        )
        home, tmp = ctx.home, ctx.tmp
        if self.stock:
            home, tmp = self.rundir / "home", self.rundir / "tmp"
            home.mkdir()
            tmp.mkdir()
        paths = cs.RunPaths(
            home=home,
            tmp=tmp,
            kept_home=home,
            kept_tmp=tmp,
            cache_root=self.cache_root,
            report_dir=self.rundir / "report",
        )
        env = cs.child_env(
            dict(os.environ),
            ctx.engine,
            "stock_cold" if self.stock else "save",
            paths,
            ctx.bench.shim,
            ctx.bench.other_plugins,
            ctx.bench.user_base,
        )
        if self.stock:
            # What both plugins set in the engine's processes (foundry_core's Inductor pin): without
            # it a stock process benchmarks halved reduction blocks and may sum in another order.
            env.update(STOCK_ENV)
        self.report_dir = paths.report_dir
        self.rec.update(command=shlex.join(argv), port=self.port, log=self.log_name, toml=str(self.toml))
        self.rec["toml_text"] = self.toml.read_text() if self.toml.exists() else None
        ctx.register(self)  # refused while the benchmark stops: no server is ever left unregistered
        self.t0 = time.monotonic()
        self.rec["spawn_offset_s"] = round(self.t0 - ctx.started, 3)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(self.rundir),
            start_new_session=True,
        )
        self.rec["pid"] = self.proc.pid
        if self.fsize_limit:
            # Set from here, not in a preexec_fn (unsafe beside threads): the server writes nothing
            # big for seconds, and every process it starts later inherits the limit.
            import resource

            resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (self.fsize_limit, self.fsize_limit))
            self.rec["rlimit_fsize"] = self.fsize_limit
        self.pump = Pump(self.proc.stdout, ctx.logs / self.log_name, self.t0)
        self.pump.start()
        if ctx.engine == "vllm" and not self.stock:  # its start report lands beside the archive
            threading.Thread(target=self._watch_reports, daemon=True).start()
        return self

    def _watch_reports(self) -> None:
        path = self.archive_dir / START_REPORT
        while not self._stop_watch.wait(0.25):
            self._read_report_file(path)

    def _read_report_file(self, path: Path) -> None:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("pid"), int):
                self._reports[data["pid"]] = data

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, deadline: float) -> bool:
        self.rec["stage"] = "starting"
        try:
            self.model_id = cs.wait_ready(f"http://127.0.0.1:{self.port}", self.proc, deadline)
        except (cs.ServerDied, TimeoutError, OSError) as e:
            self.rec["error"] = f"{type(e).__name__}: {e}"
            return False
        self.rec["ready_s"] = self.elapsed()
        self.rec["stage"] = "ready"
        return True

    def wait_exit_or_ready(self, deadline: float, line: str | None = None) -> str:
        """For a start that must fail: 'exited', 'ready' (it served after all) or 'timeout'. Once a
        line matching ``line`` (a LOG_PATTERNS key) is seen, the server has REFUSAL_GRACE_S left to
        end by itself."""
        ready = self.pump.watch(ENGINE_PATTERNS[self.ctx.engine]["ready"])
        said = self.pump.watch(LOG_PATTERNS[line]) if line else None
        while time.monotonic() < deadline:
            if said is not None and said.is_set():
                deadline = min(deadline, self.t0 + said.t + REFUSAL_GRACE_S)
            if self.proc.poll() is not None:
                self.rec["exited_s"] = self.elapsed()
                return "exited"
            if ready.is_set():
                try:
                    status, _ = cs.http_json(f"http://127.0.0.1:{self.port}/health", timeout=2.0)
                except OSError:
                    status = None
                if status == 200:
                    self.rec["ready_s"] = self.elapsed()
                    return "ready"
            time.sleep(0.2)
        return "timeout"

    def complete(self, prompts: list[list[int]] | None = None, timeout: float = 120.0) -> dict[str, Any]:
        body = cs.completion_body(self.ctx.engine, self.model_id or "", self.ctx.opts.max_tokens)
        if prompts is not None:
            body["prompt"] = prompts
        status, resp = cs.http_json(f"http://127.0.0.1:{self.port}/v1/completions", body, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {str(resp)[:300]}")
        return cs.extract_outputs(resp)

    def check(self, reference: dict[str, Any] | None, what: str = "request") -> dict[str, Any]:
        """One request of the reference prompts, compared with the reference; kept in the record."""
        entry: dict[str, Any] = {"what": what, "t_s": self.elapsed()}
        try:
            got = self.complete()
        except (RuntimeError, OSError) as e:
            entry.update(error=f"{type(e).__name__}: {e}", equal=False)
        else:
            entry.update(compare_outputs(got, reference))
            if entry.get("equal") is False:
                entry["outputs"] = got
        self.rec.setdefault("requests", []).append(entry)
        return entry

    def kill9(self) -> float:
        """SIGKILL the whole process group now; returns the server's clock at the kill."""
        t = self.elapsed()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.rec["killed_at_s"] = t
        return t

    def stop(self) -> None:
        if self.finished or self.proc is None:
            return
        self.finished = True
        self.rec["exited_by_itself"] = self.proc.poll() is not None and "killed_at_s" not in self.rec
        if "killed_at_s" in self.rec:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything it started since
        cs.kill_group(self.proc)
        self.rec["exit_code"] = self.proc.wait()
        self.pump.join(timeout=10)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()
        self._stop_watch.set()
        self.ctx.unregister(self)
        lines = self.pump.snapshot()
        facts = log_facts(lines, self.ctx.engine)
        self.rec["mode_logged"] = facts["mode"]
        self.rec["facts"] = facts
        self.rec["report"] = self.report(facts["engine_pids"])
        self.rec["excerpt"] = excerpt(lines)
        if not self.rec.get("ready_s") or self.rec.get("error"):
            self.rec["log_tail"] = "\n".join(line for _, line in lines[-40:])[-5000:]

    def report(self, engine_pids: list[int]) -> dict[str, Any] | None:
        if self.ctx.engine == "sglang":
            try:
                return json.loads((self.report_dir / f"rank{RANK}.json").read_text())
            except (OSError, ValueError):
                return None
        self._read_report_file(self.archive_dir / START_REPORT)
        for pid in engine_pids:
            if pid in self._reports:
                return self._reports[pid]
        return None
