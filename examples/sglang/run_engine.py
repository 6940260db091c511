"""Foundry + sglang.Engine on a small local Qwen3 configuration (dummy weights, token-id prompts).

    python examples/sglang/run_engine.py                 # first run: SAVE (capture + persist)
    python examples/sglang/run_engine.py                 # later runs: LOAD (restore, no capture)
    python examples/sglang/run_engine.py --no-foundry    # baseline without Foundry
    python examples/sglang/run_engine.py --write-model-only   # just write the model config (for sglang serve)

Each run prints one JSON line: mode, engine start-up seconds and the greedy output token ids, so
SAVE, LOAD and the baseline can be compared token for token. Needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The 4-layer Qwen3 both engine examples use (dummy weights: nothing is downloaded).
MODEL_CONFIG = HERE.parent / "qwen3-tiny" / "config.json"

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15]]


def model_dir() -> str:
    d = Path(tempfile.gettempdir()) / "foundry-sglang-qwen3-4l"
    d.mkdir(exist_ok=True)
    shutil.copyfile(MODEL_CONFIG, d / "config.json")
    return str(d)


def build_server_args(attention_backend: str = "fa3", foundry_config: str | None = None):
    """The engine configuration of this example; Foundry on when ``foundry_config`` is given."""
    from sglang.srt.server_args import ServerArgs

    import foundry_sglang_plugin

    server_args = ServerArgs(
        model_path=model_dir(),
        load_format="dummy",
        skip_tokenizer_init=True,
        sampling_backend="pytorch",
        attention_backend=attention_backend,
        # Foundry persists full decode graphs only: prefill graphs must be off.
        cuda_graph_backend_prefill="disabled",
        cuda_graph_max_bs_decode=8,
        mem_fraction_static=0.3,
        random_seed=0,
        log_level="warning",
    )
    if foundry_config is not None:
        foundry_sglang_plugin.enable(server_args, foundry_config)
    return server_args


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(HERE / "foundry.toml"), help="Foundry TOML file")
    parser.add_argument("--no-foundry", action="store_true", help="run the same engine without Foundry")
    parser.add_argument("--attention-backend", default="fa3")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--write-model-only", action="store_true", help="write the config, print its directory"
    )
    opts = parser.parse_args()
    if opts.write_model_only:
        print(model_dir())
        return

    import sglang

    server_args = build_server_args(opts.attention_backend, None if opts.no_foundry else opts.config)
    t0 = time.perf_counter()
    engine = sglang.Engine(server_args=server_args)
    ready = time.perf_counter() - t0
    try:
        out = engine.generate(
            input_ids=PROMPTS, sampling_params={"max_new_tokens": opts.max_new_tokens, "temperature": 0}
        )
    finally:
        engine.shutdown()
    mode = (
        "off"
        if opts.no_foundry
        else getattr(server_args, "foundry_mode", None) or os.environ.get("FOUNDRY_MODE")
    )
    print(
        json.dumps(
            {"foundry": mode, "engine_ready_s": round(ready, 2), "output_ids": [o["output_ids"] for o in out]}
        )
    )


if __name__ == "__main__":  # SGLang spawns its schedulers: the guard is required
    main()
