"""One scheduler process's Foundry state, from startup to the end of graph initialization.

Order of events in a scheduler process (each step is called from a hook in :mod:`.hooks`):

1. ``begin`` (``Scheduler.__init__``, before any model memory exists): settings, refusal rules,
   mode, fingerprint; ``fc.start_recording()`` (LOAD: counting captures only, no images kept). A LOAD
   first checks the core archive against this machine (``fc.verify``: files, digest pin, GPU,
   driver, torch, fingerprint); in ``auto`` mode a refused archive turns the start into a SAVE
   (single-rank engines only), in ``load`` mode it is a one-line error.
2. ``enter_region`` (``ModelRunner.__init__`` of the target model): reserve the fixed-VA region and
   route this thread's torch allocations into it; model, KV pools and static graph buffers follow.
3. ``pool_config`` (``KVCacheConfigurator._resolve_memory_pool_config``): SAVE records the profiled
   pool sizing (KV, and the Mamba/hybrid state pool); LOAD returns the saved sizing without profiling.
4. ``capture_begins`` (``DecodeCudaGraphRunner.capture``): the setup a LOAD repeats ends here.
   SAVE calls ``region.end_setup()``; LOAD restores the archive (``fc.load``) and skips
   ``BaseRunner.warmup`` (the state warmups create lazily is restored with the archive). A restore
   that fails here turns an ``auto`` single-rank start into mode ``capture``: SGLang warms up and
   captures as it would without Foundry, and nothing is saved (``decide.after_load_failure``).
5. decode backend (``resolve_decode_backend``): SAVE captures as usual, keeping each graph;
   LOAD installs the restored graph and outputs for each shape instead of warming up and capturing.
6. ``finish`` (end of ``ModelRunner.init_cuda_graphs``): SAVE persists (``fc.save`` then the
   sidecar); LOAD checks that every archived shape was installed; routing ends and CUPTI is
   detached (``fc.stop_recording()``): the serving loop runs with no profiler interface attached.

Each session keeps a small report (mode, graphs, capture/restore seconds, stream captures counted by
CUPTI during the decode-graph phase, the error if one ended it). It is logged at the end and, when
the environment names a directory in :data:`REPORT_ENV`, written there as ``rank<r>.json``: the
scheduler is a subprocess, so this is how a benchmark or a test reads what happened inside it.

Steps 1-6 have run on an H200 with SGLang 0.5.17 (docs/sglang.md, GPU results).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any

from foundry_core import early
from foundry_core.engine import capture, decide
from foundry_core.engine.records import write_json_atomic
from foundry_sglang_plugin import archive, settings
from foundry_sglang_plugin._view import reader
from foundry_sglang_plugin.outputs import flatten, unflatten
from foundry_sglang_plugin.placement import PlacementError, placement
from foundry_sglang_plugin.support import check_supported, graph_phase

logger = logging.getLogger("foundry.sglang")

REPORT_ENV = "FOUNDRY_SGLANG_REPORT_DIR"
#: The compile and JIT caches SGLang's processes fill (foundry_core.engine.caches.KINDS).
CACHE_KINDS = ("sglang", "sglang-jit", "triton", "inductor", "tvm-ffi", "flashinfer", "deep-gemm", "cuda")
#: Names of SGLang's symmetric-memory buffers in the archive (tensor parallelism).
TP_ALL_REDUCE = "sglang/tp/all_reduce"
TP_LOGITS = "sglang/tp/logits"


class FoundrySessionError(RuntimeError):
    """A SAVE or LOAD that cannot go on; the message is one line."""


def _shape_name(shape_key: Any) -> str:
    """A stable archive name for one decode graph shape (``ShapeKey`` in 0.5.2x, an int before)."""
    if dataclasses.is_dataclass(shape_key):
        parts = [
            f"{f.name}={getattr(shape_key, f.name)}"
            for f in dataclasses.fields(shape_key)
            if getattr(shape_key, f.name) is not None
        ]
        return "decode/" + ",".join(parts)
    return f"decode/size={shape_key}"


class Session:
    def __init__(self, server_args: Any, cfg: Any, mode: str, rank: int, gpu_id: int | None):
        self.server_args = server_args
        self.cfg = cfg
        self.mode = mode
        self.rank = rank
        self.gpu_id = gpu_id
        self.path = cfg.rank_archive_dir(rank)
        self.world_size = 1
        self.tp_rank, self.tp_size = 0, 1
        self.tp = None  # tensor parallelism: this rank's torch symmetric memory (SymmetricTP)
        self.fingerprint = archive.fingerprint(server_args, cfg)
        self.region = None
        self._routing = contextlib.ExitStack()
        self.slots: dict[str, Any] | None = None
        self.graphs: dict[str, Any] = {}
        self.tensors: dict[str, Any] = {}
        self.layouts: dict[str, Any] = {}
        self.restored = None
        self._verified = None  # the foundry_core Archive check_archive read, until fc.load takes it
        self._prepared = None  # LOAD: modules and graphs being rebuilt from enter_region on
        self.installed: set[str] = set()
        self.capture_started = False
        self.sidecar: dict[str, Any] | None = None
        self._sidecar_at_decision: Any = None  # decide.record_stamp of the sidecar when SAVE was decided
        self._archive_at_decision: Any = None  # decide.archive_stamp of the graph archive then
        self.report: dict[str, Any] = {"mode": mode, "rank": rank, "archive": str(self.path), "ok": None}
        from foundry_core.engine import CacheHandover

        self.caches = CacheHandover(cfg, rank, CACHE_KINDS, _engine_facts(), log=logger)
        self._t_capture: float | None = None
        self._captures_at_capture: dict[str, int] | None = None
        if mode == "load":
            self.sidecar = archive.read_sidecar(cfg, rank)
            if self.sidecar is None or self.sidecar.get("fingerprint") != self.fingerprint:
                raise FoundrySessionError(
                    f"no Foundry archive for this configuration at {self.path} (mode=load); run once with mode=save"
                )
        else:
            self._invalidate_sidecar()

    # -- step 1 -------------------------------------------------------------------------------
    @classmethod
    def begin(cls, server_args: Any, hint: dict[str, Any]) -> Session | None:
        try:
            tp_rank, dp_rank, gpu_id = placement(hint)
        except PlacementError as e:
            raise FoundrySessionError(str(e)) from None
        settled = settle(server_args, replica=dp_rank)
        if settled is None:
            return None
        cfg, mode = settled
        read = reader(server_args)
        dp_size = max(1, int(read("dp_size", 1) or 1))
        if dp_size > 1 and dp_rank is None:
            raise FoundrySessionError(
                "data-parallel rank of this scheduler is unknown; cannot pick its archive"
            )
        tp_size = max(1, int(read("tp_size", 1) or 1))
        rank = int(dp_rank or 0) * tp_size + tp_rank
        early.mark("session_begin")
        t0 = time.perf_counter()
        session = cls(server_args, cfg, mode, rank, gpu_id)
        session.world_size = archive.world_size(server_args)
        session.tp_rank, session.tp_size = tp_rank, tp_size
        session.caches.world_size = session.world_size
        # Before anything compiles or initialises CUDA (the driver reads CUDA_CACHE_PATH then).
        session.caches.begin()
        from foundry_core.engine import inductor, prewarm

        inductor.pin_process(logger)  # SAVE and LOAD compile alike (foundry_core.engine.inductor)
        import foundry_core as fc

        # Where the start's own time goes, in the report (this all runs before SGLang's setup).
        begin_s = {"session_s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        # Recording starts before anything touches CUDA (checking the archive reads the device's
        # properties). An auto LOAD keeps images until its archive is accepted: it may still SAVE.
        fc.start_recording(keep_images=mode == "save" or cfg.mode == "auto")
        begin_s["recording_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        if mode == "load":
            session.check_archive()
        begin_s["check_archive_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        if session.mode == "load":
            session.caches.restore(session.device)
        begin_s["caches_s"] = time.perf_counter() - t1
        # SAVE keeps every module image; LOAD only counts stream captures (it must begin none).
        fc.start_recording(keep_images=session.mode == "save")
        # Background work only now, beside SGLang's setup: beside the steps above it slowed them
        # (prewarm's docstring). The archive checked above inflates there too.
        t1 = time.perf_counter()
        prewarm.start(logger, archive=session._verified)
        begin_s["threads_s"] = time.perf_counter() - t1
        begin_s["total_s"] = time.perf_counter() - t0
        session.report["begin_s"] = {k: round(v, 4) for k, v in begin_s.items()}
        _time_steps(session, begin_s)
        early.mark("session_ready")
        # The scheduler's own start around Foundry's steps: its imports before the plugin, SGLang's
        # set-up between the plugin and the session (a spawned scheduler's re-import is before both).
        session.report["process_age_s"] = dict(early.MARKS)
        logger.info(
            "Foundry %s: rank %d, archive %s (start checks %.2f s: recording %.2f, archive %.2f, caches %.2f)",
            session.mode.upper(),
            rank,
            session.path,
            begin_s["total_s"],
            begin_s["recording_s"],
            begin_s["check_archive_s"],
            begin_s["caches_s"],
        )
        return session

    def _invalidate_sidecar(self) -> None:
        """This rank SAVEs: its old sidecar goes, and which file is there now is noted, so that
        ``_persist`` sees a SAVE another replica finished meanwhile."""
        archive.drop_sidecar(self.cfg, self.rank)
        self._sidecar_at_decision = decide.record_stamp(archive.sidecar_path(self.cfg, self.rank))
        self._archive_at_decision = decide.archive_stamp(self.path)

    @property
    def device(self) -> int:
        return self.gpu_id if self.gpu_id is not None else 0

    def check_archive(self) -> None:
        """LOAD, before the region is reserved or any model memory allocated: verify the core
        archive against this machine and this configuration (GPU properties only). ``fc.load``
        checks the same later, once the model is built; refusing here lets an ``auto`` start fall
        back to a SAVE instead of failing."""
        verified, reason = decide.verify_archive(
            self.cfg, self.rank, device=self.device, fingerprint=self.fingerprint, world_size=self.world_size
        )
        if reason is None:
            saved_slots = (getattr(verified, "meta", None) or {}).get("slots")
            if saved_slots is not None and saved_slots != self.sidecar["slots"]:
                reason = "pool sizing differs between the core archive and its .sglang.json"
        if reason is None:
            import foundry_core as fc

            if isinstance(verified, fc.Archive):  # held in memory: fc.load takes it instead of re-reading
                self._verified = verified
                # Where the check's time goes (it is most of Foundry's share of a LOAD's start).
                self.report["check_archive_split"] = dict(getattr(verified, "open_timings", {}))
            return
        decide.after_refusal(self.cfg, self.rank, self.world_size, reason, FoundrySessionError, logger)
        self.mode = "save"
        self.sidecar = None
        self._invalidate_sidecar()  # the old archive is invalid until the new one is saved
        settings.set_mode(self.server_args, "save")
        self.report.update(mode="save", fallback=reason)

    # -- step 2 -------------------------------------------------------------------------------
    def enter_region(self, gpu_id: int | None) -> None:
        if self.region is not None:
            return
        import foundry_core as fc

        device = gpu_id if gpu_id is not None else self.gpu_id
        self.region = fc.Region(
            base=self.cfg.rank_region_base(self.rank), size=self.cfg.region_size, device=device
        )
        self._routing.enter_context(self.region.routing())
        if self.tp_size > 1:
            from foundry_core.engine.tensor_parallel import SymmetricTP

            self.tp = SymmetricTP(self.region, self.tp_rank, self.tp_size)
        if self.mode == "load":  # overlaps the weights and KV pools that follow; fc.load takes it
            from foundry_core.engine import prepare

            self._prepared = prepare.start(
                str(self.path),
                cfg=self.cfg,
                rank=self.rank,
                device=device,
                archive=self._verified,
                log=logger,
            )

    # -- tensor parallelism (docs/sglang.md): SGLang's collectives through placed symmetric memory --
    def init_symm_communicator(self, comm: Any, group: Any, device: Any) -> None:
        """Set up SGLang's ``TorchSymmMemCommunicator`` ``comm`` on Foundry's symmetric memory: its
        buffer sized as SGLang sizes it, allocated and rendezvoused at fixed addresses during the
        setup SAVE and LOAD share (SGLang builds its communicators before the model), recorded for
        the archive, and kept without NVLink multicast (SGLang's own set-up drops it then, and its
        all-reduces fall back to NCCL, which no archive can hold)."""
        import torch
        import torch.distributed as dist
        from sglang.srt.distributed.device_communicators.all_reduce_utils import (
            TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES,
        )

        device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        comm.disabled, comm.buffer, comm.max_size = True, None, 0
        comm.dtype, comm.device, comm.group = torch.bfloat16, device, group
        comm.world_size = dist.get_world_size(group)
        comm.device_capability = torch.cuda.get_device_capability(device)[0]
        sizes = TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES.get(comm.device_capability) or {}
        if comm.world_size not in sizes:
            raise FoundrySessionError(
                f"SGLang sizes no symmetric-memory all-reduce for compute capability "
                f"{comm.device_capability} and {comm.world_size} ranks: its all-reduces would run "
                "through NCCL, which Foundry cannot restore"
            )
        comm.max_size = sizes[comm.world_size]
        comm.buffer = self.tp.allocate(
            f"{TP_ALL_REDUCE}/{group.group_name}",
            comm.max_size // comm.dtype.itemsize,
            comm.dtype,
            device,
            group.group_name,
        )
        comm.disabled = False

    def symm_all_reduce(self, comm: Any, inp: Any, out: Any = None) -> Any:
        """``TorchSymmMemCommunicator.all_reduce`` on Foundry's buffer (None: not this path's tensor,
        SGLang then reduces it another way, as it would)."""
        if not comm.should_torch_symm_mem_allreduce(inp):
            return None
        return self.tp.all_reduce(comm.buffer, inp, comm.group.group_name, out=out)

    def allocate_logits_gather(self, model_runner: Any) -> None:
        """The buffer the decode graphs gather the vocabulary-parallel logits through, allocated at the
        start of the decode-graph phase in SAVE and LOAD alike (SGLang's own gatherer allocates at its
        first call, which a LOAD makes later, and needs NVLink multicast)."""
        if self.tp is None or self.tp.has_gather(TP_LOGITS):
            return
        import torch
        from sglang.srt.distributed.parallel_state import get_tp_group

        lm_head = getattr(getattr(model_runner, "model", None), "lm_head", None)
        shard = getattr(lm_head, "num_embeddings_per_partition", None)
        _backend, sizes = graph_phase(self.server_args, "decode")
        if shard is None or not sizes:
            raise FoundrySessionError(
                "cannot size the logits gather for tensor parallelism (no lm_head.num_embeddings_per_partition "
                "or no explicit decode graph size)"
            )
        group = get_tp_group().cpu_group
        self.tp.allocate_gather(
            TP_LOGITS,
            rows=max(sizes),
            width=int(shard) * self.tp_size,
            dtype=torch.bfloat16,
            device=torch.device("cuda", self.device),
            group_name=group.group_name,
        )

    def gather_logits(self, x: Any) -> Any | None:
        """The decode graphs' logits all-gather through Foundry's buffer; None where ``x`` does not fit
        it (an eager prefill larger than the decode graphs' batch: SGLang's NCCL gather, outside any
        graph)."""
        if self.tp is None or not self.tp.has_gather(TP_LOGITS):
            return None
        return self.tp.gather_last_dim(TP_LOGITS, x)

    # -- step 3 -------------------------------------------------------------------------------
    def pool_config(self, resolve: Any, config_cls: Any) -> Any:
        """SAVE: run SGLang's profiling ``resolve()`` and record the result. LOAD: rebuild it."""
        if self.mode == "save":
            config = resolve()
            self.slots = {
                "memory_pool_config": dataclasses.asdict(config),
                "max_mamba_cache_size": _schedule_value("max_mamba_cache_size"),
            }
            return config
        _mirror_profiling_side_effects()
        slots = self.sidecar["slots"]
        if slots.get("max_mamba_cache_size") is not None:
            _override_schedule("foundry.load", max_mamba_cache_size=slots["max_mamba_cache_size"])
        self.slots = slots
        return config_cls(**slots["memory_pool_config"])

    # -- step 4 -------------------------------------------------------------------------------
    def capture_begins(self) -> None:
        """Start of the decode runner's capture: everything built so far (model, pools, static
        graph buffers, attention graph state) is the setup a LOAD repeats. SAVE marks that point;
        LOAD restores the archive there, before any warmup (or, failing, captures instead)."""
        if self.capture_started:
            raise FoundrySessionError(
                "decode graphs are being captured a second time in this process (PD role switch or "
                "elastic EP recapture); Foundry archives one capture"
            )
        self.capture_started = True
        self._t_capture = time.perf_counter()
        self._captures_at_capture = _stream_captures()
        if self.mode == "save":
            self.region.end_setup()
            return
        try:
            self.restore()
            return
        except Exception as e:
            failure = e
        self._capture_instead(failure)

    def _capture_instead(self, failure: Exception) -> None:
        """The restore failed after the archive was accepted: auto mode on one rank captures as stock
        would and serves (``decide.after_load_failure``); otherwise the start stops with one line."""
        if self.restored is not None:  # restored, then found not to fit: give its memory back
            self.restored.unload()
            self.restored = None
        line = decide.after_load_failure(
            self.cfg, self.rank, self.world_size, failure, FoundrySessionError, logger
        )
        self.mode = "capture"
        self.report.update(mode="capture", fallback=line)

    def capture_done(self) -> None:
        """End of the decode runner's capture: SAVE captured every shape, LOAD installed them."""
        if self._t_capture is None:
            return
        seconds = time.perf_counter() - self._t_capture
        self.report["restore_s" if self.mode == "load" else "capture_s"] = round(seconds, 4)

    def graph_pool(self) -> Any:
        return self.region.graph_pool_id()

    def restore(self) -> None:
        if self.restored is not None:
            return
        from foundry_core.engine import prepare

        t0 = time.perf_counter()
        self.restored = prepare.load(
            str(self.path),
            cfg=self.cfg,
            rank=self.rank,
            world_size=self.world_size,
            region=self.region,
            fingerprint=self.fingerprint,
            archive=self._verified,  # read and checked by check_archive
            prepared=self._prepared,  # rebuilt since enter_region
            symmetric=self.tp.buffers if self.tp is not None else (),
        )
        self._verified = self._prepared = None
        self.report["archive_digest"] = self.restored.digest
        # What the restored graphs communicate with, per kind (symm_mem under tensor parallelism;
        # an NCCL kernel was refused at SAVE).
        self.report["collectives"] = dict(self.restored.archive.meta.get("collectives") or {})
        self.report["fc_load_s"] = round(time.perf_counter() - t0, 4)
        self.report["fc_load_timings"] = timings = dict(getattr(self.restored, "timings", {}) or {})
        self.report.update(prepare.report(timings))
        if self.restored.slots != self.sidecar["slots"]:
            raise FoundrySessionError(
                f"archive {self.path}: pool sizing differs between the core archive and its .sglang.json"
            )

    def restored_graph(self, shape_key: Any) -> tuple[Any, Any]:
        name = _shape_name(shape_key)
        layouts = self.sidecar["outputs"]
        if name not in layouts or name not in self.restored.graphs:
            raise FoundrySessionError(
                f"archive {self.path} has no decode graph {name}; the capture shapes changed"
            )
        self.installed.add(name)
        return self.restored.graphs[name], unflatten(layouts[name], self.restored.tensors)

    def record(self, shape_key: Any, graph: Any, output: Any) -> None:
        name = _shape_name(shape_key)
        layout, tensors = flatten(output, f"out/{name}")
        self.graphs[name] = graph
        self.layouts[name] = layout
        self.tensors.update(tensors)

    # -- step 6 -------------------------------------------------------------------------------
    def finish(self) -> None:
        try:
            self._count_captures()
            if self.mode == "save":
                self._persist()
            elif self.mode == "capture":  # a LOAD that failed at the graph phase: nothing to persist
                self.report.update(saved=False)
            else:
                missing = sorted(set(self.sidecar["outputs"]) - self.installed)
                if missing:
                    raise FoundrySessionError(f"decode graphs {missing} were archived but not installed")
                self.report["graphs"] = len(self.installed)
            self.report["ok"] = True
        except BaseException as e:
            self.report.update(ok=False, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._routing.close()
            _stop_recording()
            self.report["caches"] = self.caches.finish()
            self.write_report()
            if self.mode == "save" and self.report.get("saved"):
                self._record_reads()

    def _record_reads(self) -> None:
        """What this scheduler read to start, for a LOAD to read ahead (foundry_core.engine.readahead)."""
        from foundry_core.engine import readahead

        model = getattr(self.server_args, "model_path", None)
        readahead.record_later(
            self.cfg.archive_dir,
            f"rank{self.rank}",
            caches_dir=self.cfg.rank_caches_dir(self.rank),
            rank_dir=self.path,
            model=model,
            log=logger,
        )

    def _persist(self) -> None:
        if self.slots is None:
            raise FoundrySessionError(
                "memory-pool sizing was not recorded (this SGLang release lacks the sizing hook); nothing saved"
            )
        if not self.graphs:
            raise FoundrySessionError(
                "no decode graph was captured through the Foundry backend; nothing saved"
            )
        import foundry_core as fc

        self.report["graphs"] = len(self.graphs)
        path = archive.sidecar_path(self.cfg, self.rank)
        published = archive.read_sidecar(self.cfg, self.rank) or {}
        finished_here = published.get("fingerprint") == self.fingerprint
        if decide.published_meanwhile(self.cfg, path, self._sidecar_at_decision, finished_here):
            self._keep_other_save("saved this configuration meanwhile; keeping its archive")
            return
        logger.info("Foundry SAVE: writing %d decode graphs to %s", len(self.graphs), self.path)
        t0 = time.perf_counter()
        try:
            save_timings: dict[str, float] = {}
            self.report["archive_digest"] = fc.save(
                str(self.path),
                graphs=self.graphs,
                tensors=self.tensors,
                region=self.region,
                fingerprint_model=self.fingerprint,
                slots=self.slots,
                rank=self.rank,
                world_size=self.world_size,
                # SGLang samples outside its decode graphs, and replaying them here would run on
                # whatever its buffers hold after capture: no replay to look for RNG state.
                detect_rng=False,
                timings=save_timings,
                symmetric=self.tp.buffers if self.tp is not None else (),
                # auto: keep the archive of a replica that decided at the same moment and came first
                **decide.save_guard(self.cfg, self._archive_at_decision),
            )
            self.report["fc_save_s"] = round(time.perf_counter() - t0, 4)
            self.report["fc_save_timings"] = {k: round(v, 4) for k, v in save_timings.items()}
            ours = decide.archive_stamp(self.path)
            # Everything SGLang built so far (the decode capture's first-use kernels included); the
            # sidecar, written last, marks the SAVE finished.
            self.caches.save(self.device)
            if decide.archive_stamp(self.path) != ours:
                self._keep_other_save("published an archive meanwhile; keeping it")
                return
            archive.write_sidecar(
                self.cfg,
                self.rank,
                {"fingerprint": self.fingerprint, "slots": self.slots, "outputs": self.layouts},
            )
        except fc.ArchiveSuperseded:  # raised before anything was written
            self._keep_other_save("published an archive meanwhile; keeping it")
            return
        # Disk full, read-only, a graph that cannot be saved, or a defect in Foundry's own SAVE code:
        # the graphs just captured are untouched and nothing partial is published, so auto serves on.
        except Exception as e:
            decide.save_failed(self.cfg, self.rank, e, logger)  # auto: serve on; save: raise
            self.report.update(saved=False, save_error=decide.save_error(e))
            return
        self.report["saved"] = True
        logger.info("Foundry SAVE: %d decode graphs persisted to %s", len(self.graphs), self.path)

    def _keep_other_save(self, what: str) -> None:
        """auto: another replica's SAVE stays; this rank publishes nothing."""
        logger.info("Foundry SAVE: another process %s", what)
        self.report.update(saved=False, kept_other_save=True)

    def replay_timing_done(self, summary: dict[str, Any]) -> None:
        """The timed replays (``FOUNDRY_SGLANG_REPLAY_TIMING``) are done: report their medians."""
        self.report["replay_timing"] = summary
        self.write_report()

    def abort(self, error: BaseException | None = None) -> None:
        self._routing.close()
        self._count_captures()
        _stop_recording()
        self.report["ok"] = False
        if error is not None:
            self.report["error"] = f"{type(error).__name__}: {error}"
        self.write_report()

    def _count_captures(self) -> None:
        """Stream captures (CUPTI: runtime and driver API) since the decode capture began, and in the
        whole process since recording started. A LOAD must show none in the decode-graph phase."""
        now = _stream_captures()
        if now is None:
            return
        self.report["stream_captures_total"] = now
        if self._captures_at_capture is not None:
            self.report["decode_phase_stream_captures"] = {
                k: now[k] - self._captures_at_capture.get(k, 0) for k in now
            }

    def write_report(self) -> None:
        """Log the report and write it to ``$FOUNDRY_SGLANG_REPORT_DIR/rank<r>.json`` when that is set."""
        logger.info("Foundry %s report: %s", self.mode.upper(), json.dumps(self.report, sort_keys=True))
        directory = os.environ.get(REPORT_ENV)
        if not directory:
            return
        try:
            write_json_atomic(os.path.join(directory, f"rank{self.rank}.json"), self.report)
        except OSError as e:  # a report must never take the server down
            logger.warning("Foundry: cannot write the report to %s: %s", directory, e)


def settle(server_args: Any, replica: int | None = None) -> tuple[Any, str] | None:
    """(FoundryConfig, mode) for a record, after the refusal rules; None when Foundry is off. A mode
    the launcher already settled (on the record, or exported) is kept. The launcher's mode may name
    one mode per data-parallel replica (``load,save``: :func:`archive.decide_mode`); a scheduler
    (``replica``: its data-parallel rank, None without data parallelism) gets its replica's."""
    cfg = settings.load(server_args)
    if cfg is None:
        return None
    from foundry_core.engine import release

    cfg = release.gate("sglang", cfg, logger)  # before anything else: an untested release is refused
    check_supported(server_args)
    mode = settings.requested(server_args).mode or _env_mode() or cfg.mode
    if mode == "auto":
        mode = archive.decide_mode(server_args, cfg)
    elif mode == "load" and not archive.complete(server_args, cfg):
        raise FoundrySessionError(
            f"mode=load but {cfg.archive_dir} holds no complete archive for this configuration; "
            "run once with mode=save (or auto)"
        )
    if "," in mode and replica is not None:
        try:
            mode = archive.replica_mode(mode, replica)
        except ValueError as e:
            raise FoundrySessionError(str(e)) from None
    return cfg, mode


def _time_steps(session: Session, begin_s: dict[str, float]) -> None:
    """Foundry's critical-path steps of this rank (the launcher's included) in its start report."""
    from foundry_core.engine import start_method, startwork
    from foundry_core.engine.startsteps import StartSteps

    session.report["scheduler_start"] = start_method.chosen()  # fork or spawn, and why (sched_start)
    session.report["start_work"] = startwork.listing("sglang", session.mode)  # skipped/kept, and why
    steps = StartSteps(session.report)
    steps.add_all({k.removesuffix("_s"): v for k, v in begin_s.items() if k != "total_s"})
    steps.close(session.rank, logger)


def _engine_facts() -> dict[str, Any]:
    """What carried caches are valid for on SGLang's side (versions of its kernel packages)."""
    return {
        "name": "sglang",
        "sglang": archive.package_version("sglang"),
        "sglang-kernel": archive.package_version("sglang-kernel"),
    }


_stream_captures = capture.stream_captures


def _stop_recording() -> None:
    capture.stop_recording(logger)


def _mirror_profiling_side_effects() -> None:
    """LOAD skips SGLang's memory profiling (``KVCacheConfigurator._profile_available_bytes``) and
    repeats what of it changes the allocator's state, in its order: a full ``gc.collect()`` (0.5.2x:
    it frees weight-loading temporaries still held in reference cycles, so their blocks go back to
    torch's cache) and then emptying that cache (``get_available_gpu_memory(empty_cache=True)``).
    Without the collection those temporaries die later, at a different point of LOAD's setup than
    of SAVE's, and the setup's allocations no longer retrace SAVE's. The free-memory reading itself
    (and, with several ranks, its all-reduce over the CPU group) changes nothing on the device."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _env_mode() -> str | None:
    import os

    if not settings.worker_enabled():
        return None
    mode = os.environ.get(settings.REPLICA_MODES_ENV) or os.environ.get("FOUNDRY_MODE")
    return mode if archive.is_mode(mode) else None


def _schedule_value(name: str) -> Any:
    try:
        from sglang.srt.runtime_context import get_schedule
    except ImportError:  # releases that keep it on ServerArgs: part of the fingerprint there
        return None
    try:
        return getattr(get_schedule(), name, None)
    except ValueError:  # configuration not published: not inside a scheduler process
        return None


def _override_schedule(source: str, **values: Any) -> None:
    from sglang.srt.runtime_context import get_context

    get_context().override(source, **values)
