"""What Foundry can persist in SGLang, decided before any GPU work.

Foundry restores exactly one kind of artifact in SGLang: the full decode CUDA graphs that the
pluggable decode backend captures, plus the memory-pool sizing those graphs were captured against.
Every setting below changes what runs inside or around those graphs in a way a restored graph cannot
follow, so it is refused at startup with a one-line reason instead of failing (or silently
recapturing) later. All the rules live in :func:`check_supported`.
"""

from __future__ import annotations

import os
from typing import Any

from foundry_core.engine.refusal import FoundryUnsupportedError as _Refusal
from foundry_sglang_plugin._view import has_field, reader


class FoundryUnsupportedError(_Refusal):
    """An SGLang configuration Foundry refuses; ``str(err)`` is one line naming every reason."""

    def __init__(self, reasons: list[str]):
        super().__init__("SGLang", reasons)


_DEEPEP_BACKENDS = ("deepep", "deepep_v2")


def _env_switch_on(name: str) -> bool:
    """Whether an ``SGLANG_*`` switch is set to something other than its declared default."""
    import os

    if name not in os.environ:
        return False
    try:
        from sglang.srt.environ import envs

        field = getattr(type(envs), name)
        return field.get() != field._resolve_default()
    except (ImportError, AttributeError):
        return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _field_on(value: Any) -> bool:
    """A refused field is refused at any value but off/empty (False, None, 0, "", "none", empty)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "null", "false", "0")
    return bool(value)


def _classified_refusals(read: Any) -> list[str]:
    from foundry_sglang_plugin import classified

    reasons = []
    for why, names in classified.SERVER_REFUSED.items():
        on = [f"--{n.replace('_', '-')}" for n in names if _field_on(read(n))]
        if on:
            reasons.append(f"{', '.join(on)} not supported ({why})")
    for why, names in classified.ENV_REFUSED.items():
        on = [n for n in names if _env_switch_on(n)]
        if on:
            reasons.append(f"{', '.join(on)} not supported ({why})")
    return reasons


def cuda_device_count() -> int:
    """CUDA devices this process sees, asked without creating a CUDA context (SGLang's launcher
    forks after this)."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # no driver, a broken install: no device Foundry could capture on
        return 0


