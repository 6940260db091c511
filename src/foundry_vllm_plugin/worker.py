"""The Foundry GPU worker: vLLM's GPU worker with SAVE/LOAD of its full decode CUDA graphs.

vLLM imports this module only in a worker process of an engine with Foundry on (the front end set
``parallel_config.worker_cls`` to :class:`FoundryWorker`).  Sequence in one worker, for both modes:

1. ``__init__``: ``check_supported`` again (no CUDA yet); parse the Foundry TOML.
2. ``init_device``: module recording starts first (before any kernel loads), then vLLM's own device
   setup; right after the device is set, the rank's fingerprint decides SAVE or LOAD (auto), the
   fixed-VA region is reserved and made vLLM's global CUDA-graph pool, and the model runner (its
   persistent input buffers) is built with allocations routed into the region.
3. ``load_model``: weights routed into the region.
4. ``determine_available_memory`` (not routed): LOAD sets ``kv_cache_memory_bytes`` from the manifest,
   which makes vLLM skip memory profiling and the throwaway CUDA-graph memory capture.  vLLM still runs
   ``profile_run`` once, which compiles the model or loads the torch.compile cache: prefill and mixed
   batches still run through the compiled model, so compilation is kept on LOAD.
5. ``initialize_from_config``: the KV cache (and attention metadata buffers) routed into the region;
   LOAD checks the block count.  This ends the *setup*, which SAVE and LOAD repeat identically; SAVE
   marks it with ``region.end_setup()``.
6. ``compile_or_warm_up_model``: ``capture_model`` is replaced on the runner instance.  SAVE runs vLLM's
   warmups and capture routed into the region (``keep_graph``), then persists graphs, the graph output
   buffers and the sizing; the core also snapshots eager state that warmups created after the setup.
   LOAD runs vLLM's kernel warmups outside the region (so the region holds exactly the setup when the
   core checks it), and in place of the capture restores the graphs: no per-graph warmup, no capture.

Nothing that only SAVE does (memory profiling, the throwaway profiling capture) is routed, so the
sequence of setup allocations in the region is the same at SAVE and at LOAD.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any

from vllm.v1.worker.gpu_worker import Worker as _VllmGpuWorker

from foundry_vllm_plugin import archive, graphs, settings
from foundry_vllm_plugin.support import check_supported

logger = logging.getLogger("vllm.foundry")  # under vLLM's logger: same handlers and level


def start_module_recording() -> None:
    """Start the core's CUDA module recorder (idempotent); the name differs between core revisions."""
    import foundry_core as fc

    start = getattr(fc, "start_module_recording", None) or fc.start_recording
    start()


class FoundrySession:
    """Foundry state of one worker: config, mode, region, fingerprint, sizing."""

    def __init__(self, vllm_config: Any):
        cfg = settings.foundry_config(vllm_config.additional_config)
        if cfg is None:  # pragma: no cover - the front end only installs this worker when enabled
            raise settings.ConfigError("FoundryWorker needs additional_config['foundry']")
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.rank = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        self.world_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        self.region = None
        self.mode: str | None = None
        self.manifest: dict | None = None
        self.fingerprint: dict | None = None
        self.kv_cache_memory_bytes: int | None = None
        self.num_gpu_blocks: int | None = None

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
        self.mode, self.manifest, why = archive.resolve_mode(self.cfg, self.rank, self.fingerprint)
        logger.info("Foundry rank %d: %s (%s)", self.rank, self.mode.upper(), why)
        self.region = fc.Region(
            base=self.cfg.rank_region_base(self.rank), size=self.cfg.region_size, device=index
        )
        # Every vLLM graph (V1 wrappers, V2 manager) takes this pool at construction time.
        from vllm.platforms import current_platform

        type(current_platform)._global_graph_pool = self.region.graph_pool_id()

    @contextlib.contextmanager
    def routing(self, label: str):
        """Allocations of this thread inside the block land in the region, tagged with ``label``."""
        if self.region is None:  # pragma: no cover - open() runs first
            raise RuntimeError("Foundry region used before it was opened")
        with self.region.routing(), self.region.label(label):
            yield

    def end_setup(self) -> None:
        if self.mode == "save":
            self.region.end_setup()

    def save(self, adapter: Any) -> None:
        import torch

        import foundry_core as fc

        # Free blocks cached after warmup would otherwise be snapshotted into the archive as live state.
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        graph_map, tensors, listing = adapter.collect()
        mpath = archive.manifest_path(self.cfg, self.rank)
        mpath.unlink(missing_ok=True)  # an interrupted SAVE must not leave a valid-looking archive behind
        sizing = {
            "kv_cache_memory_bytes": int(self.kv_cache_memory_bytes or 0),
            "num_gpu_blocks": int(self.num_gpu_blocks or 0),
            "runner": adapter.kind,
        }
        t0 = time.perf_counter()
        fc.save(
            archive.core_archive_dir(self.cfg, self.rank),
            graphs=graph_map,
            tensors=tensors,
            region=self.region,
            fingerprint_model=self.fingerprint,
            slots=dict(sizing),
            rank=self.rank,
            world_size=self.world_size,
        )
        archive.write_manifest(mpath, self.fingerprint, sizing, listing)
        logger.info(
            "Foundry rank %d: saved %d decode graphs to %s in %.2f s",
            self.rank,
            len(graph_map),
            archive.core_archive_dir(self.cfg, self.rank),
            time.perf_counter() - t0,
        )

    def restore(self, adapter: Any) -> int:
        import foundry_core as fc

        t0 = time.perf_counter()
        restored = fc.load(
            archive.core_archive_dir(self.cfg, self.rank),
            region=self.region,
            fingerprint_model=self.fingerprint,
            rank=self.rank,
            world_size=self.world_size,
            expected_digest=self.cfg.archive_digest,
        )
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
        n = adapter.install(restored, self.manifest.get("graphs", []) if self.manifest else [])
        logger.info(
            "Foundry rank %d: restored %d decode graphs in %.2f s (no warmup, no capture)",
            self.rank,
            n,
            time.perf_counter() - t0,
        )
        return n


