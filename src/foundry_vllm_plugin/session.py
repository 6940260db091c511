"""Foundry state of one vLLM worker: configuration, SAVE/LOAD decision, region, archive I/O.

Kept apart from :mod:`foundry_vllm_plugin.worker` (which subclasses vLLM's GPU worker) so that its
bookkeeping can be tested without importing vLLM's GPU modules.  GPU work starts in :meth:`open`.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import time
from typing import Any

from foundry_core.engine import capture, decide
from foundry_vllm_plugin import archive, graphs, settings, workspace

logger = logging.getLogger("vllm.foundry")  # under vLLM's logger: same handlers and level

#: The compile and JIT caches a vLLM engine process fills (foundry_core.engine.caches.KINDS).
CACHE_KINDS = (
    "vllm",
    "inductor",
    "triton",
    "tvm-ffi",
    "flashinfer",
    "flashinfer-autotune",
    "deep-gemm",
    "humming",
    "cuda",
)
#: Carried files the API server reads itself, before it starts the engine core: the registry's
#: model-inspection records (``$VLLM_CACHE_ROOT/modelinfos``), each keyed by its model file's hash.
LAUNCHER_RECORDS = {"vllm": ("modelinfos/",)}
#: vLLM's compile-cache switches that turn its one-artifact load off (read as vLLM 0.26 reads them).
_AOT_OFF = {
    "VLLM_USE_STANDALONE_COMPILE": "0",
    "VLLM_USE_AOT_COMPILE": "0",
    "VLLM_DISABLE_COMPILE_CACHE": "1",
}


def launch_settings() -> dict[str, tuple[str, str]]:
    """vLLM settings for a shorter start, set in the API server for every Foundry start where the
    user set nothing (``foundry_core.engine.launch_env``). vLLM leaves the start method out of its
    compile-cache key; the artifact switch changes how the compiled graph is stored and loaded and
    is in that key, which SAVE and LOAD share (on the H200, 2026-12-03, a LOAD with it computed what
    its SAVE did, bitwise; its stock comparison is still to run)."""
    out = {
        # vLLM's CLI assigns "spawn" before it loads plugins: its engine core then starts a new
        # interpreter that imports torch, transformers and vLLM again (about 15 s of a cold start
        # on the H200 machine, 2026-12-03). vLLM itself forks by default as a library, and falls
        # back to spawn where CUDA is already initialised in the parent.
        "VLLM_WORKER_MULTIPROC_METHOD": (
            "fork",
            "the engine core forks from the API server instead of importing vLLM again",
        ),
    }
    if not any(os.environ.get(k) == v for k, v in _AOT_OFF.items()):
        # vLLM's default from torch 2.12; on 2.11 its load re-splits the graph (2.8 s of 4.2 s).
        out["VLLM_USE_MEGA_AOT_ARTIFACT"] = (
            "1",
            "torch.compile's cached artifact loads whole, without a re-split",
        )
    return out


def start_module_recording() -> None:
    """Start the core's CUDA module recorder, keeping images (idempotent)."""
    capture.start_recording()


def count_captures_only() -> None:
    """LOAD: keep counting stream captures but stop copying module images."""
    capture.start_recording(keep_images=False)


def stop_module_recording() -> None:
    capture.stop_recording(logger)


def engine_facts() -> dict[str, Any]:
    """What carried caches are valid for on vLLM's side."""
    from foundry_core.fingerprint import package_version

    return {"name": "vllm", "vllm": package_version("vllm")}


def stream_captures() -> int | None:
    """CUDA stream captures begun in this process since module recording started (CUPTI), or None."""
    counts = capture.stream_captures()
    return None if counts is None else int(sum(counts.values()))


# The call in vLLM's init_device (releases without _init_workspace_and_model_runner) that comes right
# before the model runner is built; Foundry opens the region and starts routing there.
_RUNNER_BUILD_HOOK = "init_workspace_manager"


