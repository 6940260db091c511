"""A Qwen3-shaped decoder-only transformer in plain PyTorch, built for CUDA-graph capture of decode.

This is the embedded default model of ``foundry demo`` and the benchmarks.  It has Qwen3's
architecture (GQA attention with per-head q/k RMSNorm before RoPE, SwiGLU MLP, RMSNorm computed in
fp32, optional tied LM head) and random weights that are a pure function of a seed, so SAVE and LOAD
processes can rebuild the very same model without any checkpoint on disk.

Two forward paths share the same layers:

* :meth:`Qwen3Model.prefill` -- eager, variable shapes, fills the KV cache from position 0.
* :meth:`Qwen3Model.decode` -- one token per sequence, fixed shapes, written to be captured by
  ``torch.cuda.graph`` for a fixed batch size: it allocates nothing outside the graph's memory pool,
  creates no CPU tensors, never reads a tensor value on the host and has no data-dependent shapes.

Determinism of allocations (Foundry relies on it): :func:`build_model` and
:meth:`Qwen3Model.allocate_kv_cache` make the same sequence of device allocations, with the same
sizes, every time they are called with the same arguments in a fresh process.  The caching allocator
then hands out the same addresses in the SAVE and the LOAD process, which is what lets a saved graph
refer to weights and cache by address.  Do not add lazily created buffers, conditional allocations or
host-dependent ordering (e.g. iterating over a set) to this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Qwen3Config", "Qwen3Model", "build_model", "to_hf_state_dict"]

# Shapes of the presets.  "0.6b" and "1.7b" are the published Qwen3 shapes (both tie embeddings);
# "tiny" is for CPU tests and "small" for quick GPU runs.
_PRESETS: dict[str, dict] = {
    "tiny": dict(
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
    "small": dict(
        num_layers=8,
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=32768,
        tie_word_embeddings=True,
    ),
    "0.6b": dict(
        num_layers=28,
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.7b": dict(
        num_layers=28,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class Qwen3Config:
    """Shape of a Qwen3-style model.  ``max_seq_len`` bounds the RoPE tables and the KV cache."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 1024

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be positive")

    @classmethod
    def preset_names(cls) -> list[str]:
        return list(_PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides) -> Qwen3Config:
        """Named shape ("tiny", "small", "0.6b", "1.7b"); ``overrides`` replace fields (e.g. max_seq_len)."""
        try:
            fields = _PRESETS[name.lower()]
        except KeyError:
            raise ValueError(f"unknown Qwen3 preset {name!r}; choose from {sorted(_PRESETS)}") from None
        return cls(**{**fields, **overrides})

    def param_count(self) -> int:
        """Number of parameters, computed from the shape alone (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2 + 2 * d  # q,o + k,v + q/k norms
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h  # + input and post-attention norms
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + h + head  # + final norm

    def fingerprint(self) -> dict:
        """JSON-able description of everything that determines tensor shapes and numerics."""
        return {"arch": "qwen3", **dataclasses.asdict(self)}

    def to_hf_dict(self) -> dict:
        """Keyword arguments for ``transformers.Qwen3Config`` describing the same model."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers >= 5 reads rope_parameters; older releases read rope_theta.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "use_cache": True,
        }


def _weight(*shape: int, device, dtype) -> nn.Parameter:
    # Uninitialized on purpose: build_model fills every parameter in place from its own generator.
    # (nn.Linear would run kaiming init on the global RNG, which is slow and perturbs RNG state.)
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in fp32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float, *, device, dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _weight(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Non-interleaved ("rotate half") RoPE as in Qwen3: pairs are (i, i + head_dim/2).
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """GQA attention over this rank's share of the heads (all of them unless tensor-parallel): q, k,
    v column-parallel by head, o row-parallel, so the output is this rank's partial sum."""

    def __init__(self, cfg: Qwen3Config, *, device, dtype, tp_size: int = 1) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads // tp_size,
            cfg.num_kv_heads // tp_size,
            d,
        )
        self.q_proj = _weight(self.num_heads * d, h, device=device, dtype=dtype)
        self.k_proj = _weight(self.num_kv_heads * d, h, device=device, dtype=dtype)
        self.v_proj = _weight(self.num_kv_heads * d, h, device=device, dtype=dtype)
        self.o_proj = _weight(h, self.num_heads * d, device=device, dtype=dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [bs, T, hidden]
        cos: torch.Tensor,  # [bs or 1, T, 1, head_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [max_batch, n_kv, S, head_dim]
        v_cache: torch.Tensor,
        positions: torch.Tensor | None,  # None: prefill from 0; else decode, [bs] with T == 1
        mask: torch.Tensor | None,  # decode only: [bs, 1, 1, S] bool, True = may attend
    ) -> torch.Tensor:
        bs, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(F.linear(x, self.q_proj).view(bs, T, H, D))
        k = self.k_norm(F.linear(x, self.k_proj).view(bs, T, KV, D))
        v = F.linear(x, self.v_proj).view(bs, T, KV, D)
        q = _apply_rope(q, cos, sin).transpose(1, 2)  # [bs, H, T, D]
        k = _apply_rope(k, cos, sin).transpose(1, 2)  # [bs, KV, T, D]
        v = v.transpose(1, 2)
        group = H // KV
        if positions is None:
            k_cache[:bs, :, :T].copy_(k)
            v_cache[:bs, :, :T].copy_(v)
            # Eager path: materializing the repeated kv heads is fine here.
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True
            )
        else:
            # Write the new k/v at each row's own position, on device: scatter along the sequence dim.
            idx = positions.view(bs, 1, 1, 1).expand(bs, KV, 1, D)
            k_cache[:bs].scatter_(2, idx, k)
            v_cache[:bs].scatter_(2, idx, v)
            # GQA without copying the cache: with one query token, the `group` query heads that share
            # a kv head (heads j*group .. j*group+group-1, as in HF's repeat_kv) become `group` query
            # rows of an ordinary multi-head attention over that kv head.
            q = q.reshape(bs, KV, group, D)
            out = F.scaled_dot_product_attention(q, k_cache[:bs], v_cache[:bs], attn_mask=mask)
            out = out.reshape(bs, H, 1, D)
        return F.linear(out.transpose(1, 2).reshape(bs, T, H * D), self.o_proj)


