"""Seeded random checkpoints whose greedy outputs depend on the prompt.

One module, past 600 lines on purpose: the drawing rules, the plan read from the model and the
shard writer are the three steps of one operation (:func:`write_checkpoint`) over one data model
(:class:`Tensor`, :class:`Context`), and ``python -m foundry_tools.weights`` runs them as one.

``load_format="dummy"`` fills every weight with small uniform noise; such a model answers every
prompt with the same degenerate sequence (one token, or two alternating), so "the tokens are
identical" says little about a restored graph. :func:`write_checkpoint` writes, for a Hugging Face
causal-LM config, a real safetensors checkpoint from a seed: no download, and the engines' normal
loaders (SGLang, vLLM) and ``transformers`` read it like a published one. The weights are scaled so
that different prompts give different continuations (depending on the whole prompt, not only its
last token) and the activations stay in range in bfloat16 through many layers.

How it works:

* **Names and shapes** come from the model itself, built on the ``meta`` device
  (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``): nothing is allocated. Where
  ``transformers`` keeps parameters in another layout than its checkpoints (transformers 5 fuses the
  experts of an MoE layer into one tensor), its own reverse conversion (``revert_weight_conversion``,
  what ``save_pretrained`` uses) is applied to the meta tensors, so the file has the published
  checkpoints' names and shapes (``mlp.experts.7.gate_proj.weight``), which is what the engines'
  loaders expect. Tied weights are written once (no ``lm_head.weight`` when the model ties it to the
  embeddings); persistent buffers are written too.
* **Values**: each tensor is drawn on the CPU by its own ``torch.Generator``, seeded from ``seed`` and
  a sha256 of the tensor's name, so no tensor depends on the order or presence of any other, and the
  same seed gives the same bytes (with the same torch version). How a tensor is drawn is decided by
  :data:`RULES`, a small table by name suffix and module (first match wins, the last rule is the
  default), each rule with the reason it exists.
* **Files**: shards ``model-0000i-of-0000n.safetensors`` of at most ``max_shard_bytes`` (2 GB; a
  single tensor larger than that gets a shard of its own, safetensors cannot split one),
  ``model.safetensors.index.json`` and ``config.json``: the given config, copied, with
  ``torch_dtype`` set (and ``architectures`` added if it had none: the engines pick their model class
  by it). No tokenizer is written: give the engines token ids (or ``skip_tokenizer_init``).
* **Block FP8**: a config with ``quantization_config = {"quant_method": "fp8", "weight_block_size":
  [128, 128]}`` gets the attention and expert projections in ``float8_e4m3fn`` with their per-block
  ``weight_scale_inv``, as published FP8 checkpoints store them (:mod:`foundry_tools.models.fp8_block`).

The scaling in one paragraph: every matrix is normal(0, 1/sqrt(fan_in)), so each layer's outputs have
the size of its inputs; projections that write the residual stream are further scaled by
1/sqrt(2 * num_layers), so all layers together add about as much as the embedding (normal(0, 1)):
the stream stays near 1 at any depth, and the next token depends both on the current token and on
the context. Norms scale by 1, biases are 0, state-space parameters get the values those models
start from. Tied embeddings need three more rules (``final_norm_tied``, ``first_mlp_tied``,
``early_mixer_tied``): there the embedding is also the LM head, and the path token -> embedding ->
head is a symmetric form that makes a model repeat a token or alternate two. Not handled: models
that normalise each block's output before adding it (Gemma's post-attention / post-feedforward
norms) undo the residual scaling; their checkpoints load and run but repeat themselves more.

Command line (prints the summary as JSON)::

    python -m foundry_tools.weights --config CONFIG.json --out DIR [--seed N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RULES", "Context", "Rule", "Tensor", "plan_checkpoint", "rule_for", "write_checkpoint", "main"]

DTYPES = ("bfloat16", "float16", "float32")
MAX_SHARD_BYTES = 2_000_000_000
INDEX_NAME = "model.safetensors.index.json"

# Modules whose output is added to the residual stream (the last projection of an attention, a
# linear-attention or Mamba mixer, an MLP, an expert).
RESIDUAL_OUTPUTS = frozenset(
    {"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "c_proj", "w2", "fc2", "wo", "down"}
)
# Name parts and module class words that say a tensor belongs to an MLP / MoE block, not to a mixer.
_MLP_PARTS = frozenset(
    {"mlp", "feed_forward", "ffn", "moe", "block_sparse_moe", "experts", "shared_expert", "shared_experts"}
)
_MLP_CLASS = re.compile(r"MLP|MoE|Moe|Expert|FeedForward", re.IGNORECASE)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of the checkpoint: its name in the file, its shape, what the rules need to know."""

    name: str
    shape: tuple[int, ...]
    module_class: str = ""  # class of the module that owns it in transformers ("" if not known)
    norm_unit: float | None = None  # a norm's weight: the value that scales by 1 (0.0 for 1 + w)
    embedding: bool = False  # the weight of an nn.Embedding
    embed_scale: float = 1.0  # the factor the embedding module multiplies by (Gemma: sqrt(hidden))
    buffer: bool = False  # a persistent buffer, not a parameter
    layer: int | None = None  # the decoder layer it belongs to
    mlp: bool = False  # part of an MLP / MoE block
    role: str = ""  # tied models only: "final_norm", "first_mlp" or "early_mixer"


