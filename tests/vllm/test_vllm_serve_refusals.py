"""Every engine-configuration refusal that ``vllm serve`` flags can reach, through vLLM's own parser.

Each case is the argument list a user types after ``vllm serve`` (a tiny local model, ``--enable-foundry
--foundry-config foundry.toml`` and the flags of the case). It is parsed by the ``serve`` subcommand's
parser exactly as ``vllm.entrypoints.cli.main`` builds it, and turned into the engine config the way
``vllm serve`` does (``AsyncEngineArgs.from_cli_args(...).create_engine_config(...)``), where Foundry
refuses. The refusal must list every reason of the case, each with the text that
``test_vllm_check_supported.CASES`` expects of it, on one line, as the ``SystemExit`` that ends
``vllm serve`` with status 1. A few cases also run vLLM's CLI ``main()`` (what the ``vllm serve``
console script runs) in a fresh process, under the same stand-in (``_SERVE`` says what it leaves out).

This machine has no GPU: the tests' CUDA stand-in platform (conftest) is in place, and here it also
answers as vLLM's CUDA platform does on an eight-GPU node (``_cuda_node``), so that vLLM's own checks of
a multi-GPU or sleep-mode configuration pass and Foundry's refusal is reached.

Refusal cases that stay config-level (test_vllm_check_supported.py), and why no flags reach them here:

* ``multimodal``, ``encoder_decoder``: to build the config of a multimodal model (vLLM 0.33's
  encoder-decoder models, Whisper and the like, are all multimodal) vLLM imports the model's class,
  whose attention layers need the CUDA flash-attention extension (``vllm.vllm_flash_attn``) under a
  CUDA platform; the CPU build of vLLM has none. On its CPU platform Foundry refuses up front instead.
* ``non_cuda_device``: ``vllm serve`` has no device flag (vLLM 0.33): the device is the platform's, and
  on a platform other than CUDA Foundry refuses before vLLM builds its config ("no CUDA device",
  which test_vllm_cli_refusals.py runs as a real ``vllm serve``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
from foundry_vllm_testutil import QWEN3_CONFIG
from test_vllm_check_supported import CASES

pytestmark = pytest.mark.vllm

PREFIX = "Foundry cannot run this vLLM configuration: "
# The reason each config-level case expects (its text after "configuration: "), by case id.
REASON = {case_id: message.split("configuration: ", 1)[1] for case_id, _, message in CASES}

CONFIG_LEVEL_ONLY = {
    "multimodal": "building the config imports the model class: CUDA flash-attention kernels",
    "encoder_decoder": "vLLM's encoder-decoder models are multimodal (same import)",
    "non_cuda_device": "no device flag; a non-CUDA platform is refused before the config",
}

# Tiny configs of the model families some cases need (vLLM reads config.json only: dummy weights).
QWEN3_MOE = {
    **QWEN3_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
QWEN3_NEXT = {  # the gated-delta-net hybrid Foundry takes
    **QWEN3_MOE,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "shared_expert_intermediate_size": 128,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_value_head_dim": 32,
    "partial_rotary_factor": 0.25,
}
JAMBA = {  # a Mamba hybrid Foundry does not take
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 16,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V32 = {  # a DSA model (index_topk): the one kind vLLM runs HiSparse attention on
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "index_topk": 64,
    "index_head_dim": 64,
    "index_n_heads": 4,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODELS = {"qwen3-moe": QWEN3_MOE, "qwen3-next": QWEN3_NEXT, "jamba": JAMBA, "deepseek-v32": DEEPSEEK_V32}


class Case(NamedTuple):
    flags: tuple[str, ...]
    reasons: tuple[str, ...]  # REASON ids, or a reason's own text for one CASES does not have
    model: str = "qwen3"
    env: dict[str, str] | None = None


# vLLM sizes its FlashInfer all-reduce + RMSNorm fusion while building a TP > 1 config, importing the
# fusion pass, whose module needs CUDA kernels this CPU build lacks. Switching the fusion off (a user
# flag) leaves everything Foundry checks as it was.
NO_AR_FUSION = ("-cc.pass_config.fuse_allreduce_rms=false",)
V2_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'

PARSER_CASES = {
    "enforce_eager": Case(("--enforce-eager",), ("enforce_eager",)),
    "piecewise": Case(("-cc.cudagraph_mode=PIECEWISE",), ("piecewise",)),
    "full_and_piecewise": Case(("-cc.cudagraph_mode=FULL_AND_PIECEWISE",), ("full_and_piecewise",)),
    "full_mixed": Case(("-cc.cudagraph_mode=FULL",), ("full_mixed",)),
    "no_graphs": Case(("-cc.cudagraph_mode=NONE",), ("no_graphs",)),
    "inductor_rblock_scaling": Case(
        ("-cc.inductor_compile_config.dynamic_scale_rblock=true",), ("inductor_rblock_scaling",)
    ),
    "speculative_decoding": Case(("--speculative-config", NGRAM), ("speculative_decoding",)),
    "lora": Case(("--enable-lora",), ("lora",)),
    "pipeline_parallel": Case(("-pp", "2"), ("pipeline_parallel",)),
    # Custom all-reduce is vLLM's default with TP: both reasons.
    "custom_all_reduce": Case(("-tp", "2", *NO_AR_FUSION), ("custom_all_reduce", "tensor_parallel")),
    "tensor_parallel": Case(("-tp", "2", "--disable-custom-all-reduce", *NO_AR_FUSION), ("tensor_parallel",)),
    # vLLM wants TP above the model's KV heads (2) for decode context parallelism with GQA.
    "context_parallel": Case(
        ("-tp", "4", "-dcp", "2", "--disable-custom-all-reduce", *NO_AR_FUSION),
        ("tensor_parallel", "context_parallel"),
    ),
    # vLLM's V1 model runner has no prefill context parallelism.
    "prefill_context_parallel": Case(("-pcp", "2"), ("context_parallel",), env=V2_RUNNER),
    "expert_parallel": Case(("-ep",), ("expert_parallel",), model="qwen3-moe"),
    # vLLM's EPLB needs expert parallelism and TP or DP above one.
    "eplb": Case(
        ("-ep", "--enable-eplb", "-dp", "2"),
        ("expert_parallel", "eplb", "data_parallel_moe"),
        model="qwen3-moe",
    ),
    # vLLM micro-batches only over a DeepEP or NIXL all-to-all backend, i.e. with expert parallelism.
    "dual_batch_overlap": Case(
        ("-ep", "--enable-dbo", "--all2all-backend", "deepep_low_latency"),
        ("expert_parallel", "dual_batch_overlap"),
        model="qwen3-moe",
    ),
    "data_parallel_moe": Case(("-dp", "2"), ("data_parallel_moe",), model="qwen3-moe"),
    "encoder_cudagraphs": Case(("-cc.cudagraph_mm_encoder=true",), ("encoder_cudagraphs",)),
    # vLLM picks PIECEWISE graphs for a pooling model itself: the refusal names the runner alone.
    "pooling": Case(("--runner", "pooling"), ("pooling",)),
    "hybrid_other_architecture": Case((), ("hybrid_other_architecture",), model="jamba"),
    "hybrid_prefix_caching": Case(
        ("--enable-prefix-caching",), ("hybrid_prefix_caching",), model="qwen3-next", env=V2_RUNNER
    ),
    "hybrid_on_v1_runner": Case(
        ("--no-enable-prefix-caching",),
        ("a hybrid model on vLLM's V1 model runner: its SAVE-only CUDA-graph memory profiling",),
        model="qwen3-next",
        env={"VLLM_USE_V2_MODEL_RUNNER": "0"},
    ),
    # vLLM turns the cuMem allocator on for sleep mode itself: the refusal names sleep mode alone.
    "sleep_mode": Case(("--enable-sleep-mode",), ("sleep_mode",)),
    "cumem_allocator": Case(("--enable-cumem-allocator",), ("cumem_allocator",)),
    # vLLM loads the connector class while building the config; the example and NIXL connectors
    # import CUDA attention kernels there on this CPU build, LMCache's does not.
    "kv_transfer": Case(
        ("--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'),
        ("kv_transfer",),
    ),
    "ec_transfer": Case(
        ("--ec-transfer-config", '{"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}'),
        ("ec_transfer",),
    ),
    "weight_transfer": Case(("--weight-transfer-config", '{"backend": "nccl"}'), ("weight_transfer",)),
    "cpu_weight_offload": Case(("--cpu-offload-gb", "4"), ("cpu_weight_offload",)),
    # vLLM carries KV offloading out through a KV connector it sets itself: one reason, not two.
    "kv_offload": Case(("--kv-offloading-size", "8"), ("kv_offload",)),
    "unvalidated_attention_backend": Case(
        ("--attention-backend", "FLASHINFER"), ("unvalidated_attention_backend",)
    ),
    "hisparse": Case(("-ac", '{"hisparse_config": {}}'), ("hisparse",), model="deepseek-v32"),
    "watermark": Case(("--watermark-config", '{"key": 1234}'), ("watermark",)),
    "diffusion": Case(("--diffusion-config", '{"canvas_length": 8}'), ("diffusion",)),
    "custom_worker_cls": Case(("--worker-cls", "my_pkg.MyWorker"), ("custom_worker_cls",)),
    # Several at once: all of them on the one line (the refusal once stopped at the first).
    "several_at_once": Case(
        ("--enforce-eager", "--enable-lora", "--speculative-config", NGRAM, "--cpu-offload-gb", "4")
        + ("--worker-cls", "my_pkg.MyWorker"),
        ("custom_worker_cls", "enforce_eager", "speculative_decoding", "lora", "cpu_weight_offload"),
    ),
    "piecewise_with_cpu_offload": Case(
        ("-cc.cudagraph_mode=PIECEWISE", "--cpu-offload-gb", "4"), ("piecewise", "cpu_weight_offload")
    ),
}
# Also run as a real `vllm serve` process (each takes about 20 s): several reasons at once, a graph
# mode, a backend, and one flag from which vLLM derives further settings.
SERVE_CASES = ("several_at_once", "piecewise", "unvalidated_attention_backend", "kv_offload")


@pytest.fixture(scope="module")
def model_dirs(qwen3_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {"qwen3": qwen3_dir}
    for name, config in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = root / name
    return dirs


@pytest.fixture(autouse=True)
def _cuda_node(monkeypatch):
    """vLLM's CUDA platform's answers on an eight-GPU node, where the stand-in (or this machine) has
    none: vLLM checks the node's GPU count for TP/PP/DP, keeps custom all-reduce and the hybrid KV
    cache manager (HiSparse needs it) on CUDA only, and has the cuMem allocator (sleep mode) in its
    CUDA build only."""
    from vllm.platforms import current_platform

    for name, answer in (
        ("device_count", 8),
        ("use_custom_allreduce", True),
        ("support_hybrid_kv_cache", True),
        ("is_cumem_allocator_available", True),
    ):
        monkeypatch.setattr(current_platform, name, lambda answer=answer: answer, raising=False)


def _argv(model: Path, toml: Path, case: Case) -> list[str]:
    """What a user types after ``vllm serve``; dummy weights and no tokenizer keep it to config.json."""
    return [str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "1024"] + [
        "--enable-foundry",
        "--foundry-config",
        str(toml),
        *case.flags,
    ]


def _build_config(argv: list[str]):
    """``vllm serve``'s way from its arguments to the engine config, in this process."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The parser vllm.entrypoints.cli.main builds: a "serve" subparser filled by the serve command.
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    args.model = args.model_tag  # ServeSubcommand.cmd's first step
    engine_args = AsyncEngineArgs.from_cli_args(args)
    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def _refusal(argv: list[str]):
    from foundry_vllm_plugin import FoundryUnsupportedError

    with pytest.raises(SystemExit) as err:
        _build_config(argv)
    refusal = err.value
    assert isinstance(refusal, FoundryUnsupportedError), repr(refusal)
    return refusal