class FoundryWorker(_VllmGpuWorker):
    """vLLM's GPU worker with Foundry SAVE/LOAD around model build, KV cache and graph capture."""

    def __init__(self, *args: Any, **kwargs: Any):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        check_supported(vllm_config)  # before vLLM's worker does anything
        self._foundry = FoundrySession(vllm_config)
        super().__init__(*args, **kwargs)

    # -- 2. device, region, model runner -------------------------------------------------------
    def init_device(self) -> None:
        start_module_recording()
        if hasattr(_VllmGpuWorker, "_init_workspace_and_model_runner"):
            super().init_device()  # calls our _init_workspace_and_model_runner at its end
            return
        # Older layout: the runner is built inside init_device; rebuild it inside the region.
        super().init_device()
        self._foundry.open(self.device)
        runner_cls = type(self.model_runner)
        self.model_runner = None
        gc.collect()
        with self._foundry.routing("vllm.runner"):
            self.model_runner = runner_cls(self.vllm_config, self.device)

    def _init_workspace_and_model_runner(self) -> None:
        self._foundry.open(self.device)
        with self._foundry.routing("vllm.runner"):
            super()._init_workspace_and_model_runner()

    # -- 3. weights -----------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with self._foundry.routing("vllm.weights"):
            super().load_model(*args, **kwargs)

    # -- 4. KV-cache sizing ---------------------------------------------------------------------
    def determine_available_memory(self) -> int:
        s = self._foundry
        if s.mode == "load":
            kv = int(s.manifest["sizing"]["kv_cache_memory_bytes"])
            self.cache_config.kv_cache_memory_bytes = kv
            logger.info(
                "Foundry rank %d: KV cache %d bytes from the archive; memory profiling skipped", s.rank, kv
            )
        available = super().determine_available_memory()
        s.kv_cache_memory_bytes = int(available)
        return available

    # -- 5. KV cache ----------------------------------------------------------------------------
    def initialize_from_config(self, kv_cache_config: Any) -> None:
        s = self._foundry
        if s.mode == "load":
            saved = int(s.manifest["sizing"].get("num_gpu_blocks", 0))
            if saved != int(kv_cache_config.num_blocks):
                raise graphs.FoundryRestoreError(
                    f"KV cache has {kv_cache_config.num_blocks} blocks, the archive was saved with {saved}"
                )
        with s.routing("vllm.kv_cache"):
            super().initialize_from_config(kv_cache_config)
        s.num_gpu_blocks = int(kv_cache_config.num_blocks)
        graphs.adapter_for(self.model_runner).check()  # before any capture or restore
        s.end_setup()

    # -- 6. warmup, then capture+save or restore -------------------------------------------------
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any):
        s = self._foundry
        runner = self.model_runner
        adapter = graphs.adapter_for(runner)
        vllm_capture = runner.capture_model

        def capture_model(*cargs: Any, **ckwargs: Any):
            if ckwargs.get("profile_only"):
                return vllm_capture(*cargs, **ckwargs)
            if s.mode == "load":
                s.restore(adapter)
                return 0
            with graphs.keep_captured_graphs():
                size = vllm_capture(*cargs, **ckwargs)
            s.save(adapter)
            return size

        runner.capture_model = capture_model
        try:
            if s.mode == "save":
                with s.routing("vllm.capture"):
                    return super().compile_or_warm_up_model(*args, **kwargs)
            return super().compile_or_warm_up_model(*args, **kwargs)
        finally:
            del runner.capture_model