@dataclasses.dataclass(frozen=True)
class Context:
    """What the rules need to know about the whole model."""

    hidden_size: int
    num_layers: int
    tied: bool  # the LM head is the embedding matrix


@dataclasses.dataclass(frozen=True)
class Rule:
    """``match(tensor) -> bool``; ``draw(tensor, context, generator) -> float32 CPU tensor``."""

    name: str
    match: Callable[[Tensor], bool]
    draw: Callable[[Tensor, Context, Any], Any]
    why: str


# ----------------------------------------------------------------------------------------------------
# Drawing
# ----------------------------------------------------------------------------------------------------


def _leaf(name: str) -> str:
    """The module a tensor belongs to, by name: ``...self_attn.o_proj.weight`` -> ``o_proj``; a fused
    expert stack has no ``.weight``: ``...experts.down_proj`` -> ``down_proj``."""
    return re.sub(r"\.(weight|bias)$", "", name).rpartition(".")[2]


def _fan_in(t: Tensor, ctx: Context) -> int:
    """The number of inputs each output of the tensor sums over.

    2-D: ``nn.Linear`` layout (out, in). 3-D expert stacks that stay fused in checkpoints (gpt-oss
    ``experts.gate_up_proj``: (experts, in, out) or (experts, out, in) depending on the model): the
    input side is the hidden size for a projection that reads the residual stream and the other
    dimension for one that writes it. Anything else (convolutions): every dimension but the first
    (in-channels per group x kernel).
    """
    shape = t.shape
    if len(shape) == 2:
        return shape[1]
    if len(shape) == 3 and "expert" in t.name and "conv" not in t.name:
        a, b = shape[1], shape[2]
        if _leaf(t.name) in RESIDUAL_OUTPUTS:
            return a if b == ctx.hidden_size else b
        return a if a == ctx.hidden_size else b
    return max(1, math.prod(shape[1:]))


def _normal(t: Tensor, std: float, g: Any) -> Any:
    import torch

    return torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(std)


def _uniform(t: Tensor, low: float, high: float, g: Any) -> Any:
    import torch

    return torch.rand(t.shape, generator=g, dtype=torch.float32).mul_(high - low).add_(low)


def _full(t: Tensor, value: float) -> Any:
    import torch

    return torch.full(t.shape, float(value), dtype=torch.float32)


def _embedding_std(ctx: Context) -> float:
    return 1.0 / math.sqrt(ctx.hidden_size) if ctx.tied else 1.0