def _expected(case: Case) -> list[str]:
    # The config-level cases change a Qwen3 config, so a reason that names the architecture names
    # Qwen3's there; here it names the case's model.
    arch = (MODELS.get(case.model) or QWEN3_CONFIG)["architectures"][0]
    base = QWEN3_CONFIG["architectures"][0]
    return [REASON.get(reason, reason).replace(base, arch) for reason in case.reasons]


def _assert_lists_exactly(reasons: list[str], expected: list[str]) -> None:
    """Each expected reason once, and nothing else."""
    left = list(reasons)
    for text in expected:
        hits = [r for r in left if r.startswith(text)]
        assert len(hits) == 1, f"{text!r} should be one of the reasons: {reasons}"
        left.remove(hits[0])
    assert not left, f"reasons the case does not expect: {left}"


@pytest.mark.parametrize("case_id", list(PARSER_CASES))
def test_the_serve_flags_are_refused_with_every_reason_on_one_line(
    case_id, model_dirs, foundry_toml, monkeypatch
):
    case = PARSER_CASES[case_id]
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    refusal = _refusal(_argv(model_dirs[case.model], foundry_toml, case))
    _assert_lists_exactly(refusal.reasons, _expected(case))
    # The line `vllm serve` ends with: all the reasons, in order, and no line break.
    assert refusal.code == "error: " + PREFIX + "; ".join(refusal.reasons)
    assert "\n" not in refusal.code


