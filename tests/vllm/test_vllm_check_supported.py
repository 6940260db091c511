"""check_supported(): each unsupported engine mode is refused, before GPU work, with its own reason.

Every case starts from one real ``VllmConfig`` that vLLM built with Foundry on (see conftest), copies it,
and switches on one feature by setting the real field (with a real vLLM config object where one can be
built without a model or a device). The cases that ``vllm serve`` flags reach also go through its parser
in test_vllm_serve_refusals.py, which says why the others cannot.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from foundry_vllm_plugin import FoundryUnsupportedError, check_supported
from foundry_vllm_plugin.support import FOUNDRY_WORKER

pytestmark = pytest.mark.vllm


def _instance(cls, **kwargs):
    """A real instance of a vLLM config class; without validation when it needs a model to build."""
    try:
        return cls(**kwargs)
    except Exception:
        return object.__new__(cls)


def _set_mode(name):
    def apply(c):
        from vllm.config.compilation import CUDAGraphMode

        c.compilation_config.cudagraph_mode = CUDAGraphMode[name]

    return apply


def _enforce_eager(c):
    c.model_config.enforce_eager = True


def _speculative(c):
    from vllm.config import SpeculativeConfig

    c.speculative_config = _instance(SpeculativeConfig)


def _lora(c):
    from vllm.config import LoRAConfig

    c.lora_config = LoRAConfig()


def _pp(c):
    c.parallel_config.pipeline_parallel_size = 2


def _tp_custom_all_reduce(c):
    c.parallel_config.tensor_parallel_size = 2
    c.parallel_config.disable_custom_all_reduce = False


def _tp(c):
    c.parallel_config.tensor_parallel_size = 2
    c.parallel_config.disable_custom_all_reduce = True


def _dcp(c):
    c.parallel_config.decode_context_parallel_size = 2


def _ep(c):
    c.parallel_config.enable_expert_parallel = True


def _eplb(c):
    c.parallel_config.enable_eplb = True


def _dbo(c):
    c.parallel_config.enable_dbo = True


def _dp_moe(c):
    c.parallel_config.data_parallel_size = 2
    c.model_config.model_arch_config.num_experts = 8


def _multimodal(c):
    from vllm.config.multimodal import MultiModalConfig

    c.model_config.multimodal_config = _instance(MultiModalConfig)


def _mm_encoder_graphs(c):
    c.compilation_config.cudagraph_mm_encoder = True


def _encoder_decoder(c):
    c.model_config.hf_config.is_encoder_decoder = True
    c.model_config.__dict__.pop("is_encoder_decoder", None)  # a cached property in some releases


def _pooling(c):
    c.model_config.runner_type = "pooling"


def _hybrid(c):
    c.model_config._model_info = dataclasses.replace(c.model_config._model_info, is_hybrid=True)
    c.model_config.hf_config.layer_types = ["full_attention", "linear_attention"]


def _qwen3_next(c):
    """A gated-delta-net hybrid as Foundry takes it: Qwen3-Next's architecture, prefix caching off."""
    _hybrid(c)
    c.model_config._architecture = "Qwen3NextForCausalLM"
    c.model_config.__dict__.pop("architecture", None)  # a cached property in some releases
    c.cache_config.enable_prefix_caching = False
    c.cache_config.mamba_cache_mode = "none"


def _qwen3_next_prefix_caching(c):
    _qwen3_next(c)
    c.cache_config.enable_prefix_caching = True
    c.cache_config.mamba_cache_mode = "align"


def _sleep(c):
    c.model_config.enable_sleep_mode = True


def _cumem(c):
    c.model_config.enable_cumem_allocator = True


def _kv_transfer(c):
    from vllm.config import KVTransferConfig

    c.kv_transfer_config = _instance(KVTransferConfig, kv_connector="ExampleConnector", kv_role="kv_both")


def _ec_transfer(c):
    from vllm.config.ec_transfer import ECTransferConfig

    c.ec_transfer_config = _instance(ECTransferConfig)


def _weight_transfer(c):
    from vllm.config.weight_transfer import WeightTransferConfig

    c.weight_transfer_config = _instance(WeightTransferConfig)