def _residual_scale(ctx: Context) -> float:
    return 1.0 / math.sqrt(2 * max(1, ctx.num_layers))


def _a_log(t: Tensor, ctx: Context, g: Any) -> Any:
    return _uniform(t, 1.0, 16.0, g).log_()


def _dt_bias(t: Tensor, ctx: Context, g: Any) -> Any:
    dt = _uniform(t, math.log(1e-3), math.log(1e-1), g).exp_()
    return dt + (-(-dt).expm1()).log_()  # softplus^-1(dt) = log(exp(dt) - 1) = dt + log(1 - exp(-dt))


def _final_norm_tied(t: Tensor, ctx: Context, g: Any) -> Any:
    import torch

    signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.float32).mul_(2).sub_(1)
    return signs if t.norm_unit in (None, 1.0) else signs.sub_(1.0)  # (1 + w) convention: w = +-1 - 1


def _is_norm(t: Tensor) -> bool:
    if t.module_class:
        return "norm" in t.module_class.lower()
    return "norm" in _leaf(t.name).lower() or _leaf(t.name) in ("ln_f", "ln_1", "ln_2")


def _is_residual_output(t: Tensor) -> bool:
    return len(t.shape) >= 2 and _leaf(t.name) in RESIDUAL_OUTPUTS