@pytest.mark.parametrize(
    "model, flags, env",
    [
        pytest.param("qwen3", (), None, id="qwen3"),
        pytest.param("qwen3-moe", (), None, id="qwen3-moe"),
        pytest.param("qwen3-next", ("--no-enable-prefix-caching",), V2_RUNNER, id="qwen3-next-v2"),
        pytest.param("deepseek-v32", (), None, id="deepseek-v32"),
    ],
)
def test_each_model_without_the_case_flags_is_taken(model, flags, env, model_dirs, foundry_toml, monkeypatch):
    """The cases' models themselves pass: their refusals come from the flags of the case."""
    from foundry_vllm_plugin.support import FOUNDRY_WORKER

    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    config = _build_config(_argv(model_dirs[model], foundry_toml, Case(flags, ())))
    assert config.parallel_config.worker_cls == FOUNDRY_WORKER


def test_every_refusal_case_goes_through_the_parser_or_says_why_not():
    case_ids = {case_id for case_id, _, _ in CASES}
    assert case_ids - set(PARSER_CASES) == set(CONFIG_LEVEL_ONLY)
    assert not set(CONFIG_LEVEL_ONLY) & set(PARSER_CASES)
    for case_id in case_ids & set(PARSER_CASES):
        assert case_id in PARSER_CASES[case_id].reasons, case_id  # a case refuses with its own reason
    assert set(SERVE_CASES) <= set(PARSER_CASES)


