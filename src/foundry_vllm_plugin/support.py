"""Which vLLM engine configurations Foundry can persist, decided before any GPU work.

A restored graph replays the exact kernels, launch parameters and device addresses that were captured.
It is only right when every pointer it holds lies in memory that Foundry lays out again at the same
address (the fixed-VA region) and when the engine would dispatch a batch to the same graph.  Anything
that puts graph-visible state elsewhere (communicators, cuMem pools, draft models, adapters, encoders)
or that captures graphs Foundry does not persist is refused here, with one line that says why.

Fields are read with ``getattr`` and a neutral default: a field missing from an older or newer release
means the feature does not exist there (feature detection rather than version compares).
"""

from __future__ import annotations

from typing import Any

from foundry_core.engine.refusal import FoundryUnsupportedError as _Refusal

FOUNDRY_CUDAGRAPH_MODE = "FULL_DECODE_ONLY"
# The worker classes Foundry knows how to extend; anything else replaces the code Foundry hooks.
VLLM_GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
FOUNDRY_WORKER = "foundry_vllm_plugin.worker.FoundryWorker"
# Attention backends whose decode graphs keep all graph-visible metadata in buffers allocated when the
# metadata builder is created (inside the Foundry region, before capture).  Others may create state
# during capture, which LOAD does not run; they stay refused until a GPU run validates them.
VALIDATED_ATTENTION_BACKENDS = frozenset({"FLASH_ATTN"})
# Hybrid architectures whose recurrent-state caches Foundry lays out again: gated-delta-net layers,
# whose conv and SSM states are views into the KV cache tensors vLLM allocates (so the imposed KV
# size and the checked KV layout place them), with their decode metadata in buffers allocated when
# the metadata builder is created. Wired, not yet run on a GPU (docs/support.md).
HYBRID_ARCHITECTURES = frozenset({"Qwen3NextForCausalLM"})
HYBRID_STATE_BACKENDS = frozenset({"GDN_ATTN"})


class FoundryUnsupportedError(_Refusal):
    """The engine configuration would make a restored CUDA graph wrong; the message is one line.

    ``feature``/``reason`` name the first refused feature; ``also`` holds further ``(feature, reason)``
    pairs, so that one refusal lists everything a user has to change (``reasons`` has them all).
    """

    def __init__(self, feature: str, reason: str, also: list[tuple[str, str]] | None = None):
        self.feature = feature
        self.reason = reason
        pairs = [(feature, reason), *(also or [])]
        super().__init__("vLLM", [f"{f}: {r}" for f, r in pairs])


class _Refusals(list):
    """The ``(feature, reason)`` pairs one check found; :meth:`raise_any` raises them together."""

    def add(self, feature: str, reason: str) -> None:
        self.append((feature, reason))

    def raise_any(self) -> None:
        if self:
            raise FoundryUnsupportedError(*self[0], also=list(self[1:]))


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        if obj is None:
            return default
        obj = getattr(obj, name, None)
    return default if obj is None else obj


def _mode_name(mode: Any) -> str:
    return getattr(mode, "name", None) or str(mode)


def _check_graph_mode(vllm_config: Any, out: _Refusals) -> None:
    if _get(vllm_config, "model_config", "enforce_eager", default=False):
        # vLLM then sets cudagraph_mode=NONE itself: one reason, not two.
        out.add("enforce_eager", "it turns CUDA graphs off, so there is nothing to persist")
        return
    if _get(vllm_config, "model_config", "runner_type", default="generate") != "generate":
        # vLLM picks a pooling model's graph mode itself (PIECEWISE: it allows no full graphs there),
        # and _check_model refuses the runner: one reason, not a second that says "use FULL_DECODE_ONLY".
        return
    mode = _get(vllm_config, "compilation_config", "cudagraph_mode")
    name = _mode_name(mode) if mode is not None else "unset"
    if name == FOUNDRY_CUDAGRAPH_MODE:
        return
    if name in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        out.add(
            f"cudagraph_mode={name}",
            "piecewise graphs are split around attention and are not persisted; use FULL_DECODE_ONLY",
        )
    elif name == "FULL":
        out.add("cudagraph_mode=FULL", "only pure-decode full graphs are persisted; use FULL_DECODE_ONLY")
    else:
        out.add(f"cudagraph_mode={name}", "Foundry needs FULL_DECODE_ONLY decode graphs")


