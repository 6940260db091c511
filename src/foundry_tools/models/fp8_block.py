"""Block-quantized FP8 weights, as published FP8 checkpoints store them (Qwen3-30B-A3B-FP8, DeepSeek-V3).

Such a checkpoint's ``config.json`` carries ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``. Every linear
projection of the attention and of the experts is stored as ``float8_e4m3fn`` plus a float32
``<name>_scale_inv`` with one entry per 128 x 128 block (``ceil(out/128) x ceil(in/128)``): the
weight is ``fp8 * scale_inv`` block by block, each block scaled so that its largest magnitude is
the format's largest value (448). Embeddings, the LM head, norms and the MoE router (``mlp.gate``,
which SGLang keeps in bfloat16 under FP8) stay unquantized.

:func:`quantize` is what :func:`foundry_tools.weights.write_checkpoint` applies to each tensor
:func:`is_quantized` selects when the config asks for block FP8.
"""

from __future__ import annotations

import math
from typing import Any

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
#: Leaf names of the projections an FP8 checkpoint quantizes (attention and MLP / expert).
QUANTIZED_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def block_size(config: dict) -> tuple[int, int] | None:
    """The (rows, columns) of one scale block when ``config`` asks for block FP8, else None."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r}: only block FP8 ('fp8') is written")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {quant.get('fmt')!r}: only e4m3 is written")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            "quantization_config.weight_block_size must be two positive integers, e.g. [128, 128]"
        )
    return block[0], block[1]


def is_quantized(name: str, shape: tuple[int, ...], config: dict) -> bool:
    """Whether the checkpoint tensor ``name`` is stored in FP8."""
    if not name.endswith(".weight") or len(shape) != 2:
        return False
    module = name[: -len(".weight")]
    if module.rpartition(".")[2] not in QUANTIZED_LEAVES:
        return False
    skipped = (config.get("quantization_config") or {}).get("modules_to_not_convert") or ()
    return not any(module == s or module.startswith(s + ".") or f".{s}." in f".{module}." for s in skipped)


def quantize(weight: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """(float8_e4m3fn weight, float32 scale_inv per block) of a 2-D float ``weight``."""
    import torch

    rows, cols = weight.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # an all-zero block keeps a finite scale
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale_inv.contiguous()
