"""Serving throughput and latency through the engine's own benchmark client (``vllm bench serve``,
``python -m sglang.bench_serving``): random dataset, fixed seed, one request rate at a time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: name -> (request rate, prompts): one rate that saturates the server, one that does not.
RATES = {"saturating": ("inf", 400), "steady": ("8", 160)}
INPUT_LEN, OUTPUT_LEN, SEED = 512, 128, 1
#: Result keys both clients write, under the names kept here.
KEYS = {
    "output_throughput": "output_tok_s",
    "request_throughput": "req_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_tpot_ms": "tpot_p50_ms",
    "p99_tpot_ms": "tpot_p99_ms",
    "completed": "completed",
}


def client_argv(engine: str, base: str, model_dir: Path, rate: str, prompts: int, out: Path) -> list[str]:
    common = ["--num-prompts", str(prompts), "--request-rate", rate, "--seed", str(SEED)]
    common += ["--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN)]
    # Every prompt and output at its full length: SGLang draws lengths from [ratio * len, len],
    # vLLM from [(1 - ratio) * len, (1 + ratio) * len].
    common += ["--random-range-ratio", "1.0" if engine == "sglang" else "0.0", "--tokenizer", str(model_dir)]
    if engine == "sglang":
        # random-ids: token ids drawn from the vocabulary, no dataset download
        argv = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang-oai"]
        argv += [
            "--base-url",
            base,
            "--dataset-name",
            "random-ids",
            "--output-file",
            str(out),
            "--disable-tqdm",
        ]
        return [*argv, "--model", str(model_dir), *common]
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm"]
    argv += ["--base-url", base, "--model", str(model_dir), "--dataset-name", "random", "--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99", "--save-result"]
    argv += ["--result-dir", str(out.parent), "--result-filename", out.name]
    return [*argv, *common]


def read_result(engine: str, path: Path) -> dict[str, Any]:
    """The client's result (SGLang appends one JSON line per run: the last one counts)."""
    text = path.read_text().strip()
    data = json.loads(text.splitlines()[-1] if engine == "sglang" else text)
    out = {ours: data.get(theirs) for theirs, ours in KEYS.items()}
    if out["ttft_p50_ms"] is None:  # vLLM names the 50th percentile by its percentile too
        out["ttft_p50_ms"], out["tpot_p50_ms"] = data.get("p50_ttft_ms"), data.get("p50_tpot_ms")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run(
    engine: str,
    base: str,
    model_dir: Path,
    env: dict[str, str],
    logs: Path,
    tag: str,
    timeout: float,
    rates: dict[str, tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """Each rate once against the running server at ``base``; a failure is recorded per rate."""
    results: dict[str, Any] = {}
    for name, (rate, prompts) in (rates or RATES).items():
        out = logs / f"{tag}-serving-{name}.json"
        out.unlink(missing_ok=True)
        argv = client_argv(engine, base, model_dir, rate, prompts, out)
        t0 = time.monotonic()
        rec: dict[str, Any] = {"rate": rate, "prompts": prompts}
        try:
            with open(logs / f"{tag}-serving-{name}.log", "w") as log:
                done = subprocess.run(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
                )
            rec.update(read_result(engine, out))
        except subprocess.TimeoutExpired:
            rec["error"] = f"the client did not finish in {timeout:.0f} s"
        except (OSError, ValueError, IndexError) as e:
            rec["error"] = f"client exit {done.returncode}, no result: {e}"[:300]
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        results[name] = rec
    return results
