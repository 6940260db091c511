"""Compressed members: chunked zlib compression on SAVE, bounded and verified inflation on LOAD.

A member may be stored as zlib streams over independent fixed-size chunks of its content (format
version 2, manifest ``encoding`` of kind :data:`ENCODING_KIND`), so that SAVE compresses and LOAD
inflates them on many threads at once. Separate from the writer and the reader because this is the
CPU-heavy part of both, run on threads, and the only part that reaches the native library (the
in-place inflate of native/inflate.c, with Python's zlib as the fallback).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

from foundry_core import _native

from .errors import ArchiveError, _one_line
from .format import ENCODING_KIND

# zlib releases the GIL; inflate runs at ~200-400 MB/s per core. Code images, the bulk of an
# archive, shrank 8.9x in the bench.
COMPRESS_CHUNK = 1 << 20
COMPRESS_LEVEL = 6
_COMPRESS_MIN = 4096  # smaller members are stored as they are
_ZLIB_THREADS = max(1, min(16, os.cpu_count() or 1))
#: Threads for inflating in the background (:meth:`Archive.inflate_ahead`): half the cores, so that
#: the work it overlaps keeps a core of its own. A thread that hands the GIL back for every system
#: call waits for a free core each time it takes it again; with every core inflating, a 13 MB
#: caches hand-over took 0.60 s beside the inflate on a 16-core H100 host, against 0.09 s after it
#: (and 2.2x on 2 cores, 1.4x with one core left free: benchmarks/caches_unpack.py).
BACKGROUND_THREADS = max(1, min(_ZLIB_THREADS, (os.cpu_count() or 1) // 2))


def _compress_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads a SAVE compresses members on (zlib releases the GIL)."""
    return concurrent.futures.ThreadPoolExecutor(_ZLIB_THREADS, thread_name_prefix="foundry-zlib")


def _start_compressing(
    pool: concurrent.futures.ThreadPoolExecutor, view: memoryview
) -> list[concurrent.futures.Future]:
    """One compression job per :data:`COMPRESS_CHUNK` bytes of ``view``, in order."""
    return [
        pool.submit(zlib.compress, view[i : i + COMPRESS_CHUNK], COMPRESS_LEVEL)
        for i in range(0, len(view), COMPRESS_CHUNK)
    ]


def _chunk_encoding(raw_size: int, chunks: list[bytes]) -> dict | None:
    """The manifest ``encoding`` of a member of ``raw_size`` bytes compressed into ``chunks``, or
    None when that saves less than an eighth (the member is then stored as it is)."""
    stored = sum(len(c) for c in chunks)
    if stored > raw_size - raw_size // 8:
        return None
    return {
        "kind": ENCODING_KIND,
        "raw_size": raw_size,
        "chunk_size": COMPRESS_CHUNK,
        "chunks": [len(c) for c in chunks],
    }


