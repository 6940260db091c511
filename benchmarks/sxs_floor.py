"""The floor under any start, measured in the same run as the starts it bounds: importing the engine's
server entry module in a fresh interpreter (page cache dropped, then again cached), reading the
weight files, creating a CUDA context."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENTRY_MODULE = {"sglang": "sglang.launch_server", "vllm": "vllm.entrypoints.openai.api_server"}

# Typed driver calls (cuda.bindings, which both engines' torch brings); the context is what the
# first CUDA call of an engine process pays for.
_CUDA_CONTEXT = """
import time
t0 = time.perf_counter()
from cuda.bindings import driver as cu
(err,) = cu.cuInit(0)
err2, dev = cu.cuDeviceGet(0)
err3, ctx = cu.cuDevicePrimaryCtxRetain(dev)
(err4,) = cu.cuCtxSetCurrent(ctx)
(err5,) = cu.cuCtxSynchronize()
assert not any(int(e) for e in (err, err2, err3, err4, err5)), (err, err2, err3, err4, err5)
print(time.perf_counter() - t0)
"""


def drop_page_cache() -> tuple[bool, str]:
    """Drop the page cache where /proc/sys/vm/drop_caches is writable; (done, how or why not)."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True, "echo 3 > /proc/sys/vm/drop_caches"
    except OSError as e:
        return False, f"not dropped: /proc/sys/vm/drop_caches not writable ({e.strerror})"


def _timed(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - t0, 3)}
    if done.returncode != 0:
        out["error"] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][-300:]
    else:
        try:
            out["inner_s"] = round(float(done.stdout.strip().splitlines()[-1]), 4)
        except (ValueError, IndexError):
            pass
    return out


def read_files(model_dir: Path) -> dict[str, Any]:
    """Read every weight file once (the page cache dropped first where allowed)."""
    files = sorted(p for p in model_dir.glob("*") if p.suffix in (".safetensors", ".bin", ".pt"))
    if not files:
        return {"files": 0, "note": "no weight files (dummy weights)"}
    dropped, how = drop_page_cache()
    t0, total = time.monotonic(), 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    s = time.monotonic() - t0
    return {
        "files": len(files),
        "bytes": total,
        "s": round(s, 3),
        "gb_per_s": round(total / s / 1e9, 2) if s else None,
        "page_cache_dropped": dropped,
        "page_cache": how,
    }


def measure(engine: str, model_dir: Path, env: dict[str, str], timeout: float = 120.0) -> dict[str, Any]:
    """The three floors; each one's failure is recorded, not raised."""
    out: dict[str, Any] = {}
    cmd = f"import time; t=time.perf_counter(); import {ENTRY_MODULE[engine]}; print(time.perf_counter()-t)"
    try:
        # Once as the starts meet it (page cache dropped where allowed, as each cold start drops
        # it), once more with the files cached: the import floor under both conditions.
        dropped, how = drop_page_cache()
        out["import_entry_module"] = dict(
            _timed([sys.executable, "-c", cmd], env, timeout),
            module=ENTRY_MODULE[engine],
            page_cache_dropped=dropped,
            page_cache=how,
        )
        out["import_entry_module_warm"] = _timed([sys.executable, "-c", cmd], env, timeout)
        out["read_weights"] = read_files(model_dir)
        out["cuda_context"] = _timed([sys.executable, "-c", _CUDA_CONTEXT], env, timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    return out
