"""Side by side, for one engine and machine: how fast a server starts and serves stock, with upstream
Foundry (peer) and with Foundry, in alternating pairs, across device calls of at most 600 s.

    python benchmarks/sxs.py run --engine sglang --shape qwen3-1.7b --modes stock_naive,stock_best,foundry,peer \\
        --pairs 1 --workdir /tmp/sxs-sglang --budget 500 [--serving]
    python benchmarks/sxs.py merge --engine sglang --workdir /tmp/sxs-sglang \\
        --out benchmarks/results/sxs-sglang-h200.json
    python benchmarks/sxs.py chart benchmarks/results/sxs-sglang-h200.json   # where merge drew none

Modes (what each launches: benchmarks/sxs_modes.py):

* ``stock_naive``: every engine cache empty (HOME and TMPDIR, where the engines keep them by default,
  are empty folders) and the page cache dropped where ``/proc/sys/vm/drop_caches`` is writable;
* ``stock_best``: a fresh container (page cache dropped) with the caches an earlier start of its own
  settings left (``fill``: stock_best's launch from empty caches, run once) restored where the engine
  looks, plus every launch setting of Foundry's a stock user can set too. Not stock_naive's caches:
  vLLM keys its compile cache on the configuration, which stock_best's settings change (on the H100
  on 2026-12-05, stock_best compiled for 19 s at every start from stock_naive's caches);
* ``peer`` (SGLang): upstream ``foundry-core`` 0.1.0rc3 as its README says, SAVE once, then LOAD
  (cold, like stock_naive); a refusal is recorded with its reason. With ``stock_best`` among the
  modes, each pair also LOADs it with stock_best's caches kept (``best``), as a user who keeps the
  engine's caches beside upstream's archive (which carries none) would;
* ``foundry``: SAVE once, then per pair a cold LOAD (caches and page cache as stock_naive) and a warm
  LOAD (the caches the cold LOAD left, the page cache kept: a restart on the same host);
* ``stock_default``: the engine's defaults, graph configuration included (for serving).

Per start: seconds from spawn to ready (``/health`` and ``/v1/models``) and to the first streamed token
of a completion through the OpenAI endpoint (``ttft_cold_s``); the phases of the start from its log;
greedy tokens and top-5 logprobs of four prompts (a request each, and all four in one); with
``--serving`` (modes of ``--serving-modes``) the engine's own benchmark client at two request rates
(benchmarks/sxs_serving.py). Each ``run``
measures the floor once per call (benchmarks/sxs_floor.py). A pair runs its modes in the given order,
the next pair in the reverse order. Every start is one JSON file under ``--workdir``, which outlives
the call on a warm machine; ``merge`` (benchmarks/sxs_merge.py) turns them into the result JSON and
chart. Each start is weighed against the budget left (``Work.estimate``): one that does not fit even at
its least is skipped and said so; one that fits at its least but not as long as it likely takes runs
with its timeout cut to the time left, and when that cut ends it the record says ``cut_by_budget``
(not a failure: the merge counts it apart, the next call runs it again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sxs_floor  # noqa: E402  (beside this file)
import sxs_model  # noqa: E402
import sxs_modes as modes  # noqa: E402
import sxs_server  # noqa: E402
import sxs_serving  # noqa: E402

REPO = HERE.parent
SRC = REPO / "src"
FIRST_START_S = 240.0  # what a start is assumed to take before any was measured
SERVING_S = 150.0  # what both rates of a serving run are assumed to take before one was measured
#: Start kind -> the kind of the same engine and shape it never takes longer than: a LOAD restores what
#: its SAVE compiled and captured, a warm LOAD finds what the cold one left, stock_best the caches its
#: fill left. Before its first measurement a start is expected to take as long as that kind.
NEVER_LONGER_THAN = {
    ("foundry", "cold"): ("foundry", "save"),
    ("peer", "cold"): ("peer", "save"),
    ("peer", "best"): ("peer", "cold"),
    ("foundry", "warm"): ("foundry", "cold"),
    ("stock_best", "best"): ("stock_best", "fill"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the chosen modes and pairs, adding to --workdir")
    r.add_argument("--engine", choices=modes.ENGINES, required=True)
    r.add_argument("--shape", choices=sorted(sxs_model.SHAPES), default="qwen3-1.7b")
    r.add_argument("--modes", default="stock_naive,stock_best,foundry", help="comma-separated, in pair order")
    r.add_argument("--pairs", type=int, default=1)
    r.add_argument("--workdir", type=Path, required=True)
    r.add_argument("--budget", type=float, default=540.0, help="seconds for this call's starts")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    r.add_argument("--serving", action="store_true", help="serving benchmark on --serving-modes' starts")
    r.add_argument("--serving-modes", default="foundry,stock_default")
    r.add_argument(
        "--peer-site", type=Path, default=Path("/tmp/site-peer"), help="foundry-core 0.1.0rc3's site"
    )
    r.add_argument("--no-floor", action="store_true")
    m = sub.add_parser("merge", help="write the result JSON and chart from --workdir")
    m.add_argument("--engine", choices=modes.ENGINES, required=True)
    m.add_argument("--workdir", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--command", default=None, help="the device command line(s) recorded in the result")
    c = sub.add_parser("chart", help="draw the PNG beside a result JSON (where the device had no matplotlib)")
    c.add_argument("result", type=Path)
    opts = p.parse_args(argv)
    if opts.cmd == "run":
        opts.modes = [x.strip() for x in opts.modes.split(",") if x.strip()]
        bad = [x for x in opts.modes if x not in modes.MODES]
        if bad or not opts.modes:
            p.error(f"--modes: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(modes.MODES)}")
        if "peer" in opts.modes and opts.engine not in modes.PEER_ENGINES:
            p.error(f"--modes peer: only for {', '.join(modes.PEER_ENGINES)}")
        if opts.pairs < 1:
            p.error("--pairs must be at least 1")
        opts.serving_modes = [x.strip() for x in opts.serving_modes.split(",") if x.strip()]
    return opts


class Work:
    """The work directory: model, archives, kept caches, and one JSON per start (``starts/``)."""

    def __init__(self, root: Path, engine: str, shape: str):
        self.root, self.engine, self.shape = root.resolve(), engine, shape
        self.dir = self.root / shape
        self.starts = self.dir / "starts"
        self.logs = self.dir / "logs"
        for d in (self.starts, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.model = self.root / "models" / shape
        # Short paths: engines put IPC sockets in TMPDIR, and a socket path has ~107 bytes.
        self.home, self.tmp = self.root / "h", self.root / "t"
        self.kept = {"stock": self.dir / "kept-stock", "foundry": self.dir / "kept-foundry"}
        self.archive, self.peer_archive = self.dir / "archive", self.dir / "peer-archive"

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.starts.glob("*.json"))]

    def save(self, rec: dict[str, Any]) -> None:
        seq = len(list(self.starts.glob("*.json")))
        rec["seq"] = seq
        (self.starts / f"{seq:04d}-{rec['mode']}-{rec['variant']}.json").write_text(json.dumps(rec, indent=1))

    def saved(self, mode: str) -> dict[str, Any] | None:
        """The SAVE start of foundry or peer that worked and whose archive is still here, if any (records
        resumed on a fresh machine come without their archives)."""
        archive = self.archive if mode == "foundry" else self.peer_archive
        if not (archive.is_dir() and any(archive.iterdir())):
            return None
        return next(
            (r for r in self.records() if r["mode"] == mode and r["variant"] == "save" and "error" not in r),
            None,
        )

    def next_pair(self) -> int:
        return 1 + max((r.get("pair") or 0 for r in self.records()), default=0)

    def floor_s(self) -> float | None:
        """The least any start here takes, by the floors measured here (the least of them): importing
        the entry module (cached or not, whichever was faster), reading the weights, a CUDA context."""
        sums = []
        for path in (self.dir / "floor").glob("*.json"):
            floor = json.loads(path.read_text())
            imports = [
                v["wall_s"]
                for k in ("import_entry_module", "import_entry_module_warm")
                if "wall_s" in (v := floor.get(k) or {}) and "error" not in v
            ]
            if imports:
                weights = (floor.get("read_weights") or {}).get("s") or 0.0
                sums.append(
                    min(imports) + weights + ((floor.get("cuda_context") or {}).get("inner_s") or 0.0)
                )
        return min(sums) if sums else None

    def _likely(self, recs: list[dict[str, Any]], mode: str, variant: str, first_s: float) -> float:
        same = [
            _start_s(r)
            for r in recs
            if (r["mode"], r["variant"]) == (mode, variant) and "wall_s" in r and not r.get("cut_by_budget")
        ]
        if same:
            return max(same)
        if (mode, variant) in NEVER_LONGER_THAN:
            return self._likely(recs, *NEVER_LONGER_THAN[(mode, variant)], first_s)
        other = [1.5 * _start_s(r) for r in recs if "wall_s" in r and "error" not in r]
        return min(max(other), first_s) if other else first_s

    def estimate(self, mode: str, variant: str, serving: bool, first_s: float) -> tuple[float, float]:
        """(likely, least) seconds a start takes, its serving run included.

        likely: the longest earlier start of the same kind; before the first, the likely time of the
        kind it never takes longer than (:data:`NEVER_LONGER_THAN`, a SAVE for a cold LOAD); else 1.5
        times the longest start of any kind, at most ``first_s``; else ``first_s``.
        least: the shortest earlier start of the same kind that worked; before the first, the floor
        measured here (what any start pays), else ``likely``.
        A start of the kind the budget cut short ran that long without getting ready: both are at least
        that. A start runs where the time left covers ``least``, with its timeout cut to that time where
        it does not cover ``likely``."""
        recs = self.records()
        kind = [r for r in recs if (r["mode"], r["variant"]) == (mode, variant) and "wall_s" in r]
        worked = [_start_s(r) for r in kind if "error" not in r]
        likely = self._likely(recs, mode, variant, first_s)
        least = min(worked) if worked else self.floor_s()
        least = max(
            [likely if least is None else least] + [r["wall_s"] for r in kind if r.get("cut_by_budget")]
        )
        serve = [r["serving_wall_s"] for r in recs if r.get("serving_wall_s")]
        serving_s = (max(serve) if serve else min(SERVING_S, first_s)) if serving else 0.0
        return max(likely, least) + serving_s, least + serving_s


def _start_s(rec: dict[str, Any]) -> float:
    """A recorded start's seconds, its serving run left out (an estimate adds it where asked)."""
    return rec["wall_s"] - (rec.get("serving_wall_s") or 0.0)


