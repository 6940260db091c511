"""Helpers shared by the vLLM plugin tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

from pathlib import Path

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "attention_bias": False,
}


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def install_cpu_stand_in_platform() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class H200StandIn(Platform):
        """Answers the questions vLLM's config code asks of a CUDA platform, without a driver."""

        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"
        ray_device_key = "GPU"
        dist_backend = "nccl"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (stand-in)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def support_static_graph_mode(cls) -> bool:
            return True

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            if vllm_config.parallel_config.worker_cls == "auto":
                vllm_config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"

    platforms.current_platform = H200StandIn()
    # Saving the model-inspection cache imports CUDA-only attention modules under a CUDA platform.
    from vllm.model_executor.models import registry

    registry._LazyRegisteredModel._save_modelinfo_to_cache = lambda *args, **kwargs: None


def write_toml(path: Path, mode: str = "auto", archive_dir: str = "archive", extra: str = "") -> Path:
    path.write_text(f'mode = "{mode}"\narchive_dir = "{archive_dir}"\n{extra}')
    return path
