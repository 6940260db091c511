"""Foundry state of one vLLM worker: configuration, SAVE/LOAD decision, region, archive I/O.

Kept apart from :mod:`foundry_vllm_plugin.worker` (which subclasses vLLM's GPU worker) so that its
bookkeeping can be tested without importing vLLM's GPU modules.  GPU work starts in :meth:`open`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any

from foundry_vllm_plugin import archive, graphs, settings

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
        self.setup: dict | None = None  # region layout when the setup ended (segments, cursor)

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
        import torch

        import foundry_core as fc

        # Free blocks cached after warmup would otherwise be snapshotted into the archive as live state.
        if torch.cuda.is_available():
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
            "setup": self.setup,
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
            expected_digest=self.cfg.digest_for_rank(self.rank),
            trusted_root=self.cfg.archive_dir,  # the archive must resolve inside the configured directory
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
