"""Embedded models: deterministic random-weight LLMs used by ``foundry demo`` and the benchmarks."""

from .qwen3 import Qwen3Config, Qwen3Model, build_model, to_hf_state_dict

__all__ = ["Qwen3Config", "Qwen3Model", "build_model", "to_hf_state_dict"]
