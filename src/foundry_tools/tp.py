"""``foundry tp``: the embedded decoder tensor-parallel over the GPUs of one host, its decode graph
saved per rank and restored in fresh processes, the all-reduce inside the graph through torch
symmetric memory.

    foundry tp --world-size 2 --out tp2.json

The parent touches no GPU. It starts one process per rank for SAVE, then one per rank for LOAD (and,
with ``--reproduce``, a second SAVE into another folder whose fingerprints and offsets must equal the
first's). Every rank, in SAVE and in LOAD alike: sets its device, joins a gloo process group (no
NCCL anywhere), reserves its Foundry region, allocates and rendezvouses two symmetric buffers
(torch's CUDA backend) at fixed addresses (``foundry_core.engine.tensor_parallel``), and builds its shard
of the model in the region. SAVE captures one decode graph (one padded batch size) whose
row-parallel projections sum through ``torch.ops.symm_mem.one_shot_all_reduce``, saves it with the
symmetric buffer recorded, and runs a fixed prefill-then-decode sequence through it; LOAD restores
the graph without capturing anything and runs the same sequence; every step's logits must be
``torch.equal`` to SAVE's, on every rank. A second graph per rank holds the engine layer's gather
along the last dimension (``SymmetricTP.gather_last_dim``, how the SGLang plugin gathers the
vocabulary-parallel logits): each rank's shard of one seeded tensor, gathered; SAVE's replay and
LOAD's must both give that tensor exactly.

One GPU runs ``--world-size 1`` (the same symmetric-memory path with a group of one), or
``--world-size 2 --share-gpus``: two ranks on the one device, each mapping the other's buffer, so
the whole TP path but NVLink runs there; its timings mean nothing (the ranks time-slice).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .options import HelpFormatter, add_tp_arguments

BUFFER = "tp"  # the all-reduce's symmetric buffer's name in the archive
GATHER = "tp/gather"  # the gather's (the engine layer's logits gather, as SGLang's graphs use it)
GATHER_SHARD = 64  # columns each rank contributes to the gather check
PROMPT_LEN = 6
STEPS = 8


def visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Rank:
    """One rank's setup, identical in SAVE and LOAD: the order of every allocation is fixed."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        import foundry_core as fc
        from foundry_core.engine.tensor_parallel import SymmetricTP
        from foundry_core.symmetric import placed

        from .models import Qwen3Config, build_model

        self.t0 = time.perf_counter()
        self.args, self.rank, self.world = args, args.rank, args.world_size
        # Before any device memory: the region is reserved on it.
        index = self.rank % torch.cuda.device_count() if args.share_gpus else self.rank
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=self.rank, world_size=self.world
        )
        self.group = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9; a no-op later
            symm_mem.enable_symm_mem_for_group(self.group)
        cfg = Qwen3Config.preset(args.preset, max_seq_len=args.max_seq_len)
        self.cfg, self.bs = cfg, args.batch_size
        self.region = fc.Region(args.region_base, args.region_size, index)
        # Symmetric memory first, placed through the engine layer (foundry_core.engine.tensor_parallel,
        # what the SGLang plugin uses): its mappings in Foundry's window, its address arrays in the
        # region, so a LOAD that repeats this setup maps them where SAVE did.
        if getattr(args, "shift_symmetric", False):  # test aid: SAVE's mapping will not repeat
            with placed(self.region):
                self._shift = symm_mem.empty(1 << 20, dtype=torch.uint8, device=self.device)
                symm_mem.rendezvous(self._shift, self.group)
        self.tp = SymmetricTP(self.region, self.rank, self.world)
        # Large enough for the eager prefill's sums too (every prompt token's hidden state).
        staged = self.bs * PROMPT_LEN * cfg.hidden_size
        self.buffer = self.tp.allocate(BUFFER, staged, torch.bfloat16, self.device, self.group)
        self.symmetric = self.tp.buffers[0]
        # The engine layer's gather along the last dimension (a sum of zero-padded shards), checked
        # by a graph of its own against the tensor every rank's shard was cut from.
        width = GATHER_SHARD * self.world
        self.tp.allocate_gather(GATHER, self.bs, width, torch.bfloat16, self.device, self.group)
        # The multicast kernel only where the GPUs have NVLink multicast (off on the lent machines);
        # the one-shot kernel reads the peers' buffers through ordinary peer mappings.
        multicast = self.symmetric.multicast_ptr != 0
        if args.all_reduce == "multimem" and not multicast:
            raise SystemExit(
                "foundry tp: --all-reduce multimem needs NVLink multicast, which these GPUs lack"
            )
        self.multimem = args.all_reduce == "multimem" or (args.all_reduce == "auto" and multicast)
        with self.region.routing():
            self.model = build_model(
                cfg, seed=args.seed, device=self.device, tp_rank=self.rank, tp_size=self.world
            )
            self.model.allocate_kv_cache(max_batch=self.bs, max_seq_len=args.max_seq_len)
            self.ids = torch.zeros(self.bs, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(self.bs, dtype=torch.long, device=self.device)
            full = torch.randn(self.bs, width, generator=torch.Generator().manual_seed(args.seed + 2)) * 8
            self.gather_expected = full.to(torch.bfloat16)
            cols = slice(self.rank * GATHER_SHARD, (self.rank + 1) * GATHER_SHARD)
            self.shard = self.gather_expected[:, cols].contiguous().to(self.device)
        for layer in self.model.layers:
            layer.all_reduce = self.all_reduce
        gen = torch.Generator().manual_seed(args.seed + 1)
        self.prompts = torch.randint(0, cfg.vocab_size, (self.bs, PROMPT_LEN), generator=gen).to(self.device)
        self.setup_s = time.perf_counter() - self.t0

    def all_reduce(self, x):
        """Sum ``x`` over the ranks through the symmetric buffer: a copy into it, then torch's
        one-shot kernel, which reads every rank's buffer through the peer mappings."""
        import torch

        if self.multimem:  # in place, in the buffer: the caller adds it to the residual at once
            staged = self.buffer[: x.numel()]
            staged.view_as(x).copy_(x)
            torch.ops.symm_mem.multimem_all_reduce_(staged, "sum", self.group)
            return staged.view_as(x)
        return self.tp.all_reduce(self.buffer, x, self.group)

    def gather(self):
        """Every rank's shard gathered along the last dimension (the engine layer's logits gather)."""
        return self.tp.gather_last_dim(GATHER, self.shard)

    def gather_identical(self, gathered) -> bool:
        import torch

        return torch.equal(gathered.detach().cpu(), self.gather_expected)

    def fingerprint(self) -> dict:
        return {
            **self.cfg.fingerprint(),
            "tp_size": self.world,
            "batch_size": self.bs,
            "seed": self.args.seed,
            "all_reduce": "symm_mem.multimem" if self.multimem else "symm_mem.one_shot",
        }

    def sequence(self, replay, logits) -> list:
        """The fixed sequence compared between SAVE and LOAD: a fresh cache, an eager prefill of the
        prompts, then STEPS graph replays, each step's greedy token fed back on the device."""
        import torch

        self.model.kv_cache.zero_()
        with torch.no_grad():
            first = self.model.prefill(self.prompts)
        self.ids.copy_(first.argmax(-1))
        self.positions.fill_(PROMPT_LEN)
        out = []
        for _ in range(STEPS):
            replay()
            out.append(logits.detach().cpu().clone())
            self.ids.copy_(logits.argmax(-1))
            self.positions.add_(1)
        torch.cuda.synchronize()
        return out


def run_save(args) -> dict:
    import torch

    import foundry_core as fc

    fc.start_recording()
    rank = _Rank(args)
    rank.region.end_setup()
    t0 = time.perf_counter()
    with rank.region.routing(), torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                rank.model.decode(rank.ids, rank.positions)
            for _ in range(2):
                rank.gather()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=rank.region.graph_pool_id()):
            logits = rank.model.decode(rank.ids, rank.positions)
        graph.instantiate()
        gather_graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(gather_graph, pool=rank.region.graph_pool_id()):
            gathered = rank.gather()
        gather_graph.instantiate()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    timings: dict = {}
    digest = fc.save(
        args.archive,
        graphs={"decode": graph, "gather": gather_graph},
        region=rank.region,
        tensors={"ids": rank.ids, "positions": rank.positions, "logits": logits, "gathered": gathered},
        fingerprint_model=rank.fingerprint(),
        rank=rank.rank,
        world_size=rank.world,
        detect_rng=False,  # no random numbers in decode; a replay here would need every rank at once
        timings=timings,
        symmetric=rank.tp.buffers,
    )
    t2 = time.perf_counter()
    reference = rank.sequence(graph.replay, logits)
    torch.save(reference, args.reference)
    gather_graph.replay()  # every rank at once, after the sequence in SAVE and LOAD alike
    torch.cuda.synchronize()
    return {
        "phase": "save",
        "rank": rank.rank,
        "setup_s": rank.setup_s,
        "capture_s": t1 - t0,
        "save_s": t2 - t1,
        "ready_s": t1 - rank.t0,
        "digest": digest,
        "save_breakdown": timings,
        "symmetric": rank.symmetric.to_json(),
        "all_reduce": rank.fingerprint()["all_reduce"],
        "gather_identical": rank.gather_identical(gathered),
    }


