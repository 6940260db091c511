"""Reading captured decode graphs out of vLLM's model runner, and putting restored ones back.

Two runner layouts exist across the supported releases, told apart by what the runner holds (feature
detection, not version numbers):

* Model Runner V2 (``vllm.v1.worker.gpu.model_runner``; the default where Triton is available in
  recent releases): a ``CudaGraphManager`` keeps ``graphs[BatchExecutionDescriptor]`` and one persistent
  ``hidden_states`` output buffer that every FULL graph writes into.
* Model Runner V1 (``vllm.v1.worker.gpu_model_runner``): the model is wrapped in a FULL-mode
  ``CUDAGraphWrapper`` that keeps ``concrete_cudagraph_entries[BatchDescriptor]`` with the graph and a
  (weak) reference to its output, which lives in the graph pool.

Graph names are built from the descriptor fields, so SAVE and LOAD agree on them without pickling vLLM
objects.  This module runs only inside a GPU worker with Foundry on; nothing here is exercised on CPU.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from foundry_core.engine.capture import keep_captured_graphs, kept_graph_class  # noqa: F401 (the worker's names)
from foundry_vllm_plugin.support import (
    FOUNDRY_CUDAGRAPH_MODE,
    HYBRID_STATE_BACKENDS,
    VALIDATED_ATTENTION_BACKENDS,
    FoundryUnsupportedError,
)


class FoundryRestoreError(RuntimeError):
    """Restored graphs do not match what this engine would have captured; one line."""


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    return value


def descriptor_key(desc: Any) -> dict:
    """A JSON-able dict of a (V1 or V2) batch descriptor's fields."""
    if dataclasses.is_dataclass(desc):
        items = {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}
    elif hasattr(desc, "_asdict"):
        items = desc._asdict()
    else:  # pragma: no cover - no release uses another form
        raise FoundryUnsupportedError(f"batch descriptor {type(desc).__name__}", "unknown layout")
    return {k: _plain(v) for k, v in items.items()}


def graph_name(key: dict) -> str:
    return "decode/" + ",".join(f"{k}={key[k]}" for k in sorted(key))


def attention_backend_names(runner: Any) -> set[str]:
    """Names of the attention backends the runner built (e.g. ``FLASH_ATTN``)."""
    names = set()
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups if isinstance(groups, list) else [groups]:
            backend = getattr(group, "backend", None)
            get_name = getattr(backend, "get_name", None)
            if callable(get_name):
                names.add(str(get_name()))
    return names


def _check_common(runner: Any) -> None:
    if getattr(runner, "use_aux_hidden_state_outputs", False):
        raise FoundryUnsupportedError("auxiliary hidden-state outputs", "they feed a draft model")
    if getattr(runner, "speculator", None) is not None or getattr(runner, "drafter", None) is not None:
        raise FoundryUnsupportedError("speculative decoding", "draft graphs are not persisted")
    backends = attention_backend_names(runner)
    model_config = getattr(runner, "model_config", None) or getattr(
        getattr(runner, "vllm_config", None), "model_config", None
    )
    accepted = VALIDATED_ATTENTION_BACKENDS | (
        HYBRID_STATE_BACKENDS if getattr(model_config, "is_hybrid", False) else frozenset()
    )
    unvalidated = sorted(backends - accepted)
    if unvalidated:
        raise FoundryUnsupportedError(
            f"attention backend {unvalidated[0]}",
            "its capture-time metadata state is not rebuilt on LOAD (validated: "
            + ", ".join(sorted(VALIDATED_ATTENTION_BACKENDS))
            + ")",
        )


def _captures_inner_graphs(model_state: Any) -> bool:
    """Whether the V2 runner's model state captures graphs of its own inside the model's forward
    (vLLM 0.33's ``ModelState.capture_inner_cudagraphs``, overridden by a few model families)."""
    try:
        from vllm.v1.worker.gpu.model_states.interface import ModelState
    except ImportError:  # releases without the hook
        return False
    base = getattr(ModelState, "capture_inner_cudagraphs", None)
    own = getattr(type(model_state), "capture_inner_cudagraphs", None)
    return base is not None and own is not None and own is not base


