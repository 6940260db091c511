"""A stand-in for an engine server with Foundry, for tests/test_faults_bench_runs.py: answers
/v1/completions like a server, prints the plugins' lines and writes real archives with
foundry_core.archive (so a SIGKILL, a full disk or a flipped byte does to it what it does to an
engine). Run as ``python standin_engine.py --port N [--enable-foundry --foundry-config TOML]``;
FAKE_* variables shape its behaviour (see the tests)."""

import json
import os
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import tomllib

from foundry_core.archive import ArchiveError, ArchiveWriter, open_archive

style = os.environ.get("FAKE_STYLE", "sglang")
knob = lambda name, default: float(os.environ.get("FAKE_" + name, default))  # noqa: E731
argv = sys.argv
port = int(argv[argv.index("--port") + 1])
if "--foundry-config" in argv:
    cfg = tomllib.loads(Path(argv[argv.index("--foundry-config") + 1]).read_text())
    mode, adir = cfg["mode"], Path(cfg["archive_dir"])
else:  # a stock server: no Foundry at all
    mode, adir = "stock", Path(tempfile.mkdtemp())
record = adir / ("rank0.sglang.json" if style == "sglang" else "rank0.vllm.json")
pid = os.getpid()
slots = {"memory_pool_config": {"tokens": 64}}
graphs = [{"name": "decode/size=1"}, {"name": "decode/size=2"}]


def log(msg):
    prefix = f"(EngineCore pid={pid}) INFO " if style == "vllm" else "[2026-12-01 10:00:00] "
    print(prefix + msg, flush=True)


def writable(d):
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError as e:
        return e.strerror


def complete():
    try:
        open_archive(adir / "rank0")
    except (ArchiveError, OSError):
        return False
    return record.exists()


problem = writable(adir) if mode == "save" or not complete() else True
if mode == "save" and problem is not True:
    print(f"error: Foundry: archive_dir {adir} is not writable ({problem}); mode = save cannot go on")
    sys.stdout.flush()
    if os.environ.get("FAKE_HANG_AFTER_REFUSAL"):  # a launcher that says why but does not end
        time.sleep(600)
    sys.exit(1)
decided = {"auto": "load" if complete() else "save"}.get(mode, mode)
if decided == "load" and not complete():
    print(f"error: mode=load but {adir} holds no complete archive")
    sys.exit(1)
foundry = mode != "stock"
if style == "sglang" and decided == "save" and problem is not True:
    log(
        f"Foundry: archive_dir {adir} is not writable ({problem}); auto mode serves without Foundry this time"
    )
    foundry = False
report = {"mode": decided, "pid": pid, "caches": {}}
if foundry:
    if style == "vllm":
        log(f"Foundry rank 0: {decided.upper()} (fake)")
    else:
        log(f"Foundry {decided.upper()}: rank 0, archive {adir}/rank0")
    if decided == "load":
        try:
            caches = open_archive(adir / "rank0.caches")
            report["caches"] = {"digest": caches.digest, "new_files": {"total": 0}}
        except ArchiveError as e:
            line = f"carried caches {adir}/rank0.caches refused ({e})"
            if mode == "load":
                print(f"error: Foundry: {line}; mode=load cannot go on", flush=True)
                sys.exit(1)
            log(f"Foundry rank 0: {line}; the engine compiles as usual")
            report["caches"] = {"refused": str(e), "new_files": {"total": 3}}
    else:
        record.unlink(missing_ok=True)
quiet = os.environ.get("FAKE_QUIET_CAPTURE")  # a capture that logs nothing
log("Capture target decode CUDA graph begin. bs=[1, 2]") if not quiet else None
for i in range(0 if quiet else 3):
    sys.stdout.write(f"\rCapturing batches (bs={2 - i}): {33 * i}%|")
    sys.stdout.flush()
    time.sleep(knob("CAPTURE_S", 0.1) / 3)