def _inflate(data: bytes, start: int, end: int, expected: int) -> bytes | None:
    """One chunk of a compressed member: exactly ``expected`` bytes from one complete zlib stream,
    or None when the chunk is damaged (never more than ``expected`` + 1 bytes are produced)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(memoryview(data)[start:end], expected + 1)
    except zlib.error:
        return None
    if len(out) != expected or not d.eof or d.unused_data or d.unconsumed_tail:
        return None
    return out


# Below this much work per thread, starting a thread and handing the GIL back and forth costs more
# than the thread saves (2 MiB: ~1.5 ms of sha256, ~5 ms of inflating).
_MIN_BYTES_PER_THREAD = 2 << 20


def _map_on_threads(
    fn: Callable[[Any], Any],
    items: list,
    threads: int,
    name: str,
    sizes: list[int] | None = None,
) -> list:
    """``[fn(x) for x in items]``, on up to ``threads`` threads (for work that releases the GIL);
    with ``sizes`` (bytes of work per item), no more threads than :data:`_MIN_BYTES_PER_THREAD`
    each, and none at all below that.

    Each thread takes the next item from a shared queue and stores its result in place: no future,
    lock or condition per item, so an item costs one GIL hand-back (where ``fn`` releases it) and
    not the four of an executor's submit/run/set_result/result. That matters most when another
    thread of the process is busy at the same time: every GIL acquisition then waits its turn. The
    calling thread works too instead of waiting."""
    workers = min(threads, len(items))
    if sizes is not None:
        workers = min(workers, sum(sizes) // _MIN_BYTES_PER_THREAD)
    if workers <= 1:
        return [fn(x) for x in items]
    todo = collections.deque(enumerate(items))
    results: list = [None] * len(items)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            while True:
                try:
                    i, item = todo.popleft()  # atomic: a deque is safe to share between threads
                except IndexError:
                    return
                results[i] = fn(item)
        except BaseException as e:  # re-raised in the caller; the other threads stop early
            failed.append(e)
            todo.clear()

    helpers = [threading.Thread(target=work, name=f"{name}-{i}", daemon=True) for i in range(workers - 1)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]
    return results


# deflate cannot expand data more than about 1032:1; a chunk claiming more is damaged, and is
# refused before its claimed size is allocated.
_MAX_INFLATE_RATIO = 1100


@functools.cache
def _bytes_maker():
    make = ctypes.pythonapi.PyBytes_FromStringAndSize
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    return make


def _fresh_bytes(size: int) -> bytes:
    """A new, not yet shared bytes object of ``size`` bytes for native code to fill in place (the
    C-API idiom PyBytes_FromStringAndSize(NULL, n)): no zeroing, no copy after inflating."""
    return _bytes_maker()(None, size)


def _decode_members(
    contents: dict[str, bytes], files: dict[str, Any], where: str, threads: int | None = None
) -> None:
    """Replace each compressed member's stored bytes by its content, inflating all chunks of all
    members on up to ``threads`` threads (:data:`_ZLIB_THREADS` with None); the first damaged member
    in sorted order is the one reported.

    With the native library each chunk is inflated straight into its place in the member's final
    buffer (native/inflate.c, GIL released); without it, Python's zlib inflates each chunk into its
    own object and the chunks are joined."""
    native = _native.inflate_fn()
    members = sorted(rel for rel in files if files[rel].get("encoding") is not None)
    jobs: list[tuple[str, int, int, int, int]] = []
    targets: dict[str, bytes] = {}
    damaged: set[str] = set()  # known damaged without inflating anything
    for rel in members:
        enc = files[rel]["encoding"]
        chunk_jobs, pos, too_large = [], 0, False
        for i, length in enumerate(enc["chunks"]):
            expected = min(enc["chunk_size"], enc["raw_size"] - i * enc["chunk_size"])
            too_large |= expected > _MAX_INFLATE_RATIO * length + 1024
            chunk_jobs.append((rel, pos, pos + length, i * enc["chunk_size"], expected))
            pos += length
        if too_large:
            damaged.add(rel)
            continue
        if native is not None:
            try:
                targets[rel] = _fresh_bytes(enc["raw_size"])
            except MemoryError:
                raise ArchiveError(
                    f"{where}: file {_one_line(repr(rel), 120)} inflates to {enc['raw_size']} bytes, "
                    "more than this process can allocate"
                ) from None
        jobs += chunk_jobs
    if not members:
        return
    # Addresses looked up once per member, not per chunk: the threads' Python between two native
    # calls is all the GIL they hold.
    src_at = {rel: _native.bytes_address(contents[rel]) for rel in targets} if native is not None else {}
    dst_at = {rel: _native.bytes_address(out) for rel, out in targets.items()}

    def run(job: tuple[str, int, int, int, int]) -> bytes | bool | None:
        rel, start, end, out_at, expected = job
        if native is None:
            return _inflate(contents[rel], start, end, expected)
        return native(src_at[rel] + start, end - start, dst_at[rel] + out_at, expected) == 0

    parts = _map_on_threads(run, jobs, threads or _ZLIB_THREADS, "foundry-inflate", [job[4] for job in jobs])
    by_member: dict[str, list] = {rel: [] for rel in members}
    for (rel, _, _, _, _), part in zip(jobs, parts):
        by_member[rel].append(part)
    for rel, chunks in by_member.items():  # sorted
        if rel in damaged or any(part is None or part is False for part in chunks):
            raise ArchiveError(
                f"{where}: file {_one_line(repr(rel), 120)} does not decompress; it is damaged, SAVE again"
            )
        if native is not None:
            contents[rel] = targets[rel]
        else:
            contents[rel] = chunks[0] if len(chunks) == 1 else b"".join(chunks)