def _not_files(folder: str, names: list[str]) -> list[str]:
    """What a copy of caches leaves out: sockets and pipes an engine left in TMPDIR."""
    return [
        n
        for n in names
        if not (os.path.isdir(os.path.join(folder, n)) or os.path.isfile(os.path.join(folder, n)))
    ]


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True, ignore=_not_files)


def _replace(src: Path | None, dst: Path) -> None:
    """``dst`` becomes a copy of ``src`` (an empty folder when ``src`` is None or missing)."""
    shutil.rmtree(dst, ignore_errors=True)
    if src is not None and src.is_dir():
        _copy(src, dst)
    dst.mkdir(parents=True, exist_ok=True)


def _keep(work: Work, name: str) -> None:
    """Keep the HOME/TMPDIR a start left as the caches of ``name``."""
    kept = work.kept[name]
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for live in (work.home, work.tmp):
        if live.is_dir():
            _copy(live, kept / live.name)


def prepare(work: Work, caches: str) -> dict[str, Any]:
    """HOME and TMPDIR for a start: ``empty`` or a kept set's copy. The page cache is dropped for a
    fresh container (``empty``, and ``stock``: stock_best's caches baked into the image or a volume),
    kept for a restart on the same host (``foundry``: the warm LOAD)."""
    info: dict[str, Any] = {"caches": caches}
    kept = work.kept.get(caches)
    for live in (work.home, work.tmp):
        _replace(kept / live.name if kept else None, live)
    if caches in ("empty", "stock"):
        info["page_cache_dropped"], info["page_cache"] = sxs_floor.drop_page_cache()
    return info