def run_load(args) -> dict:
    import torch

    import foundry_core as fc

    fc.start_recording(keep_images=False)  # only to count stream captures: a LOAD must begin none
    rank = _Rank(args)
    captures_before = fc.stream_captures()
    t0 = time.perf_counter()
    restored = fc.load(
        args.archive,
        region=rank.region,
        fingerprint_model=rank.fingerprint(),
        rank=rank.rank,
        world_size=rank.world,
        symmetric=rank.tp.buffers,
    )
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph, logits = restored.graphs["decode"], restored.tensors["logits"]
    for name, mine in (("ids", rank.ids), ("positions", rank.positions)):
        if restored.tensors[name].data_ptr() != mine.data_ptr():  # the region retraced SAVE's setup
            raise RuntimeError(f"input {name!r} is not where SAVE's graph reads it")
    results = rank.sequence(graph.replay, logits)
    restored.graphs["gather"].replay()
    torch.cuda.synchronize()
    gather_identical = rank.gather_identical(restored.tensors["gathered"])
    after = fc.stream_captures()
    captures = sum(after[k] - captures_before.get(k, 0) for k in after)  # runtime and driver API
    fc.stop_recording()
    reference = torch.load(args.reference)
    identical = [torch.equal(a, b) for a, b in zip(reference, results)]
    collectives = restored.archive.meta.get("collectives", {})
    return {
        "phase": "load",
        "rank": rank.rank,
        "setup_s": rank.setup_s,
        "restore_s": t1 - t0,
        "ready_s": t1 - rank.t0,
        "graphs": len(restored.graphs),
        "load_decode_captures": captures,
        "symm_mem_collectives": collectives.get("symm_mem", 0),
        "nccl_kernels": collectives.get("nccl", 0),
        "steps": len(results),
        "outputs_identical": len(identical) == STEPS and all(identical),
        "steps_identical": sum(identical),
        "greedy_tokens": [int(t) for t in results[-1].argmax(-1)],
        "gather_identical": gather_identical,
    }


