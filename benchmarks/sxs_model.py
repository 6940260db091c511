"""The models the side-by-side runs serve, written locally (nothing is downloaded): a config, a small
word-level tokenizer, and for seeded shapes a checkpoint from ``foundry_tools.weights`` whose greedy
outputs differ by prompt (so "identical outputs" means something)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "configs"

#: shape -> (config file, weights: "seeded" or "dummy", Foundry region size). The region holds all
#: the engine allocates on the GPU (weights, KV cache, graphs), and the engines' default memory
#: fractions take most of an H200's 141 GiB: the region is larger than the GPU (only address space).
SHAPES: dict[str, tuple[Path, str, str]] = {
    "qwen3-1.7b": (CONFIGS / "qwen3-1.7b.json", "seeded", "160GiB"),
    "qwen3-30b-a3b-fp8": (CONFIGS / "qwen3-30b-a3b-fp8.json", "dummy", "160GiB"),
    # Its outputs: the same layers and block FP8, four of them, seeded (dummy weights answer every
    # prompt alike, which shows nothing)
    "qwen3-30b-a3b-fp8-4l": (CONFIGS / "qwen3-30b-a3b-fp8-4l.json", "seeded", "160GiB"),
}
SEED = 0
WORDS = 4096
SPECIALS = ("<unk>", "<|endoftext|>", "<|im_end|>")


def tokenizer_vocab() -> dict[str, int]:
    return {w: i for i, w in enumerate([*SPECIALS, *(f"w{i}" for i in range(WORDS))])}


def tokenizer_files() -> dict[str, Any]:
    """A word-level tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``, written by hand
    (no ``tokenizers`` needed in the interpreter that writes it)."""
    vocab = tokenizer_vocab()
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in enumerate(SPECIALS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    # An explicit class keeps AutoTokenizer from picking Qwen2's tokenizer by model_type.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 40960,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def write(shape: str, model_dir: Path) -> dict[str, Any]:
    """The model folder of ``shape`` (kept between calls: written once per machine)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    config_path, weights, _ = SHAPES[shape]
    done = model_dir / ".sxs-model.json"
    if done.is_file():
        return json.loads(done.read_text())
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(config_path.read_text())
    for name, data in tokenizer_files().items():
        (model_dir / name).write_text(json.dumps(data, indent=1))
    info: dict[str, Any] = {"shape": shape, "config": str(config_path.relative_to(REPO)), "weights": weights}
    if weights == "seeded":
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "foundry_tools.weights", "--config", str(model_dir / "config.json")]
        cmd += ["--out", str(model_dir), "--seed", str(SEED)]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO / "src")])),
        )
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"foundry_tools.weights failed: {run.stderr.strip()[-1000:]}")
        info.update(seed=SEED, weights_s=round(time.monotonic() - t0, 1))
    done.write_text(json.dumps(info))
    return info
