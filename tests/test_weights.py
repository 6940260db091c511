"""CPU tests of foundry_tools.weights: seeded checkpoints that load everywhere and discriminate prompts.

A tiny Qwen3 (the shape of examples/qwen3-tiny, shrunk), tied and untied, a tiny Qwen3-MoE and a
tiny Qwen3-Next (the hybrid family) are written, loaded back with ``transformers.AutoModelForCausalLM.from_pretrained`` and decoded greedily.
The checks: every parameter comes from the file, the bytes are a function of the seed, and four
prompts give four different continuations, none of them degenerate (the failure of
``load_format="dummy"``: one token repeated, or two alternating).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from foundry_tools import weights

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen3-tiny" / "config.json"
SHRINK = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
)
# Four prompts; the first two differ only in their first token, so their continuations can differ
# only through attention to the context.
PROMPTS = [[11, 22, 33, 44, 55], [12, 22, 33, 44, 55], [300, 7, 90], [5, 5, 5, 5, 5, 5]]
NEW_TOKENS = 16


def _qwen3(**overrides) -> dict:
    base = json.loads(EXAMPLE.read_text()) if EXAMPLE.exists() else {"model_type": "qwen3"}
    return {**base, **SHRINK, **overrides}


def _qwen3_moe() -> dict:
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3MoeForCausalLM (qwen3_moe)")
    return {
        **_qwen3(),
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _qwen3_next() -> dict:
    """A tiny Qwen3-Next: gated-delta-net linear attention in three layers of four, full attention in
    the fourth, routed experts and a shared expert in every layer (benchmarks/configs/qwen3-next-4l.json,
    shrunk)."""
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextForCausalLM (qwen3_next)")
    config = json.loads(
        (Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen3-next-4l.json").read_text()
    )
    return {
        **config,
        **SHRINK,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "bos_token_id": None,  # the real ids lie outside the shrunk vocabulary
        "eos_token_id": None,
    }


def _load(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(shard))
    return out


def _greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """``NEW_TOKENS`` greedy tokens (no stop at EOS) and the log-probabilities of the first step."""
    seq = list(prompt)
    first = None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            if first is None:
                first = logits.log_softmax(-1)
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :], first


def _check_loaded_from_file(path: Path, summary: dict):
    model, info = _load(path)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"{kind}: {sorted(info[kind])}"
    files = _file_tensors(path)
    assert len(files) == summary["tensors"]
    state = model.state_dict()
    # Every tensor the model keeps under its file name is the file's; transformers 5 fuses routed
    # experts into one tensor per layer at load, which "missing_keys" above covers.
    unfused = [name for name in files if ".mlp.experts." not in name]
    for name in unfused:
        assert torch.equal(state[name], files[name].float()), name
    return model, files


def _check_discriminates(model) -> list[list[int]]:
    runs = [_greedy(model, prompt) for prompt in PROMPTS]
    continuations = [tokens for tokens, _ in runs]
    for tokens in continuations:
        assert len(set(tokens)) > 1, f"one token repeated: {tokens}"
        assert any(tokens[i] != tokens[i + 2] for i in range(len(tokens) - 2)), f"a 2-cycle: {tokens}"
    for i in range(len(PROMPTS)):
        for j in range(i + 1, len(PROMPTS)):
            assert continuations[i] != continuations[j], (PROMPTS[i], PROMPTS[j], continuations[i])
    tops = [first.topk(5) for _, first in runs]
    for i in range(len(tops)):
        for j in range(i + 1, len(tops)):
            same_ids = torch.equal(tops[i].indices, tops[j].indices)
            assert not (same_ids and torch.allclose(tops[i].values, tops[j].values)), (i, j)
    return continuations


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_loads_and_discriminates(tmp_path, tied):
    summary = weights.write_checkpoint(_qwen3(tie_word_embeddings=tied), tmp_path, seed=0)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["num_hidden_layers"] == 2
    index = json.loads((tmp_path / weights.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(summary["shards"])
    for fname, shard in summary["shards"].items():
        assert _sha256(tmp_path / fname) == shard["sha256"]

    model, files = _check_loaded_from_file(tmp_path, summary)
    assert ("lm_head.weight" in files) is not tied
    assert all(t.dtype == torch.bfloat16 for t in files.values())
    assert summary["tied_word_embeddings"] is tied
    if tied:
        assert summary["rules"]["final_norm_tied"] == 1 and summary["rules"]["first_mlp_tied"] == 1
    _check_discriminates(model)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    config = _qwen3()
    # A small shard limit: several shards, each within it (no single tensor here is larger).
    limit = 100_000
    a = weights.write_checkpoint(config, tmp_path / "a", seed=7, max_shard_bytes=limit)
    b = weights.write_checkpoint(config, tmp_path / "b", seed=7, max_shard_bytes=limit)
    c = weights.write_checkpoint(config, tmp_path / "c", seed=8, max_shard_bytes=limit)
    assert len(a["shards"]) > 1
    assert all(s["bytes"] <= limit for s in a["shards"].values())
    assert a["shards"] == b["shards"]
    for fname in a["shards"]:
        assert (tmp_path / "a" / fname).read_bytes() == (tmp_path / "b" / fname).read_bytes()
    assert a["shards"].keys() == c["shards"].keys()
    for fname in a["shards"]:
        assert a["shards"][fname]["sha256"] != c["shards"][fname]["sha256"], fname
    # Random tensors differ between seeds; the constant ones (norms) do not, by design.
    ta, tc = _file_tensors(tmp_path / "a"), _file_tensors(tmp_path / "c")
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])
    assert torch.equal(ta["model.norm.weight"], tc["model.norm.weight"])


def test_scaling_rules(tmp_path):
    """The scales the module documents, measured on the file (bf16, so loose tolerances)."""
    layers, hidden = 2, SHRINK["hidden_size"]
    weights.write_checkpoint(_qwen3(), tmp_path, seed=3)
    files = {name: t.float() for name, t in _file_tensors(tmp_path).items()}
    assert files["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    q = files["model.layers.0.self_attn.q_proj.weight"]
    assert q.std().item() == pytest.approx(1 / math.sqrt(hidden), rel=0.1)
    down = files["model.layers.0.mlp.down_proj.weight"]
    expected = 1 / math.sqrt(SHRINK["intermediate_size"] * 2 * layers)
    assert down.std().item() == pytest.approx(expected, rel=0.1)
    for name, tensor in files.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name


def test_scaling_rules_tied(tmp_path):
    """Tied embeddings: a small embedding (it is the LM head too), random signs on the final norm, the
    first MLP at full size and the attention before it scaled to the small embedding."""
    layers, hidden, inter = 2, SHRINK["hidden_size"], SHRINK["intermediate_size"]
    weights.write_checkpoint(_qwen3(tie_word_embeddings=True), tmp_path, seed=3)
    files = {name: t.float() for name, t in _file_tensors(tmp_path).items()}
    assert "lm_head.weight" not in files
    small = 1 / math.sqrt(hidden)
    assert files["model.embed_tokens.weight"].std().item() == pytest.approx(small, rel=0.05)
    final = files["model.norm.weight"]
    assert set(final.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(files["model.layers.0.input_layernorm.weight"], torch.ones(hidden))
    first_mlp = files["model.layers.0.mlp.down_proj.weight"].std().item()
    assert first_mlp == pytest.approx(1 / math.sqrt(inter), rel=0.1)
    later_mlp = files["model.layers.1.mlp.down_proj.weight"].std().item()
    assert later_mlp == pytest.approx(1 / math.sqrt(inter * 2 * layers), rel=0.1)
    early_attn = files["model.layers.0.self_attn.o_proj.weight"].std().item()
    assert early_attn == pytest.approx(small / math.sqrt(2 * layers * hidden), rel=0.1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_few_repeats_over_many_prompts(tmp_path, tied):
    """32 random prompts, 24 greedy tokens each: a token rarely follows itself or the token before
    last (dummy weights, or tied embeddings without the tied rules, do it at most steps)."""
    weights.write_checkpoint(_qwen3(tie_word_embeddings=tied), tmp_path, seed=0)
    model, _ = _load(tmp_path)
    seq = torch.randint(0, SHRINK["vocab_size"], (32, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(24):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    new = seq[:, 8:]
    repeat = (new[:, 1:] == new[:, :-1]).float().mean().item()
    back2 = (new[:, 2:] == new[:, :-2]).float().mean().item()
    assert repeat < 0.15 and back2 < 0.15, (repeat, back2)
    assert len(set(new[:, 0].tolist())) >= 24  # the first tokens differ across prompts


def test_qwen3_moe_loads_and_discriminates(tmp_path):
    config = _qwen3_moe()
    summary = weights.write_checkpoint(config, tmp_path, seed=0)
    # The published checkpoint layout the engines' loaders expect: one tensor per expert.
    names = set(json.loads((tmp_path / weights.INDEX_NAME).read_text())["weight_map"])
    for e in range(config["num_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.0.mlp.experts.{e}.{proj}.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names  # the router
    model, _ = _check_loaded_from_file(tmp_path, summary)
    _check_discriminates(model)

    again = weights.write_checkpoint(config, tmp_path / "again", seed=0)
    other = weights.write_checkpoint(config, tmp_path / "other", seed=1)
    assert again["shards"] == summary["shards"]
    assert all(other["shards"][f]["sha256"] != summary["shards"][f]["sha256"] for f in summary["shards"])


def test_qwen3_next_loads_and_discriminates(tmp_path):
    """The hybrid family's checkpoint: every linear-attention parameter (projections, the causal
    convolution, A_log, dt_bias, the gated norm) comes from the file, and the prompts continue
    differently, the first two (which differ in their first token only) through the recurrent state
    and the one full-attention layer."""
    config = _qwen3_next()
    summary = weights.write_checkpoint(config, tmp_path, seed=0)
    names = set(json.loads((tmp_path / weights.INDEX_NAME).read_text())["weight_map"])
    assert "model.layers.0.linear_attn.A_log" in names and "model.layers.3.self_attn.q_proj.weight" in names
    model, _ = _check_loaded_from_file(tmp_path, summary)
    _check_discriminates(model)


def test_command_line_prints_the_summary(tmp_path, capsys):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(_qwen3()))
    out = tmp_path / "ckpt"
    assert weights.main(["--config", str(config_path), "--out", str(out), "--seed", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["seed"] == 5 and summary["dtype"] == "bfloat16"
    for fname, shard in summary["shards"].items():
        assert _sha256(out / fname) == shard["sha256"]
    with pytest.raises(SystemExit):
        weights.main(["--config", str(config_path), "--out", str(out), "--dtype", "int8"])


@pytest.mark.parametrize(
    ("name", "per_layer"),
    [
        (
            "qwen3-moe-4l.json",
            ["mlp.experts.127.down_proj.weight", "mlp.gate.weight", "self_attn.q_proj.weight"],
        ),
        (
            "qwen3-30b-a3b-fp8-4l.json",
            ["mlp.experts.127.down_proj.weight", "mlp.gate.weight", "self_attn.o_proj.weight"],
        ),
        (
            "qwen3-next-4l.json",
            ["linear_attn.in_proj_qkvz.weight", "linear_attn.A_log", "mlp.shared_expert.up_proj.weight"],
        ),
    ],
)
def test_the_benchmark_model_configs_plan_in_the_published_layout(name, per_layer):
    """benchmarks/configs (the models the engine benchmarks serve with --weights seeded): the
    checkpoint plan has the names the engines' loaders expect, without allocating the weights."""
    config = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / name
    raw, ctx, tensors, arch = weights.plan_checkpoint(config)
    names = {t.name for t in tensors}
    assert arch == raw["architectures"][0] and ctx.num_layers == 4
    assert all(f"model.layers.0.{suffix}" in names for suffix in per_layer)
    if "fp8" in name:  # block FP8 where published checkpoints have it (the 48-layer shape's outputs)
        from foundry_tools.models import fp8_block

        by_name = {t.name: t for t in tensors}
        quantized = {n for n, t in by_name.items() if fp8_block.is_quantized(n, t.shape, raw)}
        assert fp8_block.block_size(raw) == (128, 128)
        assert {
            "model.layers.0.mlp.experts.127.down_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
        } <= quantized
        assert "model.layers.0.mlp.gate.weight" not in quantized and "lm_head.weight" not in quantized
    if "next" in name:  # three linear-attention layers, then one full-attention layer
        assert (
            "model.layers.3.self_attn.q_proj.weight" in names
            and "model.layers.3.linear_attn.A_log" not in names
        )
