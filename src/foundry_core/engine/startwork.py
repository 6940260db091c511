"""What an engine does at start only to compile or capture, and what a LOAD does with it, with reasons.

Each engine's start has steps whose only product is compiled code, captured graphs or measured
sizes. A LOAD skips those the archive makes unnecessary and keeps the others; the start report
lists both (``start_work``), each with its reason, so that what is left of a LOAD start can be
placed without reading the plugin. The tables below say what the plugins do (the hooks named), and
are kept with them: a step changes from kept to skipped only with the hook that skips it.

A step that allocates GPU memory before the graphs are restored is kept even where its product
is not needed: a LOAD's allocations must land where the SAVE's did (the graphs hold raw device
pointers), so the setup a SAVE went through is the setup a LOAD repeats.
"""

from __future__ import annotations

from typing import Any

SKIPPED, KEPT = "skipped", "kept"

# (step, action at LOAD, reason)
SGLANG: tuple[tuple[str, str, str], ...] = (
    (
        "KV-pool memory profiling",
        SKIPPED,
        "the SAVE's pool sizing comes with the archive (hooks.around_resolve_memory_pool_config)",
    ),
    (
        "decode-graph warmup and capture",
        SKIPPED,
        "the decode graphs are restored from the archive (hooks.around_decode_capture, around_runner_warmup)",
    ),
    (
        "gc.collect pair around the capture loop (freeze_gc)",
        SKIPPED,
        "nothing is captured at LOAD (hooks.around_freeze_gc)",
    ),
    (
        "Triton/Inductor/FlashInfer/TVM-FFI/DeepGEMM/CUDA compilation",
        SKIPPED,
        "served from the carried caches where their keys match (CacheHandover); a key that changed "
        "compiles and is reported in caches.new_files",
    ),
    (
        "eager-runner warmup before the capture",
        KEPT,
        "its allocations must retrace the SAVE's before the graphs are restored",
    ),
    (
        "server warmup request (first prefill)",
        KEPT,
        "prefill runs eagerly (no archived graph); its kernels load from the carried caches, and "
        "the request is how SGLang marks the server ready",
    ),
)

VLLM: tuple[tuple[str, str, str], ...] = (
    (
        "KV-cache memory profiling (profile_run)",
        SKIPPED,
        "the SAVE's KV-cache size comes with the archive (worker.determine_available_memory)",
    ),
    (
        "CUDA-graph capture (capture_model)",
        SKIPPED,
        "the graphs are restored from the archive (worker.compile_or_warm_up_model)",
    ),
    (
        "torch.compile / Triton / FlashInfer compilation",
        SKIPPED,
        "served from the carried caches where their keys match (CacheHandover)",
    ),
    (
        "compile-size warmup runs (_dummy_run per size) and kernel_warmup",
        KEPT,
        "they allocate before the graphs are restored (the LOAD retraces the SAVE's allocations) "
        "and autotune state the graphs' kernels were captured with",
    ),
)

TABLES = {"sglang": SGLANG, "vllm": VLLM}


def listing(engine: str, mode: str) -> list[dict[str, Any]]:
    """The engine's start work for a start in ``mode``: at LOAD as the table says, otherwise all kept."""
    rows = TABLES.get(engine, ())
    if mode != "load":
        return [
            {"step": s, "action": KEPT, "reason": f"mode {mode}: the engine compiles and captures"}
            for s, _, _ in rows
        ]
    return [{"step": s, "action": a, "reason": r} for s, a, r in rows]