# The rule table: the first rule whose ``match`` is true draws the tensor.
RULES: tuple[Rule, ...] = (
    Rule(
        "buffer",
        lambda t: t.buffer,
        lambda t, ctx, g: _full(t, 0.0),
        "Persistent buffers (e_score_correction_bias of DeepSeek-V3 / Nemotron-H routers, ...): not "
        "learned by gradient, the models start them at 0; a random one would skew routing.",
    ),
    Rule(
        "A_log",
        lambda t: t.name.endswith("A_log"),
        _a_log,
        "State decay of Mamba / gated-delta-net layers, A = -exp(A_log): log(uniform(1, 16)) as those "
        "models initialise it, a spread of time scales; noise around 0 would give decays near 1 "
        "everywhere (a state that never forgets).",
    ),
    Rule(
        "dt_bias",
        lambda t: t.name.endswith(("dt_bias", "dt_proj.bias")),
        _dt_bias,
        "Step size of Mamba / gated-delta-net layers, dt = softplus(x + dt_bias): the inverse softplus "
        "of dt log-uniform in [1e-3, 1e-1], small, so the state is neither frozen nor reset each token.",
    ),
    Rule(
        "D",
        lambda t: t.name.endswith(".D"),
        lambda t, ctx, g: _full(t, 1.0),
        "Mamba's skip connection y += D * x: 1, the value the models start from.",
    ),
    Rule(
        "final_norm_tied",
        lambda t: t.role == "final_norm",
        _final_norm_tied,
        "Tied embeddings, the norm in front of the LM head: random signs (+-1 in the norm's "
        "convention). The embedding of the current token is still in the stream, and with weights of "
        "1 its own logit gets sum_i e_ti^2 > 0 (the model repeats tokens); with random signs that sum "
        "averages 0.",
    ),
    Rule(
        "norm",
        lambda t: _is_norm(t) and t.name.endswith(".weight"),
        lambda t, ctx, g: _full(t, 1.0 if t.norm_unit is None else t.norm_unit),
        "Norm weights scale by exactly 1: 1 for y = w * norm(x), 0 for the y = (1 + w) * norm(x) "
        "convention (Gemma, Qwen3-Next), found by running the module with w = 0. Random scales would "
        "only distort what the norm normalised. A norm's bias is 0 (next rule).",
    ),
    Rule(
        "bias",
        lambda t: t.name.endswith((".bias", "_bias")),
        lambda t, ctx, g: _full(t, 0.0),
        "Biases 0: a random bias is a constant added for every token; it makes outputs depend less on "
        "the input, never more.",
    ),
    Rule(
        "embedding",
        lambda t: t.embedding or (not t.module_class and len(t.shape) == 2 and "embed" in t.name),
        lambda t, ctx, g: _normal(t, _embedding_std(ctx) / t.embed_scale, g),
        "Untied: normal(0, 1), as large as all layers' contributions together (see residual_output), "
        "so the next token depends on the current one and on the context. Tied, the embedding is also "
        "the LM head, and token -> embedding -> head gives logits E diag(w) E^T, a symmetric form "
        "(a predicts b as strongly as b predicts a: a, b, a, b cycles): the tied embedding is "
        "normal(0, 1/sqrt(hidden)), small in the stream (first_mlp_tied takes its place), and the "
        "logits E @ norm(h) have a spread of ~1, like an untied lm_head's (linear rule). Divided by "
        "the module's embed_scale where it multiplies its output (Gemma).",
    ),
    Rule(
        "conv",
        lambda t: len(t.shape) >= 3 and "conv" in t.name,
        lambda t, ctx, g: _normal(t, 1.0 / math.sqrt(_fan_in(t, ctx)), g),
        "Short causal convolutions of linear-attention / Mamba layers, (channels, in/group, kernel): "
        "normal(0, 1/sqrt(kernel * in/group)), a channel's output the size of its inputs.",
    ),
    Rule(
        "first_mlp_tied",
        lambda t: t.role == "first_mlp",
        lambda t, ctx, g: _normal(t, 1.0 / math.sqrt(_fan_in(t, ctx)), g),
        "Tied embeddings, the output of the first layer's MLP (or MoE): full size, normal(0, "
        "1/sqrt(fan_in)) with no depth factor. The small tied embedding, normalised, is its input, "
        "and its output becomes the stream's picture of the current token, size 1 like an untied "
        "embedding but unrelated to the LM head, so the symmetric path is left with a negligible "
        "share. Without it the stream would hold only context averages (mixers), and the model "
        "repeats itself.",
    ),
    Rule(
        "early_mixer_tied",
        lambda t: t.role == "early_mixer",
        lambda t, ctx, g: _normal(
            t, _embedding_std(ctx) * _residual_scale(ctx) / math.sqrt(_fan_in(t, ctx)), g
        ),
        "Tied embeddings, the output projection of the mixers (attention, linear attention, Mamba) up "
        "to the first MLP: scaled like residual_output but relative to the small tied embedding, so "
        "the first MLP still sees mostly the current token.",
    ),
    Rule(
        "residual_output",
        _is_residual_output,
        lambda t, ctx, g: _normal(t, _residual_scale(ctx) / math.sqrt(_fan_in(t, ctx)), g),
        "Projections that write the residual stream (o_proj, down_proj, out_proj, experts' down_proj): "
        "normal(0, 1/sqrt(fan_in)) times 1/sqrt(2 * num_layers). Pre-norm blocks each add their "
        "output; with this factor the 2 * num_layers additions sum to about the embedding's size, so "
        "the stream stays near 1 at any depth and neither drowns the current token nor is drowned.",
    ),
    Rule(
        "linear",
        lambda t: len(t.shape) >= 2,
        lambda t, ctx, g: _normal(t, 1.0 / math.sqrt(_fan_in(t, ctx)), g),
        "Every other matrix (q/k/v, gate/up, in_proj, experts, MoE routers, an untied lm_head): "
        "normal(0, 1/sqrt(fan_in)), outputs the size of the (normalised) inputs. The lm_head's logits "
        "then have a spread of ~1; a router's too, so its top-k changes from token to token and every "
        "expert is used.",
    ),
    Rule(
        "vector",
        lambda t: True,
        lambda t, ctx, g: _full(t, 0.0),
        "Anything else, vectors and scalars (attention sinks, ...): 0, neutral for an additive offset, "
        "which is what an unrecognised vector most often is.",
    ),
)


