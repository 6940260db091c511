"""Block-quantized FP8 Qwen3-MoE (the layer shape of Qwen3-30B-A3B-FP8) on vLLM with Foundry on.

The engine config is vLLM's own, built from a two-layer config with that checkpoint's layer shape and
quantization block; the checks are what the front end decides before any GPU work: Foundry takes the
configuration, and the caches the FP8 MoE path fills at the first start (Triton's fused-MoE kernels,
FlashInfer's JIT modules, vLLM's FlashInfer autotune results) are redirected into the private
folders that the archive carries, under its trust rules (foundry_core.engine.caches).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

QWEN3_MOE_FP8 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
}


def test_foundry_takes_the_block_fp8_moe_configuration(tmp_path, base_vllm_config):
    """vLLM's own ModelConfig of the checkpoint (its quantization verified by vLLM), built in a fresh
    interpreter on this machine's platform: under the tests' CPU stand-in for a CUDA platform, vLLM's
    quantization registry imports CUDA-only attention modules. Foundry refuses none of it."""
    import copy

    from foundry_vllm_plugin import check_supported

    model = tmp_path / "qwen3-moe-fp8"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_MOE_FP8))
    script = textwrap.dedent(
        f"""
        import pickle
        from vllm.engine.arg_utils import EngineArgs
        mc = EngineArgs(model={str(model)!r}, load_format="dummy", skip_tokenizer_init=True,
                        max_model_len=1024, seed=0).create_model_config()
        open({str(tmp_path / "mc.pkl")!r}, "wb").write(pickle.dumps(mc))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    model_config = pickle.loads((tmp_path / "mc.pkl").read_bytes())
    assert model_config.quantization == "fp8" and model_config.get_num_experts() == 128
    assert model_config.hf_config.quantization_config["weight_block_size"] == [128, 128]
    config = copy.deepcopy(base_vllm_config)
    config.model_config = model_config
    check_supported(config)  # no exception: one GPU, no expert parallelism


def test_the_fp8_moe_caches_land_in_the_carried_folders(foundry_toml):
    """vLLM's FlashInfer autotune store (the FP8 MoE tactics) was left at FlashInfer's own default,
    outside every carried folder, before it became a carried kind. The folders are the ones the API
    server makes for a Foundry start of this model (``launch_caches``, before vLLM builds its config)."""
    from vllm.model_executor.warmup.flashinfer_autotune_cache import (
        flashinfer_autotune_root,
        resolve_flashinfer_autotune_v2_root,
    )

    from foundry_core.engine import caches
    from foundry_vllm_plugin.engine_args import launch_caches
    from foundry_vllm_plugin.session import CACHE_KINDS

    launch_caches({"foundry": {"config": str(foundry_toml)}})
    root = Path(os.environ[caches.DIR_ENV])
    assert {"triton", "flashinfer", "flashinfer-autotune", "vllm"} <= set(CACHE_KINDS)
    assert resolve_flashinfer_autotune_v2_root() == root / "flashinfer-autotune"
    assert flashinfer_autotune_root() == root / "flashinfer-autotune"
    assert Path(os.environ["TRITON_CACHE_DIR"]) == root / "triton"
    assert Path(os.environ["FLASHINFER_WORKSPACE_BASE"]) == root / "flashinfer"


def test_autotune_results_travel_with_the_archive_trust_rules(tmp_path):
    """Packed with the other kinds and refused outside the archive directory like them."""
    from foundry_core.archive import ArchiveError
    from foundry_core.engine import caches

    dirs = caches.CacheDirs.create(["flashinfer-autotune"], label="fp8-moe-test")
    try:
        entry = dirs.path("flashinfer-autotune") / "sm90" / "fused_moe_fp8.json"
        entry.parent.mkdir(parents=True)
        entry.write_text('{"tactic": 3}')
        listing = dirs.files()
        assert list(listing["flashinfer-autotune"]) == ["sm90/fused_moe_fp8.json"]
        archive_dir = tmp_path / "archive"
        archive_dir.mkdir()
        outside = tmp_path / "elsewhere" / "rank0.caches"
        with pytest.raises(ArchiveError):
            caches.unpack(outside, dirs, device=0, engine={}, trusted_root=archive_dir)
    finally:
        dirs.close()
