"""CPU tests of the embedded Qwen3 model: determinism, HF parity, static-cache decode contract, presets."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from foundry_tools.models import Qwen3Config, Qwen3Model, build_model, to_hf_state_dict

transformers = pytest.importorskip("transformers")

TINY = Qwen3Config.preset("tiny", max_seq_len=64)
# Prompt lengths of the three rows: different, so every decode step uses different positions per row.
LENGTHS = [5, 9, 3]
DECODE_STEPS = 4
# fp32 on CPU: our kernels and HF's differ only in summation order.
ATOL, RTOL = 2e-5, 1e-4


def _tiny(seed: int = 0, **overrides) -> Qwen3Model:
    cfg = dataclasses.replace(TINY, **overrides)
    return build_model(cfg, seed=seed, device="cpu", dtype=torch.float32)


def _hf_model(model: Qwen3Model):
    hf_cfg = transformers.Qwen3Config(**model.config.to_hf_dict())
    hf = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.float32).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=True)
    assert not missing and not unexpected
    return hf


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _right_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(prompts), max(LENGTHS), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return ids, torch.tensor([len(p) for p in prompts])


# -- determinism ------------------------------------------------------------------------------------


def test_same_seed_same_weights_different_seed_different():
    a, b, c = _tiny(seed=7), _tiny(seed=7), _tiny(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    matrices = [n for n in sa if not n.endswith("norm.weight")]
    assert matrices
    for name in matrices:
        assert not torch.equal(sa[name], sc[name]), name
    for name in sa:
        if name.endswith("norm.weight"):
            assert torch.equal(sa[name], torch.ones_like(sa[name])), name


def test_build_does_not_touch_global_rng():
    state = torch.get_rng_state()
    _tiny(seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_weight_statistics_and_flags():
    m = _tiny(seed=0)
    assert not m.training
    assert all(not p.requires_grad for p in m.parameters())
    std = m.embed_tokens.std().item()
    assert 0.018 < std < 0.022
    assert m.param_bytes() == m.config.param_count() * 4


# -- parity with transformers -----------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_prefill_and_decode_match_transformers(tied):
    model = _tiny(seed=11, tie_word_embeddings=tied)
    hf = _hf_model(model)
    prompts = _prompts(model.config.vocab_size)
    ids, lengths = _right_padded(prompts)
    model.allocate_kv_cache(max_batch=4, max_seq_len=32)

    with torch.no_grad():
        logits = model.prefill(ids, lengths)
        assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)
        seqs = [p.clone() for p in prompts]
        for i, p in enumerate(prompts):
            ref = hf(p.view(1, -1)).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=RTOL)

        # Greedy decode through the static cache; at each step compare against HF's full forward
        # over the same token sequence (teacher forcing with our tokens, so rows cannot drift apart).
        positions = lengths.clone()
        for _ in range(DECODE_STEPS):
            next_ids = logits.argmax(-1)
            seqs = [torch.cat([s, t.view(1)]) for s, t in zip(seqs, next_ids, strict=True)]
            logits = model.decode(next_ids, positions)
            for i, s in enumerate(seqs):
                ref = hf(s.view(1, -1)).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=RTOL)
            positions += 1
        final_tokens = logits.argmax(-1)

        # And HF's own greedy generate (with its KV cache) picks the same tokens.
        for i, p in enumerate(prompts):
            out = hf.generate(
                p.view(1, -1),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=DECODE_STEPS + 1,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            ours = torch.cat([seqs[i], final_tokens[i].view(1)])
            assert torch.equal(out[0], ours), (i, out[0].tolist(), ours.tolist())


def test_decode_matches_prefill_of_longer_prompt():
    # Self-consistency independent of HF: prefill(prefix) + decode(rest) == prefill(whole).
    model = _tiny(seed=5)
    model.allocate_kv_cache(max_batch=2, max_seq_len=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model.prefill(ids)
        model.prefill(ids[:, :6])
        for t in range(6, 10):
            logits = model.decode(ids[:, t], torch.full((2,), t))
    torch.testing.assert_close(logits, whole, atol=ATOL, rtol=RTOL)


# -- static-cache decode contract -------------------------------------------------------------------


def test_decode_smaller_batch_only_touches_its_rows_and_slots():
    model = _tiny(seed=1)
    cache = model.allocate_kv_cache(max_batch=4, max_seq_len=16)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
    before = cache.clone()
    positions = torch.tensor([3, 11])
    with torch.no_grad():
        model.decode(torch.tensor([1, 2]), positions)
    assert model.kv_cache is cache
    # Rows 2 and 3 are untouched.
    assert torch.equal(cache[:, :, 2:], before[:, :, 2:])
    # Rows 0 and 1 changed exactly at their own position, in every layer, for k and v.
    changed = (cache != before).any(dim=-1)  # [L, 2, B, KV, S]
    for row, pos in enumerate(positions.tolist()):
        expected = torch.zeros(16, dtype=torch.bool)
        expected[pos] = True
        assert torch.equal(changed[:, :, row], expected.expand_as(changed[:, :, row])), row


def test_decode_rows_are_independent_of_batch_size():
    model = _tiny(seed=2)
    model.allocate_kv_cache(max_batch=4, max_seq_len=16)
    ids = torch.randint(0, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.prefill(ids)
        full = model.decode(torch.tensor([4, 5, 6, 7]), torch.tensor([6, 6, 6, 6]))
        model.prefill(ids)
        part = model.decode(torch.tensor([4, 5]), torch.tensor([6, 6]))
    torch.testing.assert_close(part, full[:2], atol=ATOL, rtol=RTOL)


def test_decode_ignores_cache_slots_after_position():
    # The mask must hide slots > position: filling them with large garbage must not change logits.
    model = _tiny(seed=4)
    cache = model.allocate_kv_cache(max_batch=2, max_seq_len=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    step = (torch.tensor([9, 10]), torch.tensor([5, 5]))
    with torch.no_grad():
        model.prefill(ids)
        clean = model.decode(*step)
        model.prefill(ids)
        cache[:, :, :, :, 6:] = 1e3
        dirty = model.decode(*step)
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


def test_decode_under_torch_compile_fullgraph():
    # fullgraph=True fails on any graph break; aot_eager needs no C++ toolchain on CPU.
    model = _tiny(seed=6)
    model.allocate_kv_cache(max_batch=3, max_seq_len=16)
    ids = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(3))
    step = (torch.tensor([1, 2, 3]), torch.tensor([4, 4, 4]))
    with torch.no_grad():
        model.prefill(ids)
        eager = model.decode(*step)
        eager_cache = model.kv_cache.clone()
        model.prefill(ids)
        compiled = torch.compile(model.decode, fullgraph=True, backend="aot_eager")(*step)
    torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(model.kv_cache, eager_cache, atol=ATOL, rtol=RTOL)


def test_bfloat16_path_runs_and_tracks_float32():
    # Serving dtype: bf16 weights and cache, fp32 logits; same seed, so close to the fp32 model.
    ref, model = _tiny(seed=9), build_model(TINY, seed=9, device="cpu", dtype=torch.bfloat16)
    assert model.param_bytes() == TINY.param_count() * 2
    ids = torch.randint(0, TINY.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    step = (torch.tensor([3, 1, 4]), torch.tensor([5, 5, 5]))
    with torch.no_grad():
        for m in (ref, model):
            m.allocate_kv_cache(max_batch=3, max_seq_len=16)
            m.prefill(ids)
        expected, logits = ref.decode(*step), model.decode(*step)
    assert model.kv_cache.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=0)


def test_cache_errors():
    model = _tiny(seed=0)
    with pytest.raises(RuntimeError):
        model.decode(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError):
        model.allocate_kv_cache(max_batch=1, max_seq_len=TINY.max_seq_len + 1)
    model.allocate_kv_cache(max_batch=2, max_seq_len=8)
    with pytest.raises(ValueError):
        model.decode(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError):
        model.prefill(torch.zeros(1, 9, dtype=torch.long))


# -- presets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,layers,hidden,heads,kv,head_dim,inter,vocab",
    [
        ("tiny", 2, 256, 4, 2, 64, 512, 1024),
        ("small", 8, 1024, 16, 8, 128, 3072, 32768),
        ("0.6b", 28, 1024, 16, 8, 128, 3072, 151936),
        ("1.7b", 28, 2048, 16, 8, 128, 6144, 151936),
    ],
)
def test_preset_shapes(name, layers, hidden, heads, kv, head_dim, inter, vocab):
    c = Qwen3Config.preset(name)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        layers,
        hidden,
        heads,
        kv,
        head_dim,
    )
    assert (c.intermediate_size, c.vocab_size) == (inter, vocab)
    assert c.tie_word_embeddings
    assert c.rope_theta == 1_000_000 and c.rms_norm_eps == 1e-6 and c.max_seq_len == 1024
    # param_count() agrees with our module and with transformers', both built on the meta device.
    ours = Qwen3Model(c, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in ours.parameters()) == c.param_count()
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c.to_hf_dict()))
    assert sum(p.numel() for p in hf.parameters()) == c.param_count()


def test_published_param_counts():
    # Qwen3-1.7B: 1.72e9 with tied embeddings; Qwen3-0.6B: 0.596e9.
    assert 1.70e9 < Qwen3Config.preset("1.7b").param_count() < 1.75e9
    assert 0.59e9 < Qwen3Config.preset("0.6b").param_count() < 0.60e9
    untied = Qwen3Config.preset("1.7b", tie_word_embeddings=False)
    assert untied.param_count() - Qwen3Config.preset("1.7b").param_count() == 151936 * 2048


def test_preset_overrides_and_errors():
    assert Qwen3Config.preset("small", max_seq_len=4096).max_seq_len == 4096
    with pytest.raises(ValueError):
        Qwen3Config.preset("7b")
    with pytest.raises(ValueError):
        Qwen3Config.preset("tiny", num_kv_heads=3)


def test_fingerprint_is_json_and_shape_sensitive():
    fps = [Qwen3Config.preset(n).fingerprint() for n in Qwen3Config.preset_names()]
    assert all(json.loads(json.dumps(fp)) == fp for fp in fps)
    assert len({json.dumps(fp, sort_keys=True) for fp in fps}) == len(fps)
    assert Qwen3Config.preset("tiny").fingerprint() == Qwen3Config.preset("tiny").fingerprint()
    tiny = Qwen3Config.preset("tiny").fingerprint()
    assert Qwen3Config.preset("tiny", max_seq_len=128).fingerprint() != tiny


# -- tensor parallel --------------------------------------------------------------------------------


def _tp_shards(tp_size: int, seed: int = 3) -> list[Qwen3Model]:
    """``tp_size`` shards of one model, their all-reduce a sum across threads (one per rank)."""
    import threading

    shards = [
        build_model(TINY, seed=seed, dtype=torch.float32, tp_rank=r, tp_size=tp_size) for r in range(tp_size)
    ]
    barrier = threading.Barrier(tp_size)
    slots: list = [None] * tp_size

    def reduce_for(rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = sum(slots[1:], slots[0])  # the same order on every rank
            barrier.wait()
            return total

        return all_reduce

    for rank, shard in enumerate(shards):
        for layer in shard.layers:
            layer.all_reduce = reduce_for(rank)
    return shards


def _run_ranks(shards, fn) -> list:
    import threading

    out: list = [None] * len(shards)
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, fn(shards[r]))) for r in range(len(shards))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_tensor_parallel_shards_compute_the_whole_model():
    whole = build_model(TINY, seed=3, dtype=torch.float32)
    shards = _tp_shards(2)
    assert shards[0].layers[0].self_attn.num_kv_heads == TINY.num_kv_heads // 2
    assert shards[0].layers[0].mlp.down_proj.shape == (TINY.hidden_size, TINY.intermediate_size // 2)
    # Each shard holds its contiguous block of the whole model's matrices.
    q = whole.layers[1].self_attn.q_proj
    assert torch.equal(torch.cat([s.layers[1].self_attn.q_proj for s in shards]), q)
    down = whole.layers[0].mlp.down_proj
    assert torch.equal(torch.cat([s.layers[0].mlp.down_proj for s in shards], dim=1), down)
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))

    def steps(model):
        model.allocate_kv_cache(max_batch=2, max_seq_len=16)
        with torch.no_grad():
            model.prefill(ids[:, :5])
            return [model.decode(ids[:, t], torch.full((2,), t)) for t in (5, 6)]

    expected = steps(whole)
    per_rank = _run_ranks(shards, steps)
    for got in per_rank:
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[1]))  # ranks agree bitwise


def test_tensor_parallel_refuses_a_split_that_does_not_divide():
    with pytest.raises(ValueError, match="tp_size=3 must divide num_kv_heads=2"):
        build_model(TINY, seed=0, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank=2 outside tp_size=2"):
        build_model(TINY, seed=0, tp_rank=2, tp_size=2)