def _archive_facts(path: str) -> dict:
    """What two SAVEs of one configuration must reproduce: fingerprint, offsets, symmetric record."""
    from foundry_core.archive import open_archive

    a = open_archive(path)
    return {
        "fingerprint": a.fingerprint,
        "layout": a.meta["layout"],
        "tensors": a.meta["tensors"],
        "symmetric": a.meta.get("symmetric"),
    }


def _worker(args, phase: str, rank: int, port: int, archive_root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "foundry_tools.tp",
        "worker",
        phase,
        "--rank",
        str(rank),
        "--world-size",
        str(args.world_size),
        "--port",
        str(port),
        "--archive",
        str(archive_root / f"rank{rank}"),
        "--reference",
        str(archive_root / f"reference-rank{rank}.pt"),
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--max-seq-len",
        str(args.max_seq_len),
        "--seed",
        str(args.seed),
        "--all-reduce",
        args.all_reduce,
        "--region-base",
        hex(args.region_base),
        "--region-size",
        str(args.region_size),
        *(["--share-gpus"] if args.share_gpus else []),
    ]


class PhaseFailed(Exception):
    """A rank's process of one phase failed; the message names the rank and its last error line."""


def _last_error(err: Path, rank: int) -> str:
    """The last line of rank ``rank``'s stderr that names an error (a traceback's last line), without
    the ``[rankN]: `` prefix torch.distributed puts on it, or ''."""
    lines = [ln for ln in err.read_text(errors="replace").splitlines() if "Error" in ln or "Mismatch" in ln]
    return lines[-1].removeprefix(f"[rank{rank}]: ").strip()[:400] if lines else ""