class MLP(nn.Module):
    """SwiGLU; gate and up column-parallel, down row-parallel under tensor parallelism."""

    def __init__(self, cfg: Qwen3Config, *, device, dtype, tp_size: int = 1) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size // tp_size
        self.gate_proj = _weight(i, h, device=device, dtype=dtype)
        self.up_proj = _weight(i, h, device=device, dtype=dtype)
        self.down_proj = _weight(h, i, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, *, device, dtype, tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.self_attn = Attention(cfg, device=device, dtype=dtype, tp_size=tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(cfg, device=device, dtype=dtype, tp_size=tp_size)
        # Sums the ranks' partial outputs of the row-parallel projections (tensor parallel only).
        self.all_reduce = _identity

    def forward(self, x, cos, sin, k_cache, v_cache, positions, mask):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, positions, mask)
        x = x + self.all_reduce(attn)
        return x + self.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class Qwen3Model(nn.Module):
    """Qwen3 decoder with a static KV cache.  Build it with :func:`build_model`.

    Logits returned by :meth:`prefill` and :meth:`decode` are float32 whatever the model dtype
    (the LM head runs in the model dtype, its output is upcast), so sampling code sees one dtype.
    """

    def __init__(self, config: Qwen3Config, *, device, dtype, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        cfg = config
        if cfg.num_kv_heads % tp_size or cfg.intermediate_size % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide num_kv_heads={cfg.num_kv_heads} and "
                f"intermediate_size={cfg.intermediate_size}"
            )
        self.tp_size = tp_size
        # Registration order is the initialization order used by build_model; keep it fixed.
        self.embed_tokens = _weight(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, device=device, dtype=dtype, tp_size=tp_size) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _weight(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        )
        # RoPE tables for every position, gathered by position at run time (no trig in the graph).
        # Computed in fp32 then cast to the model dtype, as Qwen3 does.
        inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
        )
        freqs = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(dtype), persistent=False)
        # Filled by allocate_kv_cache.
        self.kv_cache: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None

    # -- weights -------------------------------------------------------------------------------------

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def param_bytes(self) -> int:
        """Bytes held by parameters (a tied embedding counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # -- KV cache ------------------------------------------------------------------------------------

    def allocate_kv_cache(
        self,
        max_batch: int,
        max_seq_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Allocate the static, zero-filled KV cache once (replacing any previous one) and return it.

        One tensor ``[num_layers, 2, max_batch, n_kv_heads, max_seq_len, head_dim]`` (a single
        allocation, so its address is reproducible); :meth:`layer_cache` gives the per-layer k and v,
        each ``[max_batch, n_kv_heads, max_seq_len, head_dim]``.  Zero-filled because masked keys
        still enter attention kernels: garbage NaN/inf there would poison 0-weight sums.
        Defaults: ``config.max_seq_len``, the device and dtype of the weights.
        """
        cfg = self.config
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        if not 0 < max_seq_len <= cfg.max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} must be in [1, config.max_seq_len={cfg.max_seq_len}]"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be positive")
        device = self.embed_tokens.device if device is None else device
        dtype = self.embed_tokens.dtype if dtype is None else dtype
        self.kv_cache = None  # release the old cache first so the allocation pattern does not depend on it
        self.key_positions = None
        self.kv_cache = torch.zeros(
            cfg.num_layers,
            2,
            max_batch,
            cfg.num_kv_heads // self.tp_size,
            max_seq_len,
            cfg.head_dim,
            device=device,
            dtype=dtype,
        )
        # Key index of every cache slot, compared against positions to build the decode mask.
        self.key_positions = torch.arange(max_seq_len, device=device)
        return self.kv_cache

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer's cache, each [max_batch, n_kv_heads, max_seq_len, head_dim]."""
        return self.kv_cache[layer, 0], self.kv_cache[layer, 1]

    def _require_cache(self, bs: int) -> None:
        # Shape checks only (Python ints): nothing here reads a tensor value.
        if self.kv_cache is None:
            raise RuntimeError("call allocate_kv_cache() before prefill/decode")
        if bs > self.kv_cache.shape[2]:
            raise ValueError(f"batch {bs} exceeds the KV cache's max_batch {self.kv_cache.shape[2]}")

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.lm_head_weight()).float()

    # -- forward paths -------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Eager prompt pass: [bs, seq] token ids -> float32 logits [bs, vocab] of each row's last token.

        Writes k/v for positions 0..seq-1 of cache rows 0..bs-1.  Rows may be right-padded: pass
        ``lengths`` [bs] (on the model's device) and logits come from position ``lengths - 1``; causal
        attention means real tokens never see the padding, and decode overwrites a padded slot before
        its mask can reach it.  Decode then continues at ``positions = lengths``.
        """
        bs, T = input_ids.shape
        self._require_cache(bs)
        if T > self.kv_cache.shape[4]:
            raise ValueError(f"prompt length {T} exceeds the KV cache's max_seq_len {self.kv_cache.shape[4]}")
        cos = self.rope_cos[:T].view(1, T, 1, -1)
        sin = self.rope_sin[:T].view(1, T, 1, -1)
        h = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, *self.layer_cache(i), None, None)
        if lengths is None:
            last = h[:, -1]
        else:
            last = h.gather(1, (lengths - 1).view(bs, 1, 1).expand(bs, 1, h.shape[-1])).squeeze(1)
        return self._logits(last)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step: token ids [bs] at positions [bs] -> float32 logits [bs, vocab].

        Writes the new k/v into cache rows 0..bs-1 at each row's position, then attends to cache
        slots 0..position of that row.  Rows >= bs are neither read nor written.  CUDA-graph
        capturable for a fixed bs: device-only ops, no host sync, fixed shapes.  Positions must be
        < the cache's max_seq_len (not checked: checking would need a host sync).
        """
        bs = input_ids.shape[0]
        self._require_cache(bs)
        cos = self.rope_cos.index_select(0, positions).view(bs, 1, 1, -1)
        sin = self.rope_sin.index_select(0, positions).view(bs, 1, 1, -1)
        mask = (self.key_positions.view(1, -1) <= positions.view(bs, 1)).view(bs, 1, 1, -1)
        h = F.embedding(input_ids.view(bs, 1), self.embed_tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, *self.layer_cache(i), positions, mask)
        return self._logits(h[:, 0])


#: Parameters split across tensor-parallel ranks, by name suffix -> the dimension split.
_TP_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


@torch.no_grad()
def build_model(
    config: Qwen3Config,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> Qwen3Model:
    """Build a Qwen3Model with random weights that are a pure function of (config, seed, device type, dtype).

    Weights are created directly on ``device`` and filled in place from a generator on that device
    seeded with ``seed``, in parameter registration order: matrices ~ N(0, 0.02), norm weights = 1.
    No global RNG is touched.  CPU and CUDA generators produce different streams, so the same seed
    gives different (but each reproducible) weights on CPU and on GPU.

    Allocation order is fixed (parameters in registration order, then the RoPE tables), which makes
    the device addresses of the weights reproducible across processes; see the module docstring.
    The model is returned in eval mode with ``requires_grad=False`` on every parameter, so capture
    records no autograd state.

    ``tp_size > 1``: rank ``tp_rank``'s shard of the same model (heads and MLP columns split in
    contiguous blocks, as vLLM and SGLang split them): each split matrix is drawn whole, in the same
    order, and this rank's block kept, so every rank holds a slice of one model. Each layer's
    ``all_reduce`` must then be set to a sum over the ranks before the model runs.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} outside tp_size={tp_size}")
    device = torch.device(device)
    model = Qwen3Model(config, device=device, dtype=dtype, tp_size=tp_size)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        dim = _TP_SPLIT.get(name.rsplit(".", 1)[-1]) if tp_size > 1 else None
        if dim is None:
            p.normal_(0.0, 0.02, generator=gen)
            continue
        shape = list(p.shape)
        shape[dim] *= tp_size
        whole = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        p.copy_(whole.chunk(tp_size, dim)[tp_rank])
        del whole
    return model.eval()


def to_hf_state_dict(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """State dict for ``transformers.Qwen3ForCausalLM`` built from ``model.config.to_hf_dict()``.

    Tensors are shared with ``model`` (no copies).  ``lm_head.weight`` is always present; with tied
    embeddings it is the embedding matrix itself.
    """
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        sd[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[pre + f"self_attn.{proj}.weight"] = getattr(attn, proj)
        sd[pre + "self_attn.q_norm.weight"] = attn.q_norm.weight
        sd[pre + "self_attn.k_norm.weight"] = attn.k_norm.weight
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sd[pre + f"mlp.{proj}.weight"] = getattr(mlp, proj)
    sd["model.norm.weight"] = model.norm.weight
    sd["lm_head.weight"] = model.lm_head_weight()
    return {k: v.detach() for k, v in sd.items()}