def check_cuda_present(server_args: Any) -> None:
    """Raise :class:`FoundryUnsupportedError` for a CUDA launch on a machine with no CUDA device.

    Run in the launcher after :func:`check_supported`: without it such a launch settles a mode and
    then dies in the scheduler, where attaching Foundry's profiler interface (CUPTI) fails first,
    with an error that asks whether a profiler is attached."""
    device = reader(server_args)("device", None)
    if device not in (None, "cuda"):
        return  # refused by check_supported already
    if cuda_device_count() < 1:
        reasons = ["no CUDA device is visible on this machine (Foundry captures and restores CUDA graphs"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            reasons[0] += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        reasons[0] += ")"
        raise FoundryUnsupportedError(reasons)


def graph_phase(server_args: Any, phase: str) -> tuple[str, list[int] | None]:
    """(backend, explicit batch sizes or None) of one CUDA-graph phase ("decode" or "prefill").

    A resolved record carries SGLang's own ``CudaGraphConfig``; a raw 0.5.2x record is read with the
    precedence SGLang's resolution applies (JSON > per-phase flags > per-phase off-switches > global
    switch > platform default); releases before the per-phase config expose ``disable_cuda_graph``,
    ``cuda_graph_bs`` and the piecewise (prefill) switches instead.
    """
    read = reader(server_args)
    config = read("cuda_graph_config")
    if config is not None and hasattr(config, phase):  # resolved CudaGraphConfig
        settings = getattr(config, phase)
        return settings.backend, _sizes(settings.bs)
    if has_field(server_args, f"cuda_graph_backend_{phase}"):
        backend = _default_backend(phase)
        if read("disable_cuda_graph", False) or read(f"disable_{phase}_cuda_graph", False):
            backend = "disabled"
        if read(f"cuda_graph_backend_{phase}") is not None:
            backend = read(f"cuda_graph_backend_{phase}")
        sizes = _sizes(read(f"cuda_graph_bs_{phase}"))
        explicit = config.get(phase) if isinstance(config, dict) else None
        if isinstance(explicit, dict):
            backend = explicit.get("backend", backend)
            if "bs" in explicit:
                sizes = _sizes(explicit["bs"])
        return backend, sizes
    # Releases before the per-phase graph configuration.
    if phase == "decode":
        backend = "disabled" if read("disable_cuda_graph", False) else "full"
        return backend, _sizes(read("cuda_graph_bs"))
    if has_field(server_args, "enable_piecewise_cuda_graph"):
        on = bool(read("enable_piecewise_cuda_graph", False))
    else:
        on = has_field(server_args, "disable_piecewise_cuda_graph") and not read(
            "disable_piecewise_cuda_graph", False
        )
    return ("piecewise" if on else "disabled"), None


def _sizes(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _default_backend(phase: str) -> str:
    if phase == "decode":
        return "full"
    try:
        from sglang.srt.model_executor.cuda_graph_config import default_prefill_backend
    except ImportError:
        return "breakable"
    return default_prefill_backend()


def check_supported(server_args: Any) -> None:
    """Raise :class:`FoundryUnsupportedError` when Foundry cannot persist this configuration.

    Works on a raw record (straight from the argument parser) and on a resolved one; on a resolved
    record the values resolution decided are the ones judged. Reads no file and touches no GPU.
    """
    read = reader(server_args)
    reasons: list[str] = []

    device = read("device", None)
    if device not in (None, "cuda"):  # before anything else: nothing below applies off CUDA
        reasons.append(f"--device {device} is not supported (Foundry persists CUDA graphs)")

    prefill_backend, _ = graph_phase(server_args, "prefill")
    if prefill_backend != "disabled":
        reasons.append(
            f"prefill (piecewise) CUDA graphs are enabled (backend {prefill_backend!r}, "
            "pass --cuda-graph-backend-prefill disabled)"
        )
    decode_backend, decode_sizes = graph_phase(server_args, "decode")
    if decode_backend != "full":
        reasons.append(
            f"decode CUDA graphs must use the 'full' backend (got {decode_backend!r}, "
            "Foundry persists full decode graphs only)"
        )

    algorithm = read("speculative_algorithm")
    if algorithm not in (None, "", "NONE", "none"):
        reasons.append(f"speculative decoding ({algorithm}) is not supported")
    if read("enable_lora", False) or read("lora_paths") or read("uno_lora_path"):
        reasons.append("LoRA is not supported (adapter batches change the captured graphs)")
    if read("enable_pdmux", False):
        reasons.append("PD multiplexing (--enable-pdmux) is not supported")
    if (read("pp_size", 1) or 1) > 1:
        reasons.append(f"pipeline parallelism (pp_size={read('pp_size')}) is not supported")
    if (
        read("enable_return_hidden_states", False)
        or read("return_hidden_states_mode")
        or read("enable_return_aux_hidden_states", False)
    ):
        reasons.append("hidden-state output is not supported (it changes the decode graph outputs)")
    if read("dllm_algorithm"):
        reasons.append(
            f"diffusion language models (dllm_algorithm={read('dllm_algorithm')}) are not supported"
        )
    a2a = read("moe_a2a_backend")
    if a2a in _DEEPEP_BACKENDS or read("enable_deepep_moe", False):
        reasons.append(f"DeepEP ({a2a or 'deepep'}) is not supported through SGLang's decode-graph backend")
    if read("enable_memory_saver", False):
        reasons.append(
            "--enable-memory-saver is not supported (it moves graph memory out of the Foundry region)"
        )
    disagg = read("disaggregation_mode", "null")
    if disagg not in (None, "null"):
        reasons.append(
            f"PD disaggregation (disaggregation_mode={disagg}) is not supported (KV transfer engines "
            "register and move pool memory)"
        )
    if read("startup_weight_load_mode", "serial") == "overlap":
        reasons.append(
            "--startup-weight-load-mode overlap is not supported (weights would land after graph capture)"
        )
    reasons.extend(_classified_refusals(read))
    if read("use_ray", False):
        reasons.append(
            "the Ray launcher is not supported (Foundry settings travel to schedulers by process spawn)"
        )

    tp_size = read("tp_size", 1) or 1
    if tp_size > 1:
        if not read("enable_torch_symm_mem", False):
            reasons.append(
                f"tensor parallelism (tp_size={tp_size}) needs --enable-torch-symm-mem "
                "(NCCL collectives are not restorable)"
            )
        if not read("disable_custom_all_reduce", False):
            reasons.append(
                "custom all-reduce is not supported under tensor parallelism (pass --disable-custom-all-reduce)"
            )
        alternates = [
            flag
            for flag, on in (
                ("--enable-symm-mem", read("enable_symm_mem", False)),
                ("--enable-mscclpp", read("enable_mscclpp", False)),
                ("--enable-aiter-allreduce-fusion", read("enable_aiter_allreduce_fusion", False)),
                ("--enable-fused-moe-sum-all-reduce", read("enable_fused_moe_sum_all_reduce", False)),
                (
                    "FlashInfer all-reduce fusion",
                    read("enable_flashinfer_allreduce_fusion", False)
                    or read("flashinfer_allreduce_fusion_backend") is not None,
                ),
            )
            if on
        ]
        if alternates:
            reasons.append(
                "alternate all-reduce paths are not supported under tensor parallelism: "
                + ", ".join(alternates)
            )
        if decode_sizes is None or len(set(decode_sizes)) != 1:
            shown = "automatic" if decode_sizes is None else decode_sizes
            reasons.append(
                f"more than one decode graph shape under tensor parallelism ({shown}, "
                "pass exactly one --cuda-graph-bs-decode N)"
            )
        if (read("attn_dp_size", 1) or 1) > 1 or read("enable_dp_attention", False):
            reasons.append(
                "data-parallel attention under tensor parallelism is not supported (its gathers run "
                "through NCCL inside the decode graph)"
            )
        if read("enable_dp_lm_head", False):
            reasons.append("--enable-dp-lm-head is not supported under tensor parallelism")
        if (read("nnodes", 1) or 1) > 1:
            reasons.append(
                f"tensor parallelism across nodes (nnodes={read('nnodes')}) is not supported (torch "
                "symmetric memory maps the peers' buffers within one node)"
            )
        dtype = str(read("dtype", "auto") or "auto")
        if dtype not in ("auto", "bfloat16"):
            reasons.append(
                f"--dtype {dtype} is not supported under tensor parallelism (SGLang's symmetric-memory "
                "all-reduce carries bfloat16, others would run through NCCL)"
            )

    if reasons:
        raise FoundryUnsupportedError(reasons)