def _phase(args, phase: str, archive_root: Path) -> list[dict]:
    """Every rank's process of one phase, started together (each waits for the others in the
    process group); their results, by rank. One that fails ends the others, which would otherwise
    wait for it in the group; :class:`PhaseFailed` then names it with its last error line."""
    port = _free_port()
    archive_root.mkdir(parents=True, exist_ok=True)
    outs = [archive_root / f"{phase}-rank{r}.out" for r in range(args.world_size)]
    errs = [archive_root / f"{phase}-rank{r}.err" for r in range(args.world_size)]
    env = dict(os.environ)
    if args.share_gpus:  # torch refuses a rendezvous of ranks on one device unless told
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    procs = []
    for r in range(args.world_size):
        # Files, not pipes: nothing blocks on a full pipe meanwhile.
        with open(outs[r], "w") as out, open(errs[r], "w") as err:
            cmd = _worker(args, phase, r, port, archive_root)
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
    deadline = time.monotonic() + args.timeout
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for r, proc in enumerate(procs):
        lines = [ln for ln in outs[r].read_text().splitlines() if ln.startswith("FOUNDRY_RESULT ")]
        if proc.returncode != 0 or not lines:
            why = _last_error(errs[r], r) or f"exit {proc.returncode}"
            raise PhaseFailed(f"rank {r}'s {phase} process failed: {why}")
        results.append(json.loads(lines[-1][len("FOUNDRY_RESULT ") :]))
    return results


def orchestrate(args) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="foundry-tp-"))
    first = workdir / "save1"
    t0 = time.perf_counter()
    try:
        saves = _phase(args, "save", first)
        loads = _phase(args, "load", first)
    except PhaseFailed as e:  # a result all the same: the failure is the finding
        elapsed = round(time.perf_counter() - t0, 2)
        return {
            "world_size": args.world_size,
            "ok": False,
            "failed": str(e),
            "ranks": [],
            "elapsed_s": elapsed,
        }
    ranks = []
    for s, ld in zip(saves, loads):
        ranks.append(
            {
                "rank": s["rank"],
                "graphs": ld["graphs"],
                "load_decode_captures": ld["load_decode_captures"],
                "symm_mem_collectives": ld["symm_mem_collectives"],
                "nccl_kernels": ld["nccl_kernels"],
                "outputs_identical": ld["outputs_identical"],
                "steps_identical": ld["steps_identical"],
                "steps": ld["steps"],
                "capture_s": round(s["capture_s"], 4),
                "restore_s": round(ld["restore_s"], 4),
                "ready_s_save": round(s["ready_s"], 3),
                "ready_s_load": round(ld["ready_s"], 3),
                "greedy_tokens": ld["greedy_tokens"],
                "symmetric": s["symmetric"],
                "all_reduce": s["all_reduce"],
                # the engine layer's gather (sum of zero-padded shards), in its own graph
                "gather_identical_save": s["gather_identical"],
                "gather_identical_load": ld["gather_identical"],
            }
        )
    result = {
        "world_size": args.world_size,
        "share_gpus": args.share_gpus,
        "preset": args.preset,
        "batch_size": args.batch_size,
        "ranks": ranks,
        "ranks_agree": len({json.dumps(r["greedy_tokens"]) for r in ranks}) == 1,
    }
    if args.reproduce:
        second = workdir / "save2"
        try:
            _phase(args, "save", second)
        except PhaseFailed as e:
            result.update(ok=False, failed=f"second SAVE: {e}", elapsed_s=round(time.perf_counter() - t0, 2))
            return result
        rows = []
        for r in range(args.world_size):
            a, b = _archive_facts(str(first / f"rank{r}")), _archive_facts(str(second / f"rank{r}"))
            rows.append({k: a[k] == b[k] for k in a})
        result["reproduce"] = {"fingerprints_equal": all(x["fingerprint"] for x in rows), "per_rank": rows}
        result["reproduce"]["offsets_equal"] = all(
            x["layout"] and x["tensors"] and x["symmetric"] for x in rows
        )
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    result["ok"] = (
        all(
            r["outputs_identical"]
            and r["gather_identical_save"]
            and r["gather_identical_load"]
            and r["load_decode_captures"] == 0
            and r["nccl_kernels"] == 0
            for r in ranks
        )
        and all(r["symm_mem_collectives"] > 0 for r in ranks)
        and result["ranks_agree"]
        and (
            not args.reproduce
            or (result["reproduce"]["fingerprints_equal"] and result["reproduce"]["offsets_equal"])
        )
    )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m foundry_tools.tp",
        description="One rank of foundry tp.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("role", choices=("worker",))
    p.add_argument("phase", choices=("save", "load"))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--archive", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument(
        "--shift-symmetric",
        action="store_true",
        help="map another symmetric buffer first, so that this process's mapping differs from SAVE's (tests)",
    )
    add_tp_arguments(p)
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.archive)), exist_ok=True)
    result = run_save(args) if args.phase == "save" else run_load(args)
    print("FOUNDRY_RESULT " + json.dumps(result), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("FOUNDRY_NO_PROGRESS", "1")
    sys.exit(main())