# A real `vllm serve` on this CPU machine, under the same CUDA stand-in. `vllm preload`, a subcommand
# beside serve that main() imports at start-up, pulls in vLLM's model loader, whose CUDA kernels this
# CPU build lacks under a CUDA platform; serve never uses it, so it is left out of the command list.
_SERVE = """
import sys, types
sys.path.insert(0, {tests!r})
from foundry_vllm_testutil import install_cpu_stand_in_platform
install_cpu_stand_in_platform()
import vllm.entrypoints.cli as cli
cli.preload = sys.modules["vllm.entrypoints.cli.preload"] = types.ModuleType("vllm.entrypoints.cli.preload")
cli.preload.cmd_init = lambda: []
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "serve", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("case_id", SERVE_CASES)
def test_vllm_serve_ends_with_every_reason_on_one_line(case_id, model_dirs, foundry_toml):
    case = PARSER_CASES[case_id]
    line = _refusal(_argv(model_dirs[case.model], foundry_toml, case)).code  # this process's line
    script = textwrap.dedent(_SERVE.format(tests=str(Path(__file__).parent)))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_LOGGING_LEVEL": "WARNING",
        **(case.env or {}),
    }
    env.pop("FOUNDRY_CONFIG", None)
    argv = [*_argv(model_dirs[case.model], foundry_toml, case), "--port", "0"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-3000:]  # one, and last
    assert errors[0] == line  # the same refusal, every reason in it
    for text in _expected(case):
        assert text in errors[0], (text, errors[0])