def rule_for(t: Tensor) -> Rule:
    """The rule that draws ``t``."""
    return next(rule for rule in RULES if rule.match(t))


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one tensor: ``seed`` and the tensor's name through sha256 (Python's ``hash`` is
    salted per process), 63 bits."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ----------------------------------------------------------------------------------------------------
# The config, the meta model and the list of tensors
# ----------------------------------------------------------------------------------------------------


def _load_config_dict(config: str | os.PathLike | dict) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


def _build_config(raw: dict):
    from transformers import AutoConfig

    if "model_type" not in raw:
        raise ValueError("the config has no model_type: cannot tell which model it describes")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(raw["model_type"], **fields)


def _meta_model(hf_config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def _norm_unit(module, cache: dict[type, float | None]) -> float | None:
    """1.0 if the norm computes ``w * norm(x)``, 0.0 if ``(1 + w) * norm(x)``, None if unknown.

    Found by running a CPU copy of the module with every parameter 0: a multiplicative weight then
    gives an all-zero output, an offset one does not.
    """
    cls = type(module)
    if cls in cache:
        return cache[cls]
    import torch

    unit: float | None = None
    try:
        probe = copy.deepcopy(module).to_empty(device="cpu")
        weight = getattr(probe, "weight", None)
        if weight is not None and weight.dim() == 1:
            with torch.no_grad():
                for p in probe.parameters():
                    p.zero_()
                x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0))
                try:
                    out = probe(x)
                except TypeError:  # a gated norm, forward(x, gate): a gate of ones keeps it nonzero
                    out = probe(x, torch.ones_like(x))
                out = out[0] if isinstance(out, (tuple, list)) else out
                if torch.isfinite(out).all():
                    unit = 1.0 if bool((out == 0).all()) else 0.0
    except Exception:  # a forward the probe cannot call: the norm rule falls back to 1
        unit = None
    cache[cls] = unit
    return unit


def _embed_scale(module) -> float:
    """The factor an embedding module multiplies its output by (Gemma's ``embed_scale``), else 1:
    the plain number such modules keep (``scalar_embed_scale``), or ``embed_scale`` where it is not a
    meta tensor (a meta tensor has no value)."""
    for attr in ("scalar_embed_scale", "embed_scale"):
        value = getattr(module, attr, None)
        if value is None or getattr(value, "is_meta", False):
            continue
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(value) and value > 0:
            return value
    return 1.0