def _check_parallelism(vllm_config: Any, out: _Refusals) -> None:
    pc = vllm_config.parallel_config
    if _get(pc, "pipeline_parallel_size", default=1) > 1:
        out.add(
            "pipeline parallelism",
            "stage-to-stage transfers run through NCCL state that a fresh process rebuilds elsewhere",
        )
    tp = _get(pc, "tensor_parallel_size", default=1)
    if tp > 1 and not _get(pc, "disable_custom_all_reduce", default=False):
        out.add(
            "custom all-reduce",
            "its IPC buffers are mapped outside the Foundry region (and TP is not supported either)",
        )
    if tp > 1:
        out.add(
            "tensor parallelism",
            # vLLM's torch-symmetric-memory all-reduce, the one TP path Foundry can place, turns itself
            # off without NVLink multicast (vLLM 0.26, SymmMemCommunicator): NCCL would be captured.
            "captured NCCL collectives point at communicator buffers outside the Foundry region "
            "(vLLM's symmetric-memory all-reduce needs NVLink multicast)",
        )
    if (
        _get(pc, "decode_context_parallel_size", default=1) > 1
        or _get(pc, "prefill_context_parallel_size", default=1) > 1
    ):
        out.add("context parallelism", "its collectives run inside the decode graph")
    if _get(pc, "enable_expert_parallel", default=False):
        out.add(
            "expert parallelism", "all-to-all kernels use communication buffers outside the Foundry region"
        )
    if _get(pc, "enable_eplb", default=False) or _get(pc, "enable_elastic_ep", default=False):
        out.add("expert load balancing", "it moves expert weights at run time, behind the captured addresses")
    if _get(pc, "enable_dbo", default=False):
        out.add("dual-batch overlap (enable_dbo)", "micro-batched graphs run on helper threads and streams")
    num_experts = 0
    get_experts = getattr(vllm_config.model_config, "get_num_experts", None)
    if callable(get_experts):
        try:
            num_experts = int(get_experts() or 0)
        except Exception:  # an architecture without the notion has no experts
            num_experts = 0
    if _get(pc, "data_parallel_size", default=1) > 1 and num_experts > 0:
        out.add("data-parallel MoE", "MoE layers exchange tokens across DP ranks inside the decode graph")


def _check_model(vllm_config: Any, out: _Refusals) -> None:
    mc = vllm_config.model_config
    if _get(mc, "runner_type", default="generate") != "generate":
        out.add(f"runner_type={_get(mc, 'runner_type')}", "only text generation decode graphs are persisted")
    if _get(mc, "is_encoder_decoder", default=False):
        out.add("encoder-decoder models", "encoder outputs feed the decode graph")
    if _get(mc, "is_multimodal_model", default=False):
        out.add("multimodal models", "encoder graphs and multimodal embeddings are not persisted")
    if _get(vllm_config, "compilation_config", "cudagraph_mm_encoder", default=False):
        out.add("encoder CUDA graphs (cudagraph_mm_encoder)", "they are not persisted")
    if _get(mc, "is_hybrid", default=False):
        _check_hybrid(vllm_config, out)


def _check_hybrid(vllm_config: Any, out: _Refusals) -> None:
    mc = vllm_config.model_config
    arch = _get(mc, "architecture") or next(
        iter(_get(mc, "hf_config", "architectures", default=None) or []), None
    )
    if arch not in HYBRID_ARCHITECTURES:
        out.add(
            f"hybrid (Mamba/linear-attention) architecture {arch}",
            "only the gated-delta-net hybrids ("
            + ", ".join(sorted(HYBRID_ARCHITECTURES))
            + ") have their state caches laid out again by Foundry",
        )
        return  # the rules below are those of the hybrids Foundry takes
    mode = str(_get(vllm_config, "cache_config", "mamba_cache_mode", default="none") or "none")
    if mode != "none" or _get(vllm_config, "cache_config", "enable_prefix_caching", default=False):
        out.add(
            f"prefix caching with a hybrid model (mamba_cache_mode={mode})",
            "its state copies and block-table slicing are not validated with Foundry (--no-enable-prefix-caching)",
        )
    try:
        v2 = bool(_get(vllm_config, "use_v2_model_runner", default=False))
    except Exception:  # a property that raises for a configuration it rejects: not V2
        v2 = False
    if not v2:
        out.add(
            "a hybrid model on vLLM's V1 model runner",
            "its SAVE-only CUDA-graph memory profiling rebuilds the input batch outside the Foundry "
            "region (VLLM_USE_V2_MODEL_RUNNER=1 selects the V2 runner)",
        )


