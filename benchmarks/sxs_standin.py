"""A stand-in engine for testing benchmarks/sxs.py on a machine without a GPU: a tiny OpenAI-style
HTTP server that logs the lines the real engines log at start, streams tokens, and answers greedy
requests with logprobs; plus a stand-in of each engine's benchmark client.

tests/test_sxs_harness.py puts packages named ``sglang`` and ``vllm`` on the path whose entry modules
(``sglang.launch_server``, ``sglang.benchmark.serving``, ``vllm.entrypoints.cli.main``) call :func:`main`,
so the harness runs the very command lines it runs on the GPU machine. ``STANDIN_REFUSE`` (a line)
makes a start with upstream Foundry's variable set exit with that line, as a refusal would;
``STANDIN_START_S`` (seconds) makes every start take that much longer."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STEP_S = 0.05  # each logged phase of a start takes this long


def _tokens(prompt: list[int], n: int) -> list[int]:
    """Greedy continuation: a function of the whole prompt, as seeded weights give."""
    h = sum((i + 1) * t for i, t in enumerate(prompt)) % 997
    return [(h * 31 + 7 * k) % 4000 + 3 for k in range(n)]


class Handler(BaseHTTPRequestHandler):
    model = "model"

    def log_message(self, *args) -> None:  # quiet: the engine log is stdout
        pass

    def _json(self, code: int, data) -> None:
        raw = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": self.model}]})
        else:
            self._json(404, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        n = int(body.get("max_tokens", 16))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for tok in _tokens(prompts[0], n):
                chunk = {"choices": [{"index": 0, "text": f" w{tok}", "token_ids": [tok]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return
        choices = []
        for i, p in enumerate(prompts):
            toks = _tokens(p, n)
            top = [
                {f"token_id:{t + j}": -0.1 * (j + 1) for j in range(int(body.get("logprobs") or 0))}
                for t in toks
            ]
            choices.append({"index": i, "text": "", "token_ids": toks, "logprobs": {"top_logprobs": top}})
        self._json(200, {"choices": choices})


def _arg(argv: list[str], flag: str, default: str | None = None) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else default


def serve(engine: str, argv: list[str]) -> int:
    say = lambda line: print(line, flush=True)  # noqa: E731
    time.sleep(float(os.environ.get("STANDIN_START_S") or 0))
    foundry = "--enable-foundry" in argv
    toml = Path(
        _arg(argv, "--foundry-config", "")
        or os.environ.get("FOUNDRY_GRAPH_EXTENSION_CONFIG", "")
        or "/nonexistent"
    )
    if os.environ.get("FOUNDRY_GRAPH_EXTENSION_CONFIG") and os.environ.get("STANDIN_REFUSE"):
        say(f"[Foundry] {os.environ['STANDIN_REFUSE']}")
        return 1
    text = toml.read_text() if toml.is_file() else ""
    loading = 'mode = "load"' in text
    if os.environ.get("FOUNDRY_GRAPH_EXTENSION_CONFIG"):
        say(f"[Foundry] SGLang hooks installing: mode={'load' if loading else 'save'}")
    archive = re.search(r'(?:archive_dir|workspace_root) = "([^"]+)"', text)
    if 'mode = "save"' in text and archive:  # a SAVE leaves its archive, as the real ones do
        Path(archive.group(1), "rank0").mkdir(parents=True, exist_ok=True)
    if engine == "sglang":
        say(f"server_args={{'model_path': {_arg(argv, '--model-path')!r}}}")
        lines = ["Load weight begin. avail mem=139 GB", "Load weight end. elapsed=0.05 s"]
        graphs = [
            "Capture target decode CUDA graph begin. bs=[1, 2]",
            "Capture target decode CUDA graph end. elapsed=0.05 s",
        ]
        ready = "The server is fired up and ready to roll!"
    else:
        say(f"non-default args: {{'model': {argv[argv.index('serve') + 1]!r}}}")
        lines = [
            "Starting to load model",
            "Model loading took 3.4 GiB memory and 0.05 seconds",
            "torch.compile takes 0.05 s in total",
        ]
        graphs = (
            ["Foundry rank 0: restored 51 decode graphs in 0.05 s (no warmup, no capture)"]
            if loading
            else ["Capturing CUDA graphs (decode, FULL): 51/51", "Graph capturing finished in 0.05 secs"]
        )
        ready = "Application startup complete."
    if foundry or loading:
        say("Foundry: engine settings for a shorter start: none")
    for line in [*lines, *graphs]:
        time.sleep(STEP_S)
        say(line)
    Handler.model = _arg(argv, "--model-path") or argv[argv.index("serve") + 1]
    server = ThreadingHTTPServer(("127.0.0.1", int(_arg(argv, "--port", "8000"))), Handler)
    say(ready)
    server.serve_forever()
    return 0


def bench_client(engine: str, argv: list[str]) -> int:
    """Writes the result keys the real client writes (SGLang: a JSON line; vLLM: a JSON file)."""
    rate = _arg(argv, "--request-rate", "inf")
    result = {
        "completed": int(_arg(argv, "--num-prompts", "1")),
        "request_throughput": 10.0,
        "output_throughput": 1000.0 if rate == "inf" else 400.0,
        "median_ttft_ms": 20.0,
        "p99_ttft_ms": 40.0,
    }
    if engine == "sglang":
        result.update(median_tpot_ms=5.0, p99_tpot_ms=8.0)
        with open(_arg(argv, "--output-file"), "a") as f:
            f.write(json.dumps(result) + "\n")
    else:
        result.update(median_tpot_ms=5.0, p99_tpot_ms=8.0)
        Path(_arg(argv, "--result-dir"), _arg(argv, "--result-filename")).write_text(json.dumps(result))
    return 0


def main(entry: str) -> int:
    argv = sys.argv[1:]
    if entry == "sglang.benchmark.serving":
        return bench_client("sglang", argv)
    if entry == "vllm.entrypoints.cli.main" and argv[:2] == ["bench", "serve"]:
        return bench_client("vllm", argv)
    return serve("sglang" if entry.startswith("sglang") else "vllm", argv)
