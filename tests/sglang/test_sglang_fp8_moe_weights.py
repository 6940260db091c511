"""The seeded-weights writer makes block-quantized FP8 Qwen3-MoE checkpoints (the Qwen3-30B-A3B-FP8
layer shape): SGLang's own FP8 config reads the example's quantization, and a small checkpoint of the
same structure loads back with scales that reproduce the bfloat16 weights of the same seed through
SGLang's own block dequantization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-moe-fp8-4l" / "config.json"


def _small(config: dict) -> dict:
    """The example's structure at a size a CPU writes in seconds; 192 keeps a partial 128-block."""
    return {
        **config,
        "hidden_size": 256,
        "intermediate_size": 384,
        "moe_intermediate_size": 192,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    }


def test_the_example_is_the_qwen3_30b_a3b_fp8_layer_shape_and_sglang_reads_its_quantization():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from foundry_tools.models import fp8_block
    from foundry_tools.weights import plan_checkpoint

    config = json.loads(EXAMPLE.read_text())
    assert (config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]) == (4, 128, 8)
    quant = Fp8Config.from_config(config["quantization_config"])
    assert quant.is_checkpoint_fp8_serialized and list(quant.weight_block_size) == [128, 128]
    _raw, _ctx, tensors, architecture = plan_checkpoint(config)  # meta device only
    assert architecture == "Qwen3MoeForCausalLM"
    fp8 = [t for t in tensors if fp8_block.is_quantized(t.name, t.shape, config)]
    assert len(fp8) == 4 * (4 + 3 * 128)  # q/k/v/o and every expert's gate/up/down, per layer
    assert not [t.name for t in fp8 if t.name.endswith("mlp.gate.weight")]  # the router stays bf16
    # Every quantized dimension of this shape is whole 128-blocks (SGLang's block kernels need it).
    assert all(d % 128 == 0 for t in fp8 for d in t.shape)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from foundry_tools.weights import write_checkpoint

    config = _small(json.loads(EXAMPLE.read_text()))
    fp8_dir, bf16_dir = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("bf16")
    summary = write_checkpoint(config, fp8_dir, seed=3)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    write_checkpoint(plain, bf16_dir, seed=3)
    return summary, fp8_dir, bf16_dir


def _load(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_a_small_fp8_moe_checkpoint_loads_back_with_consistent_block_scales(written):
    import torch
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    summary, fp8_dir, bf16_dir = written
    assert summary["fp8_block"] == [128, 128] and summary["fp8_tensors"] == 2 * (4 + 3 * 4)
    fp8, bf16 = _load(fp8_dir), _load(bf16_dir)
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(fp8)
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]
    scales = [n for n in fp8 if n.endswith(".weight_scale_inv")]
    assert len(scales) == summary["fp8_tensors"]
    for scale_name in scales:
        name = scale_name[: -len("_scale_inv")]
        q, s, ref = fp8[name], fp8[scale_name], bf16[name].float()
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        rows, cols = q.shape
        assert s.shape == (-(-rows // 128), -(-cols // 128))
        # Each block's largest magnitude is the format's largest value: scales are the blocks' own.
        padded = torch.zeros(s.shape[0] * 128, s.shape[1] * 128)
        padded[:rows, :cols] = q.float().abs()
        assert torch.equal(
            padded.view(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3)), torch.full_like(s, 448.0)
        )
        back = block_quant_dequant(q, s, [128, 128], torch.float32)
        # e4m3 keeps 3 mantissa bits: within 1/16 of the value, or of the block's smallest step.
        tolerance = ref.abs() / 16 + s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols] / 8
        assert bool(((back - ref).abs() <= tolerance).all()), name
    # The router, norms, embeddings and LM head are the bf16 checkpoint's, bit for bit.
    for name, tensor in fp8.items():
        if name not in index or name.endswith("_scale_inv") or tensor.dtype == torch.float8_e4m3fn:
            continue
        assert torch.equal(tensor, bf16[name]), name
    assert any(n.endswith("mlp.gate.weight") for n in fp8)