@contextlib.contextmanager
def route_runner_build(module: Any, open_and_route) -> Any:
    """While active, ``module.init_workspace_manager`` first calls ``open_and_route()``.

    ``open_and_route`` opens the Foundry region and returns a context manager (the routing); it is
    entered before vLLM's ``init_workspace_manager`` runs and left when this block ends, so the
    workspace manager, the model runner and anything else ``init_device`` builds after that call land
    in the region.  Yields a one-element list that tells whether the hook fired.
    """
    original = getattr(module, _RUNNER_BUILD_HOOK, None)
    fired = [False]
    if original is None:
        yield fired
        return
    stack = contextlib.ExitStack()

    def hooked(*args: Any, **kwargs: Any):
        if not fired[0]:
            fired[0] = True
            stack.enter_context(open_and_route())
        return original(*args, **kwargs)

    setattr(module, _RUNNER_BUILD_HOOK, hooked)
    try:
        yield fired
    finally:
        setattr(module, _RUNNER_BUILD_HOOK, original)
        stack.close()


class FoundrySession:
    """Foundry state of one worker: config, mode, region, fingerprint, sizing."""

    def __init__(self, vllm_config: Any):
        cfg = settings.foundry_config(vllm_config.additional_config)
        if cfg is None:  # pragma: no cover - the front end only installs this worker when enabled
            raise settings.ConfigError("FoundryWorker needs additional_config['foundry']")
        from foundry_core.engine import release

        self.cfg = release.gate("vllm", cfg, logger)  # untested release allowed: LOADs structure-checked
        self.vllm_config = vllm_config
        self.rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        self.world_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        self.region = None
        self.mode: str | None = None
        self.manifest: dict | None = None
        self.fingerprint: dict | None = None
        self.kv_cache_memory_bytes: int | None = None
        self.num_gpu_blocks: int | None = None
        self.kv_layout: dict | None = None  # archive.kv_layout, once vLLM sized the KV cache
        self.setup: dict | None = None  # region layout when the setup ended (segments, cursor)
        self.workspace_locked: bool | None = None  # vLLM's workspace lock right after its capture (SAVE)
        self.workspace: dict | None = None  # SAVE: workspace.listing() of what was placed for the capture
        self.workspace_tensors: dict = {}  # SAVE: the placed workspace tensors, carried by name
        self.restored = None  # the core's Restored: owns the modules and memory the graphs use
        self.verified = None  # the core Archive check_core_archive read, until restore() hands it to load
        self.prepared = None  # LOAD: modules and graphs being rebuilt from open() on
        self.save_blocked: str | None = None  # SAVE decided in auto, but the archive_dir cannot be written
        self._capture_routing: contextlib.ExitStack | None = None
        self._pending_manifest: tuple | None = None  # SAVE: written once the caches are saved too
        self._ours: Any = None  # SAVE: decide.archive_stamp of the core archive this rank published
        self._manifest_at_decision: Any = None  # decide.record_stamp of the manifest when SAVE was decided
        self._core_at_decision: Any = None  # decide.archive_stamp of the core archive then
        from foundry_core.engine import CacheHandover

        self.caches = CacheHandover(cfg, self.rank, CACHE_KINDS, engine_facts(), self.world_size, logger)
        # What this start did, written next to the archive when graphs are ready (start report).
        self.report: dict[str, Any] = {
            "kind": archive.START_REPORT_KIND,
            "schema": archive.START_REPORT_SCHEMA,
            "rank": self.rank,
            "pid": os.getpid(),
            "phases_s": {},
        }

    def open(self, device: Any) -> None:
        """Decide SAVE/LOAD for this rank and reserve the region; needs the CUDA device to be current."""
        import torch

        import foundry_core as fc

        index = device.index if device.index is not None else torch.cuda.current_device()
        dev = {
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
        self.fingerprint = archive.engine_fingerprint(self.vllm_config, dev)
        self.report.update(vllm=self.fingerprint.get("vllm"), device=dev["name"])
        t0 = time.perf_counter()
        self.decide_mode(index)  # before the region is reserved and before any model memory
        from foundry_core.engine import prewarm

        # Background work only now, beside vLLM's setup: beside the steps above it slowed them
        # (prewarm's docstring). The archive checked in decide_mode inflates there too.
        prewarm.start(logger, archive=self.verified)
        self._time_steps(time.perf_counter() - t0)
        self.region = fc.Region(
            base=self.cfg.rank_region_base(self.rank), size=self.cfg.region_size, device=index
        )
        if self.mode == "load":  # overlaps weights, torch.compile and the KV cache; restore() takes it
            from foundry_core.engine import prepare

            self.prepared = prepare.start(
                archive.core_archive_dir(self.cfg, self.rank),
                cfg=self.cfg,
                rank=self.rank,
                device=index,
                archive=self.verified,
                log=logger,
            )
        # Every vLLM graph (V1 wrappers, V2 manager) takes this pool at construction time.
        from vllm.platforms import current_platform

        type(current_platform)._global_graph_pool = self.region.graph_pool_id()

    def _time_steps(self, decide_s: float) -> None:
        """Foundry's critical-path steps of this rank in its start report (startsteps)."""
        from foundry_core.engine import startwork
        from foundry_core.engine.startsteps import StartSteps

        self.report["start_work"] = startwork.listing("vllm", self.mode or "")  # skipped/kept, and why
        steps = StartSteps(self.report)
        caches_s = float(self.caches.report.get("restore_s") or 0.0)
        steps.add("caches", caches_s)
        steps.add("decide", decide_s - caches_s)
        steps.close(self.rank, logger)

    def decide_mode(self, device_index: int) -> str:
        """SAVE or LOAD for this rank (``self.fingerprint`` set); returns the reason.

        When the manifest says LOAD, the core archive is verified first (checksums, pinned digest,
        machine and model fingerprint; GPU properties only, no kernel): in ``auto`` mode a refused
        archive on a single-rank engine turns the start into a SAVE that replaces it, with a warning;
        with several data-parallel ranks, or in ``load`` mode, the refusal is a one-line error.
        Module recording keeps images unless the final mode is LOAD.
        """
        mode, manifest, why = archive.resolve_mode(self.cfg, self.rank, self.fingerprint)
        if mode == "load":
            refusal = self.check_core_archive(device_index)
            if refusal is not None:
                self.report["fallback"] = decide.after_refusal(
                    self.cfg, self.rank, self.world_size, refusal, archive.ArchiveStateError, logger
                )
                path = archive.core_archive_dir(self.cfg, self.rank)
                mode, manifest, why = "save", None, f"archive {path} refused ({refusal})"
                self.report["refused"] = refusal
        self.mode, self.manifest = mode, manifest
        # auto resolved to SAVE in a directory that cannot be written (read-only, not creatable):
        # say so now, and let save() skip the work whose result could not be written.
        self.save_blocked = decide.save_blocked(self.cfg, self.rank, logger) if mode == "save" else None
        if self.save_blocked is not None:
            self.report["save_error"] = self.save_blocked
        # SAVE: which manifest is there now, so that save() sees a SAVE another replica finished meanwhile
        self._manifest_at_decision = decide.record_stamp(archive.manifest_path(self.cfg, self.rank))
        self._core_at_decision = decide.archive_stamp(archive.core_archive_dir(self.cfg, self.rank))
        self.report.update(mode=mode, reason=why)
        logger.info("Foundry rank %d: %s (%s)", self.rank, mode.upper(), why)
        if mode == "load":  # before the model is built: torch.compile reads its cache next
            self.caches.restore(device_index)
        if mode == "load":
            try:  # a LOAD restores code from the archive; it needs no recorded images, only the counts
                count_captures_only()
            except Exception as e:  # an optimisation only
                logger.warning("Foundry rank %d: module images are still recorded (%s)", self.rank, e)
        return why

    def check_core_archive(self, device_index: int) -> str | None:
        """Verify this rank's core archive as ``foundry_core.load`` will; the one-line reason it is
        refused, or None when it would load.  Configuration errors (an unpinned rank) still raise."""
        verified, reason = decide.verify_archive(
            self.cfg, self.rank, device=device_index, fingerprint=self.fingerprint, world_size=self.world_size
        )
        import foundry_core as fc

        if isinstance(verified, fc.Archive):  # held in memory: restore() loads it without re-reading
            self.verified = verified
            # Where the check's time goes (most of "decide" in the start steps).
            self.report["check_archive_split"] = dict(getattr(verified, "open_timings", {}))
        return reason

    @contextlib.contextmanager
    def routing(self, label: str):
        """Allocations of this thread inside the block land in the region, tagged with ``label``."""
        if self.region is None:  # pragma: no cover - open() runs first
            raise RuntimeError("Foundry region used before it was opened")
        with self.region.routing(), self.region.label(label):
            yield

    def begin_capture_routing(self) -> None:
        """SAVE, when vLLM starts its capture: route it into the region until
        :meth:`end_capture_routing`, and first allocate vLLM's workspace there anew (its scratch and
        persistent resources, which profiling and warmups grew outside the region), so that the graphs
        point into memory the archive carries. vLLM's warmups before the capture (``kernel_warmup``,
        ``warmup_kernels``) run outside the region, at SAVE as at LOAD."""
        if self._capture_routing is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.routing("vllm.capture"))
            self._capture_routing = stack
            with self.region.label("vllm.workspace"):
                self.workspace_tensors, self.workspace = workspace.place()

    def end_capture_routing(self) -> None:
        """Stop the routing begun by :meth:`begin_capture_routing` (idempotent).

        Called as soon as vLLM's capture returns: ``foundry_core.save`` runs unrouted, as in the core's
        own SAVE sequence, and vLLM's later warmups allocate outside the region at SAVE as at LOAD.
        """
        stack, self._capture_routing = self._capture_routing, None
        if stack is not None:
            stack.close()

    def end_setup(self) -> None:
        """Close the setup (runner buffers, weights, KV cache) that SAVE and LOAD build identically.

        SAVE marks it in the region and records the layout; LOAD compares its layout with the record
        right away, so a divergence is reported before warmups rather than at restore time.
        """
        self.setup = {"segments": len(self.region.segments()), "cursor": int(self.region.cursor)}
        if self.mode == "save":
            self.region.end_setup()
            return
        saved = ((self.manifest or {}).get("sizing") or {}).get("setup")
        if saved is not None and saved != self.setup:
            raise graphs.FoundryRestoreError(
                f"region setup diverged from the SAVE: {self.setup['segments']} allocations ending at offset "
                f"{self.setup['cursor']:#x}, the SAVE made {saved['segments']} ending at {saved['cursor']:#x}"
            )

    def save(self, adapter: Any) -> None:
        if self.save_blocked is not None:  # warned (and reported) at the decision; serving on
            self.report["saved"] = False
            return
        import torch

        import foundry_core as fc

        # Free blocks cached after warmup would otherwise be snapshotted into the archive as live state.
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
        graph_map, tensors, listing = adapter.collect()
        mpath = archive.manifest_path(self.cfg, self.rank)
        sizing = {
            "kv_cache_memory_bytes": int(self.kv_cache_memory_bytes or 0),
            "num_gpu_blocks": int(self.num_gpu_blocks or 0),
            "kv_layout": self.kv_layout,
            "runner": adapter.kind,
            "setup": self.setup,
            "workspace_locked": self.workspace_locked,
            "workspace": self.workspace,
        }
        published = archive.read_manifest(mpath) or {}
        finished_here = published.get("fingerprint") == self.fingerprint
        if decide.published_meanwhile(self.cfg, mpath, self._manifest_at_decision, finished_here):
            self._keep_other_save("saved this configuration", graphs=len(graph_map))
            return
        core = archive.core_archive_dir(self.cfg, self.rank)
        # auto: a replica that decided to SAVE at the same moment may have published first; then its
        # archive stays, and so does its manifest (checked before the unlink below, again in fc.save)
        guard = decide.save_guard(self.cfg, self._core_at_decision)
        try:
            fc.archive.require_version(core, guard["expected_version"])
        except fc.ArchiveSuperseded:
            self._keep_other_save("published an archive", graphs=len(graph_map))
            return
        logger.info("Foundry rank %d: writing %d decode graphs to %s", self.rank, len(graph_map), core)
        t0 = time.perf_counter()
        try:
            # What the capture added to vLLM's workspace after it was placed (none placed: nothing
            # to compare); a LOAD of these graphs would fail at its first request.
            grown = workspace.grown_since(self.workspace) if self.workspace is not None else None
            if grown is not None:
                raise workspace.WorkspaceMismatch(f"{grown}; a LOAD could not hand that memory back to vLLM")
            mpath.unlink(missing_ok=True)  # an interrupted SAVE must not leave a valid-looking archive
            save_timings: dict[str, float] = {}
            self.report["archive_digest"] = fc.save(
                core,
                graphs=graph_map,
                tensors={**tensors, **self.workspace_tensors},
                region=self.region,
                fingerprint_model=self.fingerprint,
                slots=dict(sizing),
                rank=self.rank,
                world_size=self.world_size,
                # vLLM samples outside its decode graphs, and replaying them here would run on whatever
                # its persistent buffers hold after capture: no replay to look for RNG state.
                detect_rng=False,
                timings=save_timings,
                **guard,
            )
            self.report["save_timings_s"] = {k: round(v, 3) for k, v in save_timings.items()}
            self.workspace_tensors = {}  # saved; vLLM's manager holds what it still uses
        except fc.ArchiveSuperseded:  # under the lock, after a wait: nothing was written
            self._keep_other_save("published an archive", graphs=len(graph_map))
            return
        # Disk full, read-only, a graph that cannot be saved, or a defect in Foundry's own SAVE code:
        # the graphs just captured are untouched and nothing partial is published, so auto serves on.
        except Exception as e:
            decide.save_failed(self.cfg, self.rank, e, logger)  # auto: serve on; save: raise
            self.report.update(graphs=len(graph_map), saved=False, save_error=decide.save_error(e))
            return
        # The manifest marks the SAVE finished; it is written by publish(), after vLLM's warmups
        # (which go on compiling after the capture) and the caches they fill are saved too.
        self._pending_manifest = (mpath, self.fingerprint, sizing, listing)
        self._ours = decide.archive_stamp(core)
        elapsed = time.perf_counter() - t0
        self.report.update(graphs=len(graph_map), save_s=round(elapsed, 3), runner=adapter.kind)
        # Written, not yet published: another replica's SAVE may still replace it (publish()).
        logger.info(
            "Foundry rank %d: wrote %d decode graphs to %s in %.2f s; published with the manifest, "
            "after the compile caches",
            self.rank,
            len(graph_map),
            archive.core_archive_dir(self.cfg, self.rank),
            elapsed,
        )

    def _keep_other_save(self, what: str, **report: Any) -> None:
        """auto: another replica's SAVE stays (it ``what`` meanwhile); this rank publishes nothing."""
        logger.info("Foundry rank %d: another process %s meanwhile; keeping it", self.rank, what)
        self.report.update(report, saved=False, kept_other_save=True)

    def publish(self, device_index: int) -> None:
        """SAVE, at the end of the engine's startup: save the compile caches, then the manifest."""
        if self._pending_manifest is None:
            return
        self.caches.save(device_index)
        pending, self._pending_manifest = self._pending_manifest, None
        core = archive.core_archive_dir(self.cfg, self.rank)
        if decide.archive_stamp(core) != self._ours:  # another replica's SAVE replaced ours meanwhile
            self._keep_other_save("published an archive")
            return
        try:
            archive.write_manifest(*pending)
        except OSError as e:
            decide.save_failed(self.cfg, self.rank, e, logger)
            self.report.update(saved=False, save_error=decide.save_error(e))
            return
        self.report["saved"] = True
        logger.info("Foundry rank %d: archive published (manifest %s)", self.rank, pending[0])
        self._record_reads(core)

    def _record_reads(self, core: Any) -> None:
        """What this worker read to start, for a LOAD to read ahead (foundry_core.engine.readahead)."""
        from foundry_core.engine import readahead

        model = getattr(getattr(self.vllm_config, "model_config", None), "model", None)
        readahead.record_later(
            self.cfg.archive_dir,
            f"rank{self.rank}",
            caches_dir=self.cfg.rank_caches_dir(self.rank),
            rank_dir=core,
            model=model,
            log=logger,
        )

    def restore_or_capture(self, adapter: Any) -> bool:
        """LOAD at the graph phase: True when the graphs were restored and installed. False when the
        restore failed before any graph was installed and this start captures instead (``auto`` on
        one rank, ``decide.after_load_failure``; the mode is then ``capture``); otherwise it raises."""
        t0 = time.perf_counter()
        try:
            restored = self._load_checked(adapter)
        except Exception as e:
            failure = e
        else:
            self._install(adapter, restored, t0)
            return True
        line = decide.after_load_failure(
            self.cfg, self.rank, self.world_size, failure, graphs.FoundryRestoreError, logger
        )
        self.mode = "capture"
        self.report.update(mode="capture", fallback=line)
        return False

    def restore(self, adapter: Any) -> int:
        t0 = time.perf_counter()
        return self._install(adapter, self._load_checked(adapter), t0)

    def _load_checked(self, adapter: Any) -> Any:
        """``foundry_core.load`` of the rank's archive, checked against the manifest and this engine;
        a restore that does not fit is unloaded again before the error is raised."""
        from foundry_core.engine import prepare

        restored = prepare.load(
            archive.core_archive_dir(self.cfg, self.rank),
            cfg=self.cfg,
            rank=self.rank,
            world_size=self.world_size,
            region=self.region,
            fingerprint=self.fingerprint,
            archive=self.verified,  # read and checked by check_core_archive
            prepared=self.prepared,  # rebuilt since open()
        )
        self.verified = self.prepared = None
        try:
            self._check_fits(restored, adapter)
        except graphs.FoundryRestoreError:
            restored.unload()
            raise
        return restored

    def _check_fits(self, restored: Any, adapter: Any) -> None:
        sizing = (self.manifest or {}).get("sizing", {})
        slots = dict(getattr(restored, "slots", {}) or {})
        for key in ("kv_cache_memory_bytes", "num_gpu_blocks", "runner"):
            if key in slots and slots[key] != sizing.get(key):
                raise graphs.FoundryRestoreError(
                    f"archive slot {key}={slots[key]!r} disagrees with the manifest ({sizing.get(key)!r})"
                )
        if sizing.get("runner") != adapter.kind:
            raise graphs.FoundryRestoreError(
                f"archive was saved from model runner {sizing.get('runner')}, this engine uses {adapter.kind}"
            )
        try:
            workspace.check_restorable(sizing.get("workspace") or {}, restored.tensors)
        except workspace.WorkspaceMismatch as e:
            raise graphs.FoundryRestoreError(str(e)) from None

    def _install(self, adapter: Any, restored: Any, t0: float) -> int:
        sizing = (self.manifest or {}).get("sizing", {})
        n = adapter.install(restored, self.manifest.get("graphs", []) if self.manifest else [])
        self.restored = restored
        self.report["archive_digest"] = restored.digest
        # Leave vLLM's workspace as its own capture left it at SAVE: the SAVE's scratch and persistent
        # tensors (restored at their addresses, where the graphs point), then locked if it was.
        self.report["workspace_tensors"] = workspace.install(sizing.get("workspace") or {}, restored.tensors)
        if sizing.get("workspace_locked", True):
            workspace.lock()
        elapsed = time.perf_counter() - t0
        timings = getattr(restored, "timings", None)
        from foundry_core.engine import prepare

        self.report.update(
            graphs=n,
            restore_s=round(elapsed, 3),
            runner=adapter.kind,
            restore_timings_s={k: round(float(v), 3) for k, v in (timings or {}).items()},
            **prepare.report(timings or {}),
        )
        logger.info(
            "Foundry rank %d: restored %d decode graphs in %.2f s (no warmup, no capture)",
            self.rank,
            n,
            elapsed,
        )
        return n

    def write_report(self) -> dict:
        """Write the start report next to the archive (best effort: a read-only archive is fine)."""
        self.report.update(
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks=self.num_gpu_blocks,
            setup=self.setup,
            workspace_locked=self.workspace_locked,
            caches=self.caches.finish(),
        )
        # In the log too, on one line (as SGLang's plugin says it): the file is replaced at each start
        # and missing where the archive is read-only; benchmarks read the steps from here.
        mode = (self.mode or "start").upper()
        logger.info("Foundry rank %d: %s report: %s", self.rank, mode, json.dumps(self.report, default=str))
        path = archive.start_report_path(self.cfg, self.rank)
        try:
            archive.write_json_atomic(path, self.report)
        except OSError as e:
            # A read-only archive directory is a supported setup (LOAD only; auto warned at its
            # decision already): no second warning at every start for the report it cannot hold.
            read_only = e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
            logger.log(
                logging.INFO if read_only else logging.WARNING,
                "Foundry rank %d: start report not written to %s: %s",
                self.rank,
                path,
                e,
            )
        return self.report