def _revert(model, params: dict) -> dict:
    """Model-layout tensors -> checkpoint-layout tensors (meta in, meta out); the identity before
    transformers 5, which kept the checkpoint layout."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(params)
    return revert_weight_conversion(model, dict(params))


def _is_mlp(name: str, module_class: str) -> bool:
    return bool(_MLP_PARTS.intersection(name.split("."))) or bool(_MLP_CLASS.search(module_class))


def _checkpoint_tensors(model) -> tuple[list[Tensor], bool]:
    """Every tensor of the checkpoint, in file layout, with what the rules need to know about it; and
    whether the LM head is tied to the embeddings (the file then has no lm_head.weight)."""
    import torch

    config = model.config
    text_config = config.get_text_config()
    params = dict(model.named_parameters())  # a shared (tied) parameter appears once
    tied = bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    tied_keys = getattr(model, "_tied_weights_keys", None)
    if tied and isinstance(tied_keys, dict):  # transformers 5: {tied name: source name}
        for key, source in tied_keys.items():
            if key in params and source in params:
                del params[key]
    # Persistent buffers belong to the state dict too; loaders report them missing otherwise.
    every_param = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {name: b for name, b in model.state_dict().items() if name not in every_param}
    params.update(buffers)
    whole = _revert(model, params)

    cache: dict[type, float | None] = {}
    tensors: dict[str, Tensor] = {}
    order: dict[str, int] = {}  # file name -> position of its parameter in the model
    for position, (pname, param) in enumerate(params.items()):
        owner = model.get_submodule(pname.rpartition(".")[0]) if "." in pname else model
        owner_class = type(owner).__name__
        info = dict(
            module_class=owner_class,
            norm_unit=_norm_unit(owner, cache) if "norm" in owner_class.lower() else None,
            embedding=isinstance(owner, torch.nn.Embedding),
            embed_scale=_embed_scale(owner),
            buffer=pname in buffers,
            mlp=_is_mlp(pname, owner_class),
        )
        try:  # which file tensors this parameter becomes (several for a fused expert stack)
            mapped = _revert(model, {pname: param})
        except Exception:
            mapped = {}
        for name, tensor in mapped.items():
            if name in whole and tuple(whole[name].shape) == tuple(tensor.shape):
                tensors[name] = Tensor(name, tuple(whole[name].shape), **info)
                order[name] = position
    # Whatever the per-parameter mapping did not place is still written, ruled by its name alone.
    for name, tensor in whole.items():
        if name not in tensors:
            tensors[name] = Tensor(name, tuple(tensor.shape), mlp=_is_mlp(name, ""))
    for name, t in tensors.items():
        match = _LAYER.search(name)
        tensors[name] = dataclasses.replace(t, layer=int(match.group(1)) if match else None)

    tied = tied and not any(name.endswith("lm_head.weight") for name in tensors)
    if tied:
        _mark_tied_roles(tensors, order, getattr(text_config, "hidden_size", None))
    return [tensors[name] for name in sorted(tensors, key=_natural_key)], tied


def _mark_tied_roles(tensors: dict[str, Tensor], order: dict[str, int], hidden: int | None) -> None:
    """The tensors the tied-embedding rules apply to (see ``final_norm_tied``, ``first_mlp_tied``,
    ``early_mixer_tied``)."""
    # The norm in front of the LM head: the last registered norm weight of hidden size outside the
    # numbered layers (model.norm, backbone.norm_f, model.final_layernorm, LFM2's embedding_norm).
    finals = [
        name
        for name, t in tensors.items()
        if _is_norm(t) and name.endswith(".weight") and t.shape == (hidden,) and t.layer is None
    ]
    if finals:
        last = max(finals, key=lambda name: order.get(name, -1))
        tensors[last] = dataclasses.replace(tensors[last], role="final_norm")
    writers = [t for t in tensors.values() if _is_residual_output(t) and t.layer is not None]
    mlp_layers = [t.layer for t in writers if t.mlp]
    if not mlp_layers:
        return
    first = min(mlp_layers)
    for t in writers:
        if t.mlp and t.layer == first:
            tensors[t.name] = dataclasses.replace(t, role="first_mlp")
        elif not t.mlp and t.layer <= first:
            tensors[t.name] = dataclasses.replace(t, role="early_mixer")


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_checkpoint(config: str | os.PathLike | dict) -> tuple[dict, Context, list[Tensor], str]:
    """(config dict, context, the tensors in file layout, architecture) for a config; builds the
    model on the meta device only, allocates no weights."""
    raw = _load_config_dict(config)
    # Names and shapes are the unquantized model's; quantization is applied when writing (fp8_block).
    hf_config = _build_config({k: v for k, v in raw.items() if k != "quantization_config"})
    model = _meta_model(hf_config)
    text_config = hf_config.get_text_config()
    tensors, tied = _checkpoint_tensors(model)
    layers = getattr(text_config, "num_hidden_layers", None)
    if not layers:
        layers = len({t.layer for t in tensors if t.layer is not None}) or 1
    ctx = Context(hidden_size=int(text_config.hidden_size), num_layers=int(layers), tied=tied)
    return raw, ctx, tensors, type(model).__name__


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------


def _shards(tensors: list[Tensor], itemsize: int, max_bytes: int) -> list[list[Tensor]]:
    """Consecutive groups of tensors whose files stay within ``max_bytes``."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * itemsize + 256  # the data and a generous share of the header
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_checkpoint(
    config_path_or_dict: str | os.PathLike | dict,
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: str = "bfloat16",
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> dict:
    """Write a seeded random checkpoint for a Hugging Face causal-LM config into ``out_dir``.

    ``config_path_or_dict``: a ``config.json`` path, a directory holding one, or the dict itself (it
    must name its ``model_type``). Writes ``model-0000i-of-0000n.safetensors`` (removing shards of an
    earlier run in ``out_dir``), ``model.safetensors.index.json`` and ``config.json``. Deterministic:
    the same config, seed and dtype give byte-identical files. Returns a summary: ``tensors``,
    ``parameters``, ``bytes`` (all shards), ``shards`` ({file: {tensors, bytes, sha256}}), ``rules``
    ({rule: tensors drawn by it}), ``tied_word_embeddings``, ``architecture``, ``seed``, ``dtype``.
    """
    import torch
    from safetensors.torch import save_file

    from foundry_tools.models import fp8_block as block_fp8

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    raw, ctx, tensors, architecture = plan_checkpoint(config_path_or_dict)
    fp8_block = block_fp8.block_size(raw)  # the config asks for a block-FP8 checkpoint
    quantized = 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # shards of an earlier run would shadow or join this one
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", old.name):
            old.unlink()

    groups = _shards(tensors, torch.empty((), dtype=torch_dtype).element_size(), max_shard_bytes)
    weight_map: dict[str, str] = {}
    shards: dict[str, dict] = {}
    rules: dict[str, int] = {}
    data_bytes = parameters = 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for t in group:
            rule = rule_for(t)
            rules[rule.name] = rules.get(rule.name, 0) + 1
            g = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, t.name))
            data[t.name] = rule.draw(t, ctx, g).to(torch_dtype).contiguous()
            if fp8_block is not None and block_fp8.is_quantized(t.name, t.shape, raw):
                scale_name = t.name + block_fp8.SCALE_SUFFIX
                data[t.name], data[scale_name] = block_fp8.quantize(data[t.name], fp8_block)
                weight_map[scale_name] = fname
                quantized += 1
            weight_map[t.name] = fname
        data_bytes += sum(v.numel() * v.element_size() for v in data.values())
        parameters += sum(data[t.name].numel() for t in group)
        path = out / fname
        save_file(data, str(path), metadata={"format": "pt"})
        del data
        shards[fname] = {"tensors": len(group), "bytes": path.stat().st_size, "sha256": _sha256(path)}

    index = {"metadata": {"total_size": data_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config_out = dict(raw)
    config_out["torch_dtype"] = dtype
    if "dtype" in config_out:  # transformers 5's name for it: the two must agree
        config_out["dtype"] = dtype
    config_out.setdefault("architectures", [architecture])
    (out / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")

    return {
        "out_dir": str(out),
        "model_type": raw["model_type"],
        "architecture": architecture,
        "seed": int(seed),
        "dtype": dtype,
        "tied_word_embeddings": ctx.tied,
        "tensors": len(tensors),
        "parameters": parameters,
        "bytes": sum(s["bytes"] for s in shards.values()),
        "shards": shards,
        "rules": dict(sorted(rules.items())),
        "fp8_block": list(fp8_block) if fp8_block else None,
        "fp8_tensors": quantized,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m foundry_tools.weights",
        description="Write a seeded random safetensors checkpoint for a Hugging Face causal-LM config "
        "(no download) and print a JSON summary.",
    )
    parser.add_argument("--config", required=True, help="config.json, or a directory holding one")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument(
        "--max-shard-bytes", type=int, default=MAX_SHARD_BYTES, help="largest shard (default 2 GB)"
    )
    args = parser.parse_args(argv)
    summary = write_checkpoint(
        args.config, args.out, seed=args.seed, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes
    )
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