def _cpu_offload(c):
    c.offload_config.uva.cpu_offload_gb = 4


def _kv_offload(c):
    c.cache_config.kv_offloading_size = 8.0


def _flashinfer(c):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    c.attention_config.backend = AttentionBackendEnum.FLASHINFER


def _hisparse(c):
    from vllm.config.attention import HiSparseConfig

    c.attention_config.hisparse_config = _instance(HiSparseConfig)


def _watermark(c):
    from vllm.config.watermarking import WatermarkConfig

    c.watermark_config = _instance(WatermarkConfig)


def _diffusion(c):
    from vllm.config.diffusion import DiffusionConfig

    c.diffusion_config = _instance(DiffusionConfig)


def _cpu_device(c):
    c.device_config.device_type = "cpu"


def _custom_worker(c):
    c.parallel_config.worker_cls = "my_pkg.MyWorker"


def _rblock_scaling(c):
    c.compilation_config.inductor_compile_config["dynamic_scale_rblock"] = True


CASES = [
    (
        "enforce_eager",
        _enforce_eager,
        "Foundry cannot run this vLLM configuration: enforce_eager: it turns CUDA graphs off",
    ),
    ("piecewise", _set_mode("PIECEWISE"), "configuration: cudagraph_mode=PIECEWISE: piecewise graphs"),
    (
        "full_and_piecewise",
        _set_mode("FULL_AND_PIECEWISE"),
        "configuration: cudagraph_mode=FULL_AND_PIECEWISE: piecewise",
    ),
    ("full_mixed", _set_mode("FULL"), "configuration: cudagraph_mode=FULL: only pure-decode full graphs"),
    ("no_graphs", _set_mode("NONE"), "configuration: cudagraph_mode=NONE: Foundry needs FULL_DECODE_ONLY"),
    (
        "inductor_rblock_scaling",
        _rblock_scaling,
        "configuration: inductor_compile_config dynamic_scale_rblock=True: a new process benchmarks",
    ),
    ("speculative_decoding", _speculative, "configuration: speculative decoding: draft and verify graphs"),
    ("lora", _lora, "configuration: LoRA: adapter slots"),
    ("pipeline_parallel", _pp, "configuration: pipeline parallelism: stage-to-stage transfers"),
    ("custom_all_reduce", _tp_custom_all_reduce, "configuration: custom all-reduce: its IPC buffers"),
    ("tensor_parallel", _tp, "configuration: tensor parallelism: captured NCCL collectives"),
    ("context_parallel", _dcp, "configuration: context parallelism"),
    ("expert_parallel", _ep, "configuration: expert parallelism: all-to-all kernels"),
    ("eplb", _eplb, "configuration: expert load balancing"),
    ("dual_batch_overlap", _dbo, "configuration: dual-batch overlap (enable_dbo)"),
    ("data_parallel_moe", _dp_moe, "configuration: data-parallel MoE"),
    ("multimodal", _multimodal, "configuration: multimodal models: encoder graphs"),
    ("encoder_cudagraphs", _mm_encoder_graphs, "configuration: encoder CUDA graphs (cudagraph_mm_encoder)"),
    ("encoder_decoder", _encoder_decoder, "configuration: encoder-decoder models"),
    ("pooling", _pooling, "configuration: runner_type=pooling"),
    (
        "hybrid_other_architecture",
        _hybrid,
        "configuration: hybrid (Mamba/linear-attention) architecture Qwen3ForCausalLM: only the gated",
    ),
    (
        "hybrid_prefix_caching",
        _qwen3_next_prefix_caching,
        "configuration: prefix caching with a hybrid model (mamba_cache_mode=align)",
    ),
    ("sleep_mode", _sleep, "configuration: sleep mode: the cuMem allocator"),
    (
        "cumem_allocator",
        _cumem,
        "configuration: the cuMem allocator (enable_cumem_allocator): vLLM then allocates",
    ),
    ("kv_transfer", _kv_transfer, "configuration: KV transfer (disaggregated prefill)"),
    ("ec_transfer", _ec_transfer, "configuration: encoder-cache transfer"),
    ("weight_transfer", _weight_transfer, "configuration: weight transfer"),
    ("cpu_weight_offload", _cpu_offload, "configuration: CPU weight offloading"),
    ("kv_offload", _kv_offload, "configuration: KV cache offloading"),
    (
        "unvalidated_attention_backend",
        _flashinfer,
        "configuration: attention backend FLASHINFER: its capture-time",
    ),
    ("hisparse", _hisparse, "configuration: HiSparse attention"),
    ("watermark", _watermark, "configuration: watermarking"),
    ("diffusion", _diffusion, "configuration: diffusion decoding"),
    ("non_cuda_device", _cpu_device, "configuration: device 'cpu'"),
    ("custom_worker_cls", _custom_worker, "configuration: worker_cls=my_pkg.MyWorker"),
]