def _gpu_used_mib() -> int | None:
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return int(q.stdout.split()[0]) if q.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def wait_gpu_free(baseline: int | None, limit_s: float = 30.0) -> None:
    """After a start: until the GPU holds no more memory than before the first one (or ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while baseline is not None and time.monotonic() < deadline:
        used = _gpu_used_mib()
        if used is None or used <= baseline + 512:
            return
        time.sleep(0.5)


def env_record(env: dict[str, str], parent: dict[str, str]) -> dict[str, Any]:
    """What a launch set or removed relative to the harness's own environment."""
    return {
        "set": {k: v for k, v in sorted(env.items()) if parent.get(k) != v},
        "removed": sorted(k for k in parent if k not in env),
    }


class Runner:
    def __init__(self, opts: argparse.Namespace, work: Work, deadline: float):
        self.opts, self.work, self.deadline = opts, work, deadline
        self.parent = dict(os.environ)
        self.info = sxs_model.write(opts.shape, work.model)
        self.dummy = self.info["weights"] == "dummy"
        self.region = sxs_model.SHAPES[opts.shape][2]
        self.shim = modes.write_shim(work.root / "shim", opts.engine)
        self.baseline = _gpu_used_mib()
        self.others = tuple(modes.installed_plugins(opts.engine))

    def where(self, mode: str, toml: Path | None = None) -> modes.Where:
        return modes.Where(
            model_dir=self.work.model,
            home=self.work.home,
            tmp=self.work.tmp,
            port=sxs_server.free_port(),
            shim=self.shim,
            toml=toml,
            peer_site=self.opts.peer_site if mode == "peer" else None,
        )

    def toml(self, mode: str, phase: str) -> Path:
        d = self.work.dir / "toml"
        if mode == "peer":
            return modes.peer_toml(
                d / f"peer-{phase}.toml", phase, self.work.peer_archive, self.region.replace("GiB", "GB")
            )
        # One file for every phase, rewritten before each start: vLLM keys its config hash (and so its
        # compile cache and Foundry's archive check) on the TOML's path.
        return modes.foundry_toml(d / "foundry.toml", phase, self.work.archive, self.region)

    def start(
        self,
        mode: str,
        variant: str,
        pair: int | None,
        caches: str,
        toml: Path | None = None,
        serving: bool = False,
    ) -> dict[str, Any] | None:
        """One start, recorded whatever happens; None when it did not fit the budget (said so)."""
        eng = self.opts.engine
        rec: dict[str, Any] = {"mode": mode, "variant": variant, "pair": pair, "shape": self.opts.shape}
        rec["host"] = socket.gethostname()  # calls resumed on another machine say so
        need, least = self.work.estimate(mode, variant, serving, min(FIRST_START_S, self.opts.timeout))
        left = self.deadline - time.monotonic()
        if least > left:
            why = f"needs ~{need:.0f} s (at least ~{least:.0f} s), {left:.0f} s left"
            print(f"skip {mode}/{variant} pair {pair}: {why}", flush=True)
            return None
        if need > left:
            why = f"needs ~{need:.0f} s, {left:.0f} s left: its timeout cut to that"
            print(f"{mode}/{variant} pair {pair}: {why}", flush=True)
        rec.update(prepare(self.work, caches))
        launch = modes.launch(eng, mode, self.where(mode, toml), self.dummy, self.parent, SRC, self.others)
        rec["argv"] = launch.argv[1:]  # the interpreter's path says nothing
        rec["env"] = env_record(launch.env, self.parent)
        log = self.work.logs / f"{len(list(self.work.starts.glob('*.json'))):04d}-{mode}-{variant}.log"
        rec["log"] = str(log)
        t0 = time.monotonic()
        # Whether or not the estimate fit: no start runs past the budget
        timeout = max(1.0, min(self.opts.timeout, self.deadline - t0))
        rec["timeout_s"] = round(timeout, 1)
        server = sxs_server.Server(launch.argv, launch.env, log, eng, timeout)
        try:
            with server:
                if serving:
                    s0 = time.monotonic()
                    # the client's own HOME: what it caches must not join the server's caches
                    client_env = dict(launch.env, HOME=str(self.work.root / "client-home"))
                    rec["serving"] = sxs_serving.run(
                        eng,
                        server.base,
                        self.work.model,
                        client_env,
                        self.work.logs,
                        f"{mode}-{variant}-p{pair}",
                        max(30.0, self.deadline - s0),
                    )
                    rec["serving_wall_s"] = round(time.monotonic() - s0, 1)
        except Exception as e:  # noqa: BLE001 - every failure is a result of its own
            server.rec.setdefault("error", f"{type(e).__name__}: {e}"[:500])
        rec.update(server.rec)
        ran_out = "error" in rec and (
            rec["error"].startswith("TimeoutError") or time.monotonic() - t0 >= timeout
        )
        if ran_out and timeout < self.opts.timeout:
            # not a failure of the start: the next call runs it again (a SAVE too), not counted as one
            rec["cut_by_budget"] = True
        # A plugin the engine did not load leaves a stock start under the mode's name.
        mark = {"peer": "[Foundry]", "foundry": "Foundry"}.get(mode)
        if mark and "error" not in rec and mark not in log.read_text(errors="replace"):
            rec["error"] = f"the plugin did not activate (no {mark!r} in the log): a stock start"
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        self.work.save(rec)
        wait_gpu_free(self.baseline)
        status = ("cut by the budget: " if rec.get("cut_by_budget") else "") + rec.get("error", "")
        status = status or f"ttft {rec.get('ttft_cold_s')} s, ready {rec.get('ready_s')} s"
        print(f"{eng} {self.opts.shape} {mode}/{variant} pair {pair}: {status}", flush=True)
        return rec

    def peer_missing(self) -> str | None:
        """Why upstream Foundry cannot run here (its site lacks it), or None. Without it the engine
        would start stock under the peer's name."""
        site = self.opts.peer_site
        if (site / "foundry_sglang_plugin.py").is_file() and (site / "foundry").is_dir():
            return None
        return f"upstream Foundry (foundry-core 0.1.0rc3) is not installed in {site}"

    def ensure_saved(self, mode: str) -> bool:
        """foundry/peer: a SAVE that worked exists (runs one when none does; a refusal stays)."""
        if mode == "peer" and (why := self.peer_missing()):
            print(f"peer: {why}", flush=True)
            if not any(r["mode"] == "peer" and r.get("error") == why for r in self.work.records()):
                self.work.save(
                    {"mode": "peer", "variant": "save", "pair": None, "error": why, "refusal": why}
                )
            return False
        if self.work.saved(mode):
            return True
        if any(
            r["mode"] == mode and r["variant"] == "save" and "error" in r and not r.get("cut_by_budget")
            for r in self.work.records()
        ):
            return False  # refused or failed before: the record says why; not retried
        shutil.rmtree(self.work.archive if mode == "foundry" else self.work.peer_archive, ignore_errors=True)
        rec = self.start(mode, "save", None, "empty", self.toml(mode, "save"))
        return rec is not None and "error" not in rec

    def ensure_stock_caches(self) -> bool:
        if self.work.kept["stock"].is_dir():
            return True
        rec = self.start("stock_best", "fill", None, "empty")
        if rec is None or "error" in rec:
            return False
        _keep(self.work, "stock")
        return True

    def mode(self, mode: str, pair: int) -> None:
        serving = self.opts.serving and mode in self.opts.serving_modes
        if mode == "stock_naive":
            self.start(mode, "cold", pair, "empty", serving=serving)
        elif mode == "stock_best":
            if self.ensure_stock_caches():
                self.start(mode, "best", pair, "stock", serving=serving)
        elif mode == "stock_default":
            self.start(mode, "default", pair, "empty", serving=serving)
        elif mode == "peer":
            if self.ensure_saved("peer"):
                self.start(mode, "cold", pair, "empty", self.toml("peer", "load"), serving=serving)
                # and as a careful upstream user runs it: the engine's caches kept beside its archive
                # (stock_best's), since upstream's archive carries none of them
                if "stock_best" in self.opts.modes and self.ensure_stock_caches():
                    self.start(mode, "best", pair, "stock", self.toml("peer", "load"))
        elif mode == "foundry" and self.ensure_saved("foundry"):
            rec = self.start(mode, "cold", pair, "empty", self.toml("foundry", "load"), serving=serving)
            if rec and "error" not in rec:
                _keep(self.work, "foundry")
                self.start(mode, "warm", pair, "foundry", self.toml("foundry", "load"))

    def run(self) -> None:
        if not self.opts.no_floor:
            env = modes.base_env(self.parent, self.opts.engine, self.where("stock_naive"), SRC, self.others)
            floor = sxs_floor.measure(self.opts.engine, self.work.model, env)
            floor_dir = self.work.dir / "floor"
            floor_dir.mkdir(exist_ok=True)
            (floor_dir / f"{len(list(floor_dir.glob('*.json'))):04d}.json").write_text(
                json.dumps(floor, indent=1)
            )
            print(f"floor: {json.dumps(floor)}", flush=True)
        first = self.work.next_pair()
        for pair in range(first, first + self.opts.pairs):
            need, left = self.pair_estimate(), self.deadline - time.monotonic()
            # An incomplete pair compares nothing: a pair whose starts do not fit even at their least
            # is left to the next call. Before any start was measured there is nothing to judge by:
            # the starts' own checks decide.
            if need > left and self.work.records():
                print(
                    f"stop before pair {pair}: it needs at least ~{need:.0f} s, {left:.0f} s left", flush=True
                )
                return
            order = self.opts.modes if pair % 2 else list(reversed(self.opts.modes))
            for mode in order:
                self.mode(mode, pair)

    def pair_estimate(self) -> float:
        """Seconds one pair of the chosen modes takes at the least (:meth:`Work.estimate`), the SAVEs
        it still needs included."""
        first = min(FIRST_START_S, self.opts.timeout)
        kinds = {"stock_naive": ["cold"], "stock_best": ["best"], "stock_default": ["default"]}
        kinds.update(
            foundry=["cold", "warm"], peer=["cold", "best"] if "stock_best" in self.opts.modes else ["cold"]
        )
        total = 0.0
        for mode in self.opts.modes:
            serving = self.opts.serving and mode in self.opts.serving_modes
            total += sum(self.work.estimate(mode, v, serving and v != "warm", first)[1] for v in kinds[mode])
            if mode in ("foundry", "peer") and not self.work.saved(mode):
                total += self.work.estimate(mode, "save", False, first)[1]
        return total


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.cmd in ("merge", "chart"):
        import sxs_merge

        return sxs_merge.main(opts) if opts.cmd == "merge" else sxs_merge.chart_main(opts.result)
    deadline = time.monotonic() + opts.budget
    work = Work(opts.workdir, opts.engine, opts.shape)
    meta = work.root / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()).get("engine") != opts.engine:
        print(
            f"--workdir {opts.workdir} holds another engine's runs: use one work dir per engine",
            file=sys.stderr,
        )
        return 2
    meta.write_text(json.dumps({"engine": opts.engine, "python": sys.executable}))
    try:
        Runner(opts, work, deadline).run()
    except (RuntimeError, OSError, ValueError) as e:
        print(f"sxs: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
