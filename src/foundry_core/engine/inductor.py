"""Inductor settings under which a LOAD's compiled code computes exactly what the SAVE's did.

An engine that compiles its model with torch.compile runs that code beside the restored graphs (the
prefill, mixed batches) and, through the carried caches, a LOAD runs the very kernels the SAVE
compiled. One Inductor step undoes that: before a reduction kernel first runs, torch (2.11) adds a
copy of its config with a halved reduction block when the kernel uses many registers
(``dynamic_scale_rblock``) and then benchmarks the copies against each other in every new process.
Near-tied timings pick differently from process to process, and a reduction block is a summation
order: on one H200 (2026-12-03, vLLM 0.26, dense Qwen3-1.7B shape) the LOAD rewrote 17 carried
``.best_config`` files, 5 with other contents, and its first prefill's logprobs differed from the
SAVE's. With the step off, each compiled kernel keeps the one config chosen when it was compiled, so
a LOAD benchmarks nothing and runs the SAVE's choice.

The settings are compile-time settings, part of the engine's compile-cache key: they must be the
same at SAVE and LOAD, so a plugin applies them at every start with Foundry on: vLLM's plugin into
its ``inductor_compile_config`` (:func:`pin`, what vLLM's own model compile takes), and both plugins
into the worker process's Inductor defaults (:func:`pin_process`), which every other torch.compile
call there compiles with: vLLM's sampler and MoE-router helpers, SGLang's MoE sum-reduce, which runs
eagerly at prefill, outside the restored graphs (torch 2.11 source, read 2026-12-03; such kernels
share the carried cache folder and would otherwise re-benchmark in every LOAD).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

logger = logging.getLogger("foundry")

#: Inductor config entries a start with Foundry on compiles with: the value, the environment variable
#: torch reads the entry's default from when ``torch._inductor.config`` is first imported ("1" or
#: "0"), and why (one line each).
PINNED: dict[str, tuple[Any, str, str]] = {
    "dynamic_scale_rblock": (
        False,
        "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK",
        "a new process benchmarks halved reduction blocks again and may pick another summation order",
    ),
}


def conflict(config: Mapping[str, Any]) -> str | None:
    """The first pinned key the user set to another value in ``config``, as
    ``"key=value: reason"``, or None."""
    for key, (value, _env, reason) in PINNED.items():
        if key in config and config[key] != value:
            return f"{key}={config[key]!r}: {reason}"
    return None


def pin_process(log: logging.Logger | None = None) -> dict[str, Any]:
    """Give this process's Inductor defaults :data:`PINNED`, before anything compiles: through the
    environment, which ``torch._inductor.config`` reads when it is first imported (importing it here
    would cost the start its import), and in the module itself where it is imported already.
    Returns ``{key: value it had}`` where a value to the contrary was set (in the environment, or
    in the imported module); the pin is logged once per process."""
    changed: dict[str, Any] = {}
    config = sys.modules.get("torch._inductor.config")
    for key, (value, env, reason) in PINNED.items():
        text = "1" if value else "0"
        before = getattr(config, key, None) if config is not None else os.environ.get(env)
        os.environ[env] = text
        if config is not None and hasattr(config, key):
            setattr(config, key, value)
        if before is not None and before not in (value, text):
            changed[key] = before
        if before is None or key in changed:
            (log or logger).info("Foundry: Inductor %s=%r in this process (%s)", key, value, reason)
    return changed


def pin(config: MutableMapping[str, Any]) -> str | None:
    """Put :data:`PINNED` into an engine's Inductor config dict (``config`` is changed in place).
    Returns :func:`conflict` when the user set a pinned key to another value (left as the user set
    it, and nothing else pinned: the caller refuses the start), else None."""
    why = conflict(config)
    if why is None:
        for key, (value, _env, _reason) in PINNED.items():
            config.setdefault(key, value)
    return why