def test_the_base_configuration_is_supported(base_vllm_config):
    assert base_vllm_config.parallel_config.worker_cls == FOUNDRY_WORKER
    check_supported(base_vllm_config)  # no exception


@pytest.mark.parametrize("apply, message", [pytest.param(a, m, id=i) for i, a, m in CASES])
def test_unsupported_mode_is_refused_with_its_reason(base_vllm_config, apply, message):
    config = copy.deepcopy(base_vllm_config)
    check_supported(config)  # the copy itself is fine
    apply(config)
    with pytest.raises(FoundryUnsupportedError) as err:
        check_supported(config)
    text = str(err.value)
    assert message in text
    assert "\n" not in text and text.startswith("Foundry cannot run this vLLM configuration: ")


def test_a_gated_delta_net_hybrid_is_taken_on_the_v2_runner_only(base_vllm_config, monkeypatch):
    """Qwen3-Next with prefix caching off starts on the V2 model runner; on V1, whose SAVE-only
    graph-memory profiling rebuilds the input batch outside the region, it is refused."""
    config = copy.deepcopy(base_vllm_config)
    _qwen3_next(config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    check_supported(config)  # no exception
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(FoundryUnsupportedError, match="a hybrid model on vLLM's V1 model runner"):
        check_supported(config)


def test_every_case_names_a_distinct_reason():
    messages = [m for _, _, m in CASES]
    assert len(set(messages)) == len(messages)


def test_refusal_happens_in_create_engine_config(engine_args_factory, foundry_toml):
    # The front end refuses while building the config, i.e. before any worker or GPU work exists.
    args = engine_args_factory(
        additional_config={"foundry": {"config": str(foundry_toml)}}, enforce_eager=True
    )
    with pytest.raises(FoundryUnsupportedError, match="enforce_eager"):
        args.create_engine_config()


def test_lora_is_refused_through_engine_args(engine_args_factory, foundry_toml):
    args = engine_args_factory(additional_config={"foundry": {"config": str(foundry_toml)}}, enable_lora=True)
    with pytest.raises(FoundryUnsupportedError, match="configuration: LoRA"):
        args.create_engine_config()


def test_without_foundry_the_same_settings_are_left_to_vllm(engine_args_factory):
    vllm_config = engine_args_factory(enforce_eager=True, enable_lora=True).create_engine_config()
    assert vllm_config.lora_config is not None and vllm_config.model_config.enforce_eager


def test_every_refused_feature_is_listed_in_one_line(base_vllm_config):
    """A configuration with several refused features names them all, as SGLang's refusal does, so a
    user fixes everything at once (the refusal once stopped at the first)."""
    config = copy.deepcopy(base_vllm_config)
    for apply in (_enforce_eager, _speculative, _lora, _pp, _kv_offload):
        apply(config)
    with pytest.raises(FoundryUnsupportedError) as err:
        check_supported(config)
    text = str(err.value)
    assert "\n" not in text
    assert err.value.reasons == [
        "enforce_eager: it turns CUDA graphs off, so there is nothing to persist",
        "speculative decoding: draft and verify graphs have their own buffers that are not persisted",
        "LoRA: adapter slots and punica buffers are swapped behind the graph",
        "KV cache offloading: it runs a KV connector beside the engine",
        "pipeline parallelism: stage-to-stage transfers run through NCCL state that a fresh process "
        "rebuilds elsewhere",
    ]
    assert err.value.feature == "enforce_eager"  # the first, for code that reads one
