"""Workloads that SAVE and LOAD build identically in two processes: the demo's and the GPU tests'.

A workload owns a model, its static inputs and outputs, and one decode step per batch size. Its
``build`` must allocate the same buffers in the same order every time (that is what lets Foundry
prove placement); ``step`` is what gets captured; ``set_inputs`` writes deterministic inputs.
Every step ends in sampling with Philox random numbers, so RNG restore is exercised too.
"""

from __future__ import annotations

import dataclasses

import torch

from .options import VARIANTS


@dataclasses.dataclass
class Spec:
    variant: str = "qwen3"
    preset: str = "small"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_seq_len: int = 512
    seed: int = 1234
    device: int = 0

    def fingerprint(self) -> dict:
        return {
            "workload": self.variant,
            "preset": self.preset,
            "batch_sizes": list(self.batch_sizes),
            "max_seq_len": self.max_seq_len,
            "dtype": "bfloat16",
        }


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling: argmax(p / E) with E ~ Exp(1) drawn from the Philox generator."""
    probs = torch.softmax(logits.float(), dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)


class Workload:
    def __init__(self, spec: Spec):
        if spec.variant not in VARIANTS:
            raise ValueError(f"unknown workload {spec.variant!r} (known: {', '.join(VARIANTS)})")
        self.spec = spec
        self.device = torch.device("cuda", spec.device)
        self.forward_calls = 0  # counts eager and captured steps: a LOAD must make none

    # ---- built identically at SAVE and LOAD -------------------------------------------------------
    def build(self, region) -> None:
        spec = self.spec
        max_bs = max(spec.batch_sizes)
        with region.label("weights"):
            if spec.variant == "hf-qwen3":
                self._build_hf(max_bs)
            else:
                from .models import Qwen3Config, build_model

                cfg = Qwen3Config.preset(spec.preset, max_seq_len=spec.max_seq_len)
                self.model = build_model(cfg, seed=spec.seed, device=self.device)
                self.vocab = cfg.vocab_size
        with region.label("kv_cache"):
            if spec.variant != "hf-qwen3":
                self.model.allocate_kv_cache(max_bs, spec.max_seq_len)
        with region.label("static"):
            self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self._decode = self.model.decode if spec.variant != "hf-qwen3" else None
        self.reset_state()

    @torch.no_grad()
    def reset_state(self) -> None:
        """Put every piece of state the steps mutate back to its built value (no allocation).

        Warmups and replays write KV entries and, in HF's static cache, advance a device-side
        write counter; comparing two processes means starting both from the same state.
        """
        gen = torch.Generator(device=self.device).manual_seed(self.spec.seed + 1)
        if self.spec.variant != "hf-qwen3":
            self.model.kv_cache.normal_(0.0, 1.0, generator=gen)
            return
        for bs in self.spec.batch_sizes:
            for layer in self.caches[bs].layers:
                layer.keys.normal_(0.0, 1.0, generator=gen)
                layer.values.normal_(0.0, 1.0, generator=gen)
                counter = getattr(layer, "cumulative_length", None)
                if isinstance(counter, torch.Tensor):
                    counter.zero_()

    def _build_hf(self, max_bs: int) -> None:
        from transformers import Qwen3Config as HFConfig
        from transformers import Qwen3ForCausalLM, StaticCache

        from .models import Qwen3Config

        spec = self.spec
        cfg = Qwen3Config.preset(spec.preset, max_seq_len=spec.max_seq_len)
        hf_cfg = HFConfig(**cfg.to_hf_dict())
        hf_cfg._attn_implementation = "sdpa"
        torch.manual_seed(spec.seed)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
        self.vocab = cfg.vocab_size
        # One static cache per batch size (HF's cache has a fixed batch dimension), initialised
        # eagerly so the cache tensors are part of the build, not of the first forward.
        self.caches = {}
        for bs in spec.batch_sizes:
            cache = StaticCache(config=hf_cfg, max_cache_len=spec.max_seq_len)
            cache.early_initialization(bs, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, self.device)
            self.caches[bs] = cache
        self.cache_position = {
            bs: torch.zeros(1, dtype=torch.long, device=self.device) for bs in spec.batch_sizes
        }

    # ---- SAVE only ---------------------------------------------------------------------------------
    def compile(self) -> None:
        if self.spec.variant == "qwen3-compiled":
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(64, 2 * len(self.spec.batch_sizes))
            self._decode = torch.compile(self.model.decode, dynamic=False)

    @torch.no_grad()
    def step(self, bs: int) -> dict[str, torch.Tensor]:
        self.forward_calls += 1
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        if self.spec.variant == "hf-qwen3":
            out = self.model(
                input_ids=ids.view(bs, 1),
                position_ids=pos.view(bs, 1),
                cache_position=self.cache_position[bs],
                past_key_values=self.caches[bs],
                use_cache=True,
            )
            logits = out.logits[:, -1].float()
        else:
            logits = self._decode(ids, pos)
        return {"logits": logits, "tokens": _sample(logits)}

    def set_inputs(self, bs: int, round_: int = 0) -> None:
        """Deterministic inputs for one replay (written with device ops, same in every process)."""
        n = self.spec.max_seq_len
        ids = (torch.arange(bs, device=self.device) * 7919 + 31 * round_ + bs) % self.vocab
        pos = (torch.arange(bs, device=self.device) * 13 + 5 * round_ + 17) % (n - 1)
        self.input_ids[:bs].copy_(ids)
        self.positions[:bs].copy_(pos)
        if self.spec.variant == "hf-qwen3":
            self.cache_position[bs].fill_(int(17 + 5 * round_) % (n - 1))
