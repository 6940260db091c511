"""A SAVE that runs slowly on purpose, so that a test can SIGKILL it at chosen moments.

Usage: python slow_save.py PATH TAG [--files N] [--size BYTES] [--delay S] [--lock-timeout S] [--slow-commit]

Prints one event per line on stdout, flushed, as ``<event> <time.monotonic()> [digest]``:
``entered`` (lock held, temp dir made), ``committing``, ``committed <digest>``, ``exited``.
Exits 3 with the one-line ArchiveError on stderr when the SAVE is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

from foundry_core.archive import ArchiveError, ArchiveWriter
from foundry_core.fingerprint import make_fingerprint

FINGERPRINT = make_fingerprint(
    gpu_name="Test GPU",
    compute_capability="9.0",
    sm_count=132,
    driver_version="13.0",
    cuda_version="13.0",
    torch_version="2.13.0",
    model={"name": "crash-test"},
)


def blob(tag: str, i: int, size: int) -> bytes:
    """Deterministic member content for (tag, index): a reader can check it without the writer."""
    seed = hashlib.sha256(f"{tag}:{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def member(i: int) -> str:
    return f"blobs/{i % 4}/{i:04d}.bin"


def _slow(fn, seconds: float):
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        result = fn(*args, **kwargs)
        time.sleep(seconds)
        return result

    return wrapper


def main() -> None:
    # A background job of a non-interactive shell starts with SIGINT ignored, and Python then keeps
    # it ignored; the interrupted-SAVE test needs the KeyboardInterrupt a terminal's Ctrl-C gives.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("tag")
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--delay", type=float, default=0.005)
    ap.add_argument("--lock-timeout", type=float, default=0.0)
    ap.add_argument("--slow-commit", action="store_true")
    args = ap.parse_args()

    def event(name: str, *extra: str) -> None:
        print(name, f"{time.monotonic():.6f}", *extra, flush=True)

    if args.slow_commit:
        # Stretch every filesystem step of the commit protocol so that kills land inside it too.
        os.fsync = _slow(os.fsync, 0.001)
        for name in ("rename", "replace", "symlink"):
            setattr(os, name, _slow(getattr(os, name), 0.02))
        for name in ("unlink", "rmdir"):
            setattr(os, name, _slow(getattr(os, name), 0.0005))
    try:
        with ArchiveWriter(args.path, lock_timeout=args.lock_timeout) as w:
            event("entered")
            for i in range(args.files):
                w.add_bytes(member(i), blob(args.tag, i, args.size))
                time.sleep(args.delay)
            w.add_json("layout.json", {"tag": args.tag, "files": args.files})
            event("committing")
            digest = w.commit(
                fingerprint=FINGERPRINT, meta={"tag": args.tag, "files": args.files, "size": args.size}
            )
            event("committed", digest)
        event("exited")
    except ArchiveError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
