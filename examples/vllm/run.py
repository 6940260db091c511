"""vLLM with Foundry on a tiny local Qwen3 (dummy weights, no tokenizer, token-id prompts).

    python examples/vllm/run.py --foundry-config examples/vllm/foundry.toml   # 1st run SAVE, later runs LOAD
    python examples/vllm/run.py                                                 # plain vLLM, same graph mode

Prints one JSON line: engine start-up seconds and the greedy output token ids, so that a plain run, the
SAVE run and a LOAD run can be compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [15, 16]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--foundry-config", help="Foundry TOML; omit for a plain vLLM run")
    parser.add_argument("--model", default=str(HERE.parent / "qwen3-tiny"), help="directory with config.json")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    engine_kwargs = dict(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        max_num_seqs=8,
        seed=0,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    if args.foundry_config:
        engine_kwargs["additional_config"] = {"foundry": {"config": args.foundry_config}}

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    ready_s = time.perf_counter() - t0

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, detokenize=False)
    single = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)  # decode batch 1
    batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params)  # decode batch 3 (graph 4)
    result = {
        "foundry": bool(args.foundry_config),
        "ready_s": round(ready_s, 2),
        "tokens": [list(o.outputs[0].token_ids) for o in [*single, *batch]],
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
