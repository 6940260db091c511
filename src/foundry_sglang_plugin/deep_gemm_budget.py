"""SGLang's DeepGEMM MoE layout budget, the same at LOAD as at SAVE (block-FP8 MoE models).

With the DeepGEMM MoE runner (``--moe-runner-backend deep_gemm``, or ``auto`` for an FP8 model on
Hopper/Blackwell) SGLang 0.5.23 picks, for each MoE call, between the masked and the compact
activation layout by comparing the call's estimated peak with a budget taken from free device memory
(``SGLANG_DEEPGEMM_STANDARD_LAYOUT=auto``, the default). The budget is set twice before the decode
capture: by the first eager MoE call of the runner warmup (this rank's free memory), then by
``refresh_deep_gemm_layout_memory_budget`` (the free memory of all ranks) right before the capture.
Free memory is not the same at LOAD (the archive is being rebuilt beside the model), so the layouts,
and with them what the warmup allocates in the setup LOAD repeats, could differ from SAVE's.

SAVE records the budget each of the two steps left (in the archive's pool sizing, ``slots``); LOAD
runs SGLang's steps (their collectives and cache emptying included) and then puts SAVE's value back.
The refresh SGLang makes after the whole start (for eager serving) is left to SGLang: it comes after
the archive is written.
"""

from __future__ import annotations

import sys
from typing import Any

MODULE = "sglang.srt.layers.moe.moe_runner.deep_gemm"
ATTR = "_masked_standard_layout_memory_budget_bytes"
SLOT = "deep_gemm_layout_budget"  # {"warmup": bytes | None, "capture": bytes | None} in the slots


def current() -> int | None:
    """The budget SGLang holds now (None: no DeepGEMM MoE call set one, or the module is not loaded)."""
    module = sys.modules.get(MODULE)
    return None if module is None else getattr(module, ATTR, None)


def impose(value: int | None) -> None:
    module = sys.modules.get(MODULE)
    if value is not None and module is not None:
        setattr(module, ATTR, int(value))


def around_step(session: Any, step: str, run: Any) -> Any:
    """Run SGLang's budget step ``step`` ("warmup" or "capture"); SAVE records the budget it left,
    LOAD replaces it with SAVE's."""
    if step == "warmup" and session.mode == "load":
        impose(_saved(session, step))  # the warmup's first MoE call then takes it instead of measuring
    result = run()
    if session.mode == "save" and session.slots is not None:
        session.slots.setdefault(SLOT, {})[step] = current()
    elif session.mode == "load":
        impose(_saved(session, step))
    return result


def _saved(session: Any, step: str) -> int | None:
    return ((session.slots or {}).get(SLOT) or {}).get(step)