print()
log("Capture target decode CUDA graph end. elapsed=0.1 s") if not quiet else None
# FAKE_STAGGER: servers of archive directories whose path contains it wait for each other to
# have decided, then the second to get here writes 1.5 s after the first.
stagger = adir.parent / "stagger"
match = os.environ.get("FAKE_STAGGER")
if match and match in str(adir) and foundry and decided == "save":
    stagger.mkdir(exist_ok=True)
    Path(stagger, f"decided-{pid}").touch()
    t_wait = time.monotonic() + 10
    while len(list(Path(stagger).glob("decided-*"))) < 2 and time.monotonic() < t_wait:
        time.sleep(0.01)
    try:
        os.close(os.open(os.path.join(stagger, "first"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        time.sleep(1.5)
if foundry and decided == "save":
    try:
        with ArchiveWriter(adir / "rank0") as w:
            w.add_bytes("graphs/0000.bin", b"g" * int(knob("GRAPH_BYTES", 200000)))
            w.add_bytes("graphs/stamp", str(time.time_ns()).encode())
            time.sleep(knob("PERSIST_S", 0))
            w.commit(
                fingerprint={"fake": 1}, meta={"kind": "foundry-graphs", "graphs": graphs, "slots": slots}
            )
        if style == "vllm":
            log(
                f"Foundry rank 0: wrote 2 decode graphs to {adir}/rank0 in 0.1 s; published with the manifest"
            )
        time.sleep(knob("PUBLISH_GAP_S", 0))
        with ArchiveWriter(adir / "rank0.caches") as w:
            w.add_bytes("caches/triton/k.cubin", os.urandom(3000))
            digest = w.commit(fingerprint={}, meta={"kind": "foundry-caches", "kinds": {}})
        report["caches"] = {"digest": digest}
        log(f"Foundry rank 0: compile caches saved to {adir}/rank0.caches (triton 1 files) in 0.01 s")
        if style == "vllm":
            data = {"kind": "foundry-vllm", "schema": 1, "fingerprint": {}, "sizing": slots, "graphs": graphs}
        else:
            data = {"fingerprint": {}, "slots": slots, "outputs": {g["name"]: {} for g in graphs}}
        tmp = record.with_name(record.name + ".x.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, record)
        if style == "sglang":
            log(f"Foundry SAVE: 2 decode graphs persisted to {adir}/rank0")
        report["saved"] = True
    except (ArchiveError, OSError) as e:
        if mode == "save":
            print("Traceback (most recent call last):")
            print(f"foundry_core.archive.errors.ArchiveError: {e}", flush=True)
            sys.exit(1)
        log(f"Foundry rank 0: SAVE failed ({e}); serving with the graphs just captured, nothing saved")
        report["saved"] = False
if foundry:
    if style == "sglang":
        rdir = Path(os.environ["FOUNDRY_SGLANG_REPORT_DIR"])
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "rank0.json").write_text(json.dumps(report))
    else:
        try:
            (adir / "rank0.start.json").write_text(json.dumps(report))
        except OSError as e:
            log(f"Foundry rank 0: start report not written: {e}")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, data):
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send({"data": [{"id": "fake-model"}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        choices = []
        shift = 1 if mode == "stock" and os.environ.get("FAKE_STOCK_DIFFERS") else 0
        if mode == "stock":
            time.sleep(knob("STOCK_ANSWER_S", 0))  # a stock server slower than LOAD
        for i, prompt in enumerate(body["prompt"]):
            ids = [(sum(prompt) * 31 + len(prompt) + k + shift) % 4000 for k in range(body["max_tokens"])]
            lps = [-0.5 - (t % 7) / 8 for t in ids]
            tops = [{str(t): lp, "x": lp - 1} for t, lp in zip(ids, lps)]
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": lps, "top_logprobs": tops},
                }
            )
        self._send({"choices": choices})


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print("INFO:     Application startup complete.", flush=True)
server.serve_forever()