class V2Adapter:
    """Model Runner V2: ``runner.cudagraph_manager`` (a ``CudaGraphManager``)."""

    kind = "v2"

    def __init__(self, runner: Any):
        self.runner = runner
        self.manager = runner.cudagraph_manager

    def _full_descs(self) -> list:
        from vllm.config.compilation import CUDAGraphMode

        return list(self.manager._capture_descs.get(CUDAGraphMode.FULL, []))

    def check(self) -> None:
        from vllm.config.compilation import CUDAGraphMode

        mode = getattr(self.manager.cudagraph_mode, "name", str(self.manager.cudagraph_mode))
        if mode != FOUNDRY_CUDAGRAPH_MODE:
            raise FoundryUnsupportedError(
                f"effective cudagraph_mode={mode}", "vLLM changed the requested FULL_DECODE_ONLY mode"
            )
        other = [m.name for m in self.manager._capture_descs if m != CUDAGraphMode.FULL]
        if other:
            raise FoundryUnsupportedError(f"{other[0]} graphs", "only FULL decode graphs are persisted")
        if not self._full_descs():
            raise FoundryUnsupportedError(
                "no decode graphs", "cudagraph_capture_sizes left nothing to capture"
            )
        if getattr(self.manager, "ubatch_runner", None) is not None:
            raise FoundryUnsupportedError("micro-batched graphs", "they are not persisted")
        model_state = getattr(self.runner, "model_state", None)
        if getattr(model_state, "supports_mm_inputs", False):
            raise FoundryUnsupportedError("multimodal inputs", "encoder graphs are not persisted")
        if _captures_inner_graphs(model_state):
            raise FoundryUnsupportedError(
                f"inner CUDA graphs of {type(model_state).__name__}",
                "they are captured apart and not persisted",
            )
        if getattr(self.runner, "adaptive_verification", None) is not None:
            raise FoundryUnsupportedError("adaptive verification", "its profiling runs after the capture")
        _check_common(self.runner)

    def collect(self) -> tuple[dict, dict, list[dict]]:
        graphs, listing = {}, []
        for desc, graph in self.manager.graphs.items():
            key = descriptor_key(desc)
            name = graph_name(key)
            graphs[name] = graph
            listing.append({"name": name, "key": key})
        if getattr(self.manager, "aux_hidden_states", None) or getattr(
            self.manager, "intermediate_tensors", None
        ):
            raise FoundryUnsupportedError("auxiliary/intermediate graph outputs", "they are not persisted")
        if self.manager.hidden_states is None:
            raise FoundryRestoreError("vLLM captured no decode graph output buffer")
        return graphs, {"hidden_states": self.manager.hidden_states}, listing

    def install(self, restored: Any, listing: list[dict]) -> int:
        expected = {graph_name(descriptor_key(d)): d for d in self._full_descs()}
        missing = sorted(set(expected) - set(restored.graphs))
        extra = sorted(set(restored.graphs) - set(expected))
        if missing or extra:
            raise FoundryRestoreError(
                f"archive graphs differ from this engine's decode graphs (missing {missing[:1]}, extra {extra[:1]})"
            )
        if "hidden_states" not in restored.tensors:
            raise FoundryRestoreError("archive lacks the decode output buffer 'hidden_states'")
        for name, desc in expected.items():
            self.manager.graphs[desc] = restored.graphs[name]
        self.manager.hidden_states = restored.tensors["hidden_states"]
        self.manager.use_aux_hidden_state_outputs = False
        self.manager._graphs_captured = True
        return len(expected)


