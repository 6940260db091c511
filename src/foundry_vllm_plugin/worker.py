"""The Foundry GPU worker: vLLM's GPU worker with SAVE/LOAD of its full decode CUDA graphs.

vLLM imports this module only in a worker process of an engine with Foundry on (the front end set
``parallel_config.worker_cls`` to :class:`FoundryWorker`).  Sequence in one worker, for both modes:

1. ``__init__``: ``check_supported`` again (no CUDA yet); the import heap set aside from the garbage
   collector (``foundry_core.engine.gcheap``); parse the Foundry TOML.
2. ``init_device``: module recording starts first (before any kernel loads), then vLLM's own device
   setup; right after the device is set, the rank's fingerprint decides SAVE or LOAD (auto), a core
   archive about to be loaded is verified (``foundry_core.verify``: in auto mode a refused one turns the
   start into a SAVE on a single-rank engine, and is an error otherwise), the fixed-VA region is
   reserved and made vLLM's global CUDA-graph pool, and the workspace manager and the model runner
   (its persistent input buffers) are built with allocations routed into the region.
   Recent releases build both in ``Worker._init_workspace_and_model_runner``, which is overridden;
   older ones (0.26) build them at the end of ``init_device`` right after ``init_workspace_manager``,
   so that call opens the region and starts the routing, which ends when ``init_device`` returns.
3. ``load_model``: weights routed into the region.
4. ``determine_available_memory`` (not routed): LOAD sets ``kv_cache_memory_bytes`` from the manifest,
   which makes vLLM skip memory profiling and the throwaway CUDA-graph memory capture.  vLLM still runs
   ``profile_run`` once, which compiles the model or loads the torch.compile cache: prefill and mixed
   batches still run through the compiled model, so compilation is kept on LOAD.  SAVE's throwaway
   capture leaves no workspace resource behind, and both modes end this step with the region's graph
   pool and an emptied allocator cache (``profiling_state``).
5. ``initialize_from_config``: the KV cache (and attention metadata buffers) routed into the region;
   LOAD checks the block count and layout.  This ends the *setup*, which SAVE and LOAD repeat
   identically; SAVE marks it with ``region.end_setup()``.
6. ``compile_or_warm_up_model``: ``capture_model`` is replaced on the runner instance.  vLLM's warmups
   before it (compile sizes, ``kernel_warmup``, 0.33's ``warmup_kernels``) run outside the region in
   both modes.  SAVE routes from the capture on: vLLM's workspace (scratch and persistent resources,
   grown by those warmups) is allocated anew in the region, vLLM captures (``keep_graph``), the routing
   ends, then graphs, graph output buffers, workspace tensors and sizing are persisted; the core also
   snapshots eager state created after the setup.  LOAD, in place of the capture, restores the graphs,
   hands vLLM's workspace manager the restored workspace tensors and locks it as SAVE's capture did:
   no per-graph warmup, no capture.  Either way the start report (``rank{r}.start.json``) is written.

7. ``execute_model`` (serving): after batches 1, 2, 4, ... a SAVE stores the compile caches again when
   the first requests built more kernels (on a background thread).

Nothing that only SAVE does (memory profiling, the throwaway profiling capture) is routed, so the
sequence of setup allocations in the region is the same at SAVE and at LOAD.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
import traceback
from typing import Any

from vllm.v1.worker.gpu_worker import Worker as _VllmGpuWorker

from foundry_core.engine import gcheap, inductor
from foundry_core.engine.profiling import profiled
from foundry_vllm_plugin import archive, graphs, workspace
from foundry_vllm_plugin.profiling_state import after_restore, neutral_profiling, settle_after_profiling
from foundry_vllm_plugin.session import (
    FoundrySession,
    route_runner_build,
    start_module_recording,
    stop_module_recording,
    stream_captures,
)
from foundry_vllm_plugin.support import check_supported

logger = logging.getLogger("vllm.foundry")  # under vLLM's logger: same handlers and level


def _one_line(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip().replace("\n", " | ")[-2000:]


class FoundryWorker(_VllmGpuWorker):
    """vLLM's GPU worker with Foundry SAVE/LOAD around model build, KV cache and graph capture."""

    def __init__(self, *args: Any, **kwargs: Any):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        check_supported(vllm_config)  # before vLLM's worker does anything
        t0 = time.perf_counter()
        # Before CUDA: the start's full gc.collect() passes then skip the import heap (gcheap).
        frozen = gcheap.freeze_import_heap()
        self._foundry = FoundrySession(vllm_config)
        self._foundry.report["gc_frozen"] = frozen
        # Before vLLM's worker initialises CUDA or compiles anything: private cache directories.
        self._foundry.caches.begin()
        inductor.pin_process(logger)  # for torch.compile calls that do not take vLLM's config
        self._foundry.report.setdefault("foundry_steps_s", {})["session"] = round(time.perf_counter() - t0, 4)
        # Set once the start is done: vLLM 0.33's kernel warmups run execute_model before it, and
        # only the batches served after it count as served (CacheHandover.served).
        self._serving = False
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time one worker step for the start report; a failing step writes the report with its error."""
        s = self._foundry
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as e:
            s.report["error"] = f"{name}: " + _one_line(e)
            s.write_report()
            raise
        finally:
            s.report["phases_s"][name] = round(time.perf_counter() - t0, 3)

    # -- 2. device, region, model runner -------------------------------------------------------
    def init_device(self) -> None:
        with self._phase("init_device"):
            start_module_recording()
            if hasattr(_VllmGpuWorker, "_init_workspace_and_model_runner"):
                super().init_device()  # calls our _init_workspace_and_model_runner at its end
                return
            # Older layout (0.26): init_device sets the device, calls init_workspace_manager, then builds
            # the model runner.  Open the region and route from that call to the end of init_device.
            module = sys.modules[_VllmGpuWorker.__module__]
            with route_runner_build(module, self._open_and_route_runner) as fired:
                super().init_device()
            if fired[0]:
                return
            # No such call: the runner was built outside the region; rebuild it inside.
            self._foundry.open(self.device)
            runner_cls = type(self.model_runner)
            self.model_runner = None
            gc.collect()
            with self._foundry.routing("vllm.runner"):
                self.model_runner = runner_cls(self.vllm_config, self.device)

    def _open_and_route_runner(self):
        self._foundry.open(self.device)
        return self._foundry.routing("vllm.runner")

    def _init_workspace_and_model_runner(self) -> None:
        with self._open_and_route_runner():
            super()._init_workspace_and_model_runner()

    # -- 3. weights -----------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with self._phase("load_model"), self._foundry.routing("vllm.weights"):
            super().load_model(*args, **kwargs)

    # -- 4. KV-cache sizing ---------------------------------------------------------------------
    def determine_available_memory(self) -> int:
        s = self._foundry
        with self._phase("determine_available_memory"):
            if s.mode == "load":
                kv = int(s.manifest["sizing"]["kv_cache_memory_bytes"])
                self.cache_config.kv_cache_memory_bytes = kv
                logger.info(
                    "Foundry rank %d: KV cache %d bytes from the archive; memory profiling skipped",
                    s.rank,
                    kv,
                )
                available = super().determine_available_memory()
            else:
                with neutral_profiling(self.model_runner, s):
                    available = super().determine_available_memory()
            settle_after_profiling(self.model_runner, s)
        s.kv_cache_memory_bytes = int(available)
        return available

    # -- 5. KV cache ----------------------------------------------------------------------------
    def initialize_from_config(self, kv_cache_config: Any) -> None:
        s = self._foundry
        with self._phase("initialize_from_config"):
            layout = archive.kv_layout(self.cache_config, kv_cache_config)
            if s.mode == "load":
                saved = int(s.manifest["sizing"].get("num_gpu_blocks", 0))
                if saved != int(kv_cache_config.num_blocks):
                    raise graphs.FoundryRestoreError(
                        f"KV cache has {kv_cache_config.num_blocks} blocks, the archive was saved with {saved}"
                    )
                saved_layout = s.manifest["sizing"].get("kv_layout")  # absent in older archives
                if saved_layout is not None and saved_layout != layout:
                    why = archive.fingerprint_mismatch(saved_layout, layout)
                    raise graphs.FoundryRestoreError(
                        f"KV cache layout differs from the archive's ({why[:300]})"
                    )
            with s.routing("vllm.kv_cache"):
                super().initialize_from_config(kv_cache_config)
            s.num_gpu_blocks = int(kv_cache_config.num_blocks)
            s.kv_layout = layout
            adapter = graphs.adapter_for(self.model_runner)
            adapter.check()  # before any capture or restore
            s.report["runner"] = adapter.kind
            s.report["attention_backends"] = sorted(graphs.attention_backend_names(self.model_runner))
            s.end_setup()

    # -- 6. warmup, then capture+save or restore -------------------------------------------------
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any):
        s = self._foundry
        runner = self.model_runner
        adapter = graphs.adapter_for(runner)
        vllm_capture = runner.capture_model
        t0 = time.perf_counter()
        marks: dict[str, float] = {}
        s.report["stream_captures"] = {"before_warmup": stream_captures()}

        def capture_model(*cargs: Any, **ckwargs: Any):
            if ckwargs.get("profile_only"):
                return vllm_capture(*cargs, **ckwargs)
            marks["graphs_begin"] = time.perf_counter()
            s.report["stream_captures"]["before_graphs"] = stream_captures()
            try:
                if s.mode == "load" and s.restore_or_capture(adapter):
                    after_restore(runner)
                    return 0
                if s.mode == "capture":  # the restore failed: vLLM captures as alone, nothing saved
                    size = vllm_capture(*cargs, **ckwargs)
                    s.report["capture_s"] = round(time.perf_counter() - marks["graphs_begin"], 3)
                    return size
                try:
                    # Routed from here only: vLLM's warmups before the capture ran outside the region,
                    # as they do at LOAD; the workspace they grew is placed in the region first.
                    s.begin_capture_routing()
                    with graphs.keep_captured_graphs():
                        size = vllm_capture(*cargs, **ckwargs)
                finally:
                    s.end_capture_routing()  # foundry_core.save runs unrouted
                s.report["capture_s"] = round(time.perf_counter() - marks["graphs_begin"], 3)
                s.report["stream_captures"]["after_capture"] = stream_captures()
                s.workspace_locked = workspace.locked()
                s.save(adapter)
                return size
            finally:
                marks["graphs_end"] = time.perf_counter()
                s.report["stream_captures"]["after_graphs"] = stream_captures()

        runner.capture_model = capture_model
        try:
            with profiled(f"vllm-compile-warmup-graphs-{s.mode}", s.rank, logger):
                result = super().compile_or_warm_up_model(*args, **kwargs)
            s.publish(self.device.index if self.device.index is not None else 0)
            self._serving = True
            return result
        except BaseException as e:
            s.report["error"] = "compile_or_warm_up_model: " + _one_line(e)
            raise
        finally:
            s.end_capture_routing()
            del runner.capture_model
            end = time.perf_counter()
            s.report["stream_captures"]["end"] = stream_captures()
            stop_module_recording()
            phases = s.report["phases_s"]
            phases["compile_or_warm_up_model"] = round(end - t0, 3)
            if "graphs_begin" in marks:
                phases["warmup_before_graphs"] = round(marks["graphs_begin"] - t0, 3)
                phases["graphs"] = round(marks.get("graphs_end", end) - marks["graphs_begin"], 3)
                phases["warmup_after_graphs"] = round(end - marks.get("graphs_end", end), 3)
            s.write_report()

    # -- 7. serving ------------------------------------------------------------------------------
    def execute_model(self, *args: Any, **kwargs: Any):
        output = super().execute_model(*args, **kwargs)
        # SAVE: kernels built at the first requests join the carried caches (a background save);
        # LOAD: what its first request built is reported. vLLM's own warmup steps are no requests.
        if self._serving:
            self._foundry.caches.served(self.device.index if self.device.index is not None else 0)
        return output