def _check_compile(vllm_config: Any, out: _Refusals) -> None:
    from foundry_core.engine import inductor

    why = inductor.conflict(
        _get(vllm_config, "compilation_config", "inductor_compile_config", default={}) or {}
    )
    if why is not None:
        key, reason = why.split(": ", 1)
        out.add(f"inductor_compile_config {key}", reason)


def _check_features(vllm_config: Any, out: _Refusals) -> None:
    if _get(vllm_config, "speculative_config") is not None:
        out.add(
            "speculative decoding", "draft and verify graphs have their own buffers that are not persisted"
        )
    if _get(vllm_config, "lora_config") is not None:
        out.add("LoRA", "adapter slots and punica buffers are swapped behind the graph")
    sleep_mode = _get(vllm_config, "model_config", "enable_sleep_mode", default=False)
    if sleep_mode:
        out.add("sleep mode", "the cuMem allocator places weights and graphs outside the Foundry region")
    # Sleep mode makes vLLM turn the cuMem allocator on itself: one reason, not two.
    if _get(vllm_config, "model_config", "enable_cumem_allocator", default=False) and not sleep_mode:
        out.add(
            "the cuMem allocator (enable_cumem_allocator)",
            "vLLM then allocates weights and the KV cache from its own pool, outside the Foundry region",
        )
    # KV offloading (--kv-offloading-size) makes vLLM put its offloading connector into
    # kv_transfer_config itself, over any connector given there: one reason, not a second that names
    # a disaggregated prefill nobody asked for.
    kv_offloading = _get(vllm_config, "cache_config", "kv_offloading_size") is not None
    if _get(vllm_config, "kv_transfer_config") is not None and not kv_offloading:
        out.add(
            "KV transfer (disaggregated prefill)", "connectors register and move KV memory outside the engine"
        )
    if _get(vllm_config, "ec_transfer_config") is not None:
        out.add("encoder-cache transfer", "it is a multimodal disaggregation feature")
    if _get(vllm_config, "weight_transfer_config") is not None:
        out.add("weight transfer", "weights replaced at run time may move")
    offload = _get(vllm_config, "offload_config")
    if (
        _get(offload, "uva", "cpu_offload_gb", default=0) > 0
        or _get(offload, "prefetch", "offload_group_size", default=0) > 0
    ):
        out.add("CPU weight offloading", "offloaded weights live outside device memory")
    if kv_offloading:
        out.add("KV cache offloading", "it runs a KV connector beside the engine")
    backend = _get(vllm_config, "attention_config", "backend")
    if backend is not None and _mode_name(backend) not in VALIDATED_ATTENTION_BACKENDS:
        out.add(
            f"attention backend {_mode_name(backend)}",
            "its capture-time metadata state is not rebuilt on LOAD (validated: "
            + ", ".join(sorted(VALIDATED_ATTENTION_BACKENDS))
            + ")",
        )
    if _get(vllm_config, "attention_config", "hisparse_config") is not None:
        out.add("HiSparse attention", "its caches are not validated with Foundry")
    for field, what in (("watermark_config", "watermarking"), ("diffusion_config", "diffusion decoding")):
        if _get(vllm_config, field) is not None:
            out.add(what, "it changes the decode step that the graphs capture")


def _check_platform(vllm_config: Any, out: _Refusals) -> None:
    device_type = _get(vllm_config, "device_config", "device_type", default="")
    if device_type and device_type != "cuda":
        out.add(f"device {device_type!r}", "Foundry persists CUDA graphs only")
    worker_cls = _get(vllm_config, "parallel_config", "worker_cls", default="auto")
    if isinstance(worker_cls, str) and worker_cls not in ("auto", VLLM_GPU_WORKER, FOUNDRY_WORKER):
        out.add(f"worker_cls={worker_cls}", "Foundry extends vLLM's GPU worker and cannot hook a custom one")


def check_supported(vllm_config: Any) -> None:
    """Raise :class:`FoundryUnsupportedError` (one line) unless Foundry can persist this engine's graphs.

    Runs on the engine configuration alone, before any GPU work: in the front-end process right after
    vLLM builds the config, and again in each worker before CUDA is touched.
    """
    out = _Refusals()
    for check in (
        _check_platform,
        _check_graph_mode,
        _check_compile,
        _check_features,
        _check_parallelism,
        _check_model,
    ):
        check(vllm_config, out)
    out.raise_any()