class V1Adapter:
    """Model Runner V1: ``runner.model`` is a FULL-mode ``CUDAGraphWrapper``."""

    kind = "v1"

    def __init__(self, runner: Any):
        self.runner = runner
        self.wrapper = runner.model

    def _capture_keys(self) -> list[dict]:
        from vllm.config.compilation import CUDAGraphMode

        keys = []
        for mode, descs in self.runner.cudagraph_dispatcher.get_capture_descs():
            if mode != CUDAGraphMode.FULL:
                raise FoundryUnsupportedError(f"{mode.name} graphs", "only FULL decode graphs are persisted")
            keys.extend(descriptor_key(d) for d in descs)
        return keys

    def check(self) -> None:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.config.compilation import CUDAGraphMode

        mode = self.runner.compilation_config.cudagraph_mode
        name = getattr(mode, "name", str(mode))
        if name != FOUNDRY_CUDAGRAPH_MODE:
            raise FoundryUnsupportedError(
                f"effective cudagraph_mode={name}", "vLLM changed the requested FULL_DECODE_ONLY mode"
            )
        if not isinstance(self.wrapper, CUDAGraphWrapper) or self.wrapper.runtime_mode != CUDAGraphMode.FULL:
            raise FoundryUnsupportedError("this model runner", "the model is not wrapped for FULL graphs")
        for inst in list(getattr(CUDAGraphWrapper, "_all_instances", [])):
            if inst is not self.wrapper and inst.runtime_mode != CUDAGraphMode.FULL:
                raise FoundryUnsupportedError("piecewise graph wrappers", "they are not persisted")
        if not self._capture_keys():
            raise FoundryUnsupportedError(
                "no decode graphs", "cudagraph_capture_sizes left nothing to capture"
            )
        if getattr(self.runner, "encoder_cudagraph_manager", None) is not None:
            raise FoundryUnsupportedError("encoder CUDA graphs", "they are not persisted")
        _check_common(self.runner)

    def collect(self) -> tuple[dict, dict, list[dict]]:
        import torch

        graphs, tensors, listing = {}, {}, []
        for desc, entry in self.wrapper.concrete_cudagraph_entries.items():
            if entry.cudagraph is None:
                continue
            key = descriptor_key(desc)
            name = graph_name(key)
            if not isinstance(entry.output, torch.Tensor):
                raise FoundryUnsupportedError(
                    "non-tensor graph outputs", "only a hidden-state tensor is persisted"
                )
            graphs[name] = entry.cudagraph
            tensors[name + "/output"] = entry.output
            listing.append({"name": name, "key": key})
        return graphs, tensors, listing

    def install(self, restored: Any, listing: list[dict]) -> int:
        from vllm.compilation.cuda_graph import CUDAGraphEntry
        from vllm.forward_context import BatchDescriptor

        expected = {graph_name(k): k for k in self._capture_keys()}
        if set(expected) != set(restored.graphs):
            raise FoundryRestoreError("archive graphs differ from this engine's decode graphs")
        for name, key in expected.items():
            desc = BatchDescriptor(**key)
            out = restored.tensors.get(name + "/output")
            if out is None:
                raise FoundryRestoreError(f"archive lacks the output buffer of graph {name}")
            self.wrapper.concrete_cudagraph_entries[desc] = CUDAGraphEntry(
                batch_descriptor=desc, cudagraph=restored.graphs[name], output=out
            )
        # As after a real capture: a batch without a restored graph must fail, never capture anew.
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled

        set_cudagraph_capturing_enabled(False)
        return len(expected)


def adapter_for(runner: Any):
    """The adapter for the model runner that vLLM actually built (after the KV cache exists)."""
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None and hasattr(manager, "graphs") and hasattr(manager, "_capture_descs"):
        return V2Adapter(runner)
    if hasattr(runner, "cudagraph_dispatcher") and hasattr(
        getattr(runner, "model", None), "concrete_cudagraph_entries"
    ):
        return V1Adapter(runner)
    raise FoundryUnsupportedError(f"model runner {type(runner).__name__}", "no known CUDA graph layout")
