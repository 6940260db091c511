"""ctypes view of the native library (native/*.c, built by ``pip install``).

The library is also handed to torch by path (CUDAPluggableAllocator), so its location is public
through :func:`library_path`.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from ctypes import (
    POINTER,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)

_HERE = os.path.dirname(os.path.abspath(__file__))


class NativeLibraryMissing(RuntimeError):
    """The compiled part of Foundry is not there (an install that skipped the build)."""


def built(stem: str) -> str:
    """The path of the native library ``stem`` built beside this file (``_foundry_native``, or
    ``_foundry_nvshmem_cuda``, the driver NVSHMEM is pointed at)."""
    found = glob.glob(os.path.join(_HERE, f"{stem}*.so"))
    if not found:
        raise NativeLibraryMissing(
            f"foundry_core/{stem}*.so is missing in {_HERE}: reinstall with `pip install -e .` "
            "(it builds the native library with the system C compiler)"
        )
    # Several builds may sit side by side (pip's tagged name, a plain gcc build): take the newest.
    return max(found, key=os.path.getmtime)


def library_path() -> str:
    override = os.environ.get("FOUNDRY_NATIVE_LIB")
    if override:
        return override
    return built("_foundry_native")


#: Every function of the library that Python calls, with its C signature (native/*.c); the
#: allocator entry points are handed to torch by name and not called from here.
SIGNATURES = {
    "foundry_region_reserve": (c_int, [c_int, c_uint64, c_uint64]),
    "foundry_region_map": (c_int, [c_int, c_uint64, c_uint64, c_int]),
    "foundry_region_unmap": (c_int, [c_int, c_uint64]),
    "foundry_region_advance": (c_int, [c_int, c_uint64]),
    "foundry_region_rewind": (c_int, [c_int, c_size_t, c_uint64]),
    "foundry_region_cursor": (c_uint64, [c_int]),
    "foundry_region_log_len": (c_size_t, [c_int]),
    "foundry_region_log_read": (
        c_size_t,
        [
            c_int,
            c_size_t,
            c_size_t,
            POINTER(c_uint64),
            POINTER(c_uint64),
            POINTER(c_int32),
            POINTER(c_int32),
            POINTER(c_int32),
        ],
    ),
    "foundry_region_set_label": (None, [c_int]),
    "foundry_region_error": (c_char_p, []),
    "foundry_symm_window": (c_int, [c_int, c_uint64, c_uint64, c_uint64]),
    "foundry_symm_hook_install": (c_int, [c_void_p]),
    "foundry_symm_hook_remove": (c_int, []),
    "foundry_symm_arm": (None, [c_int]),
    "foundry_symm_misplaced": (c_int, [c_int]),
    "foundry_symm_placed": (c_size_t, [c_int, c_size_t, POINTER(c_uint64), POINTER(c_uint64)]),
    "foundry_symm_error": (c_char_p, []),
    "foundry_modules_start": (c_int, [c_char_p]),
    "foundry_modules_count": (c_size_t, []),
    "foundry_modules_get": (c_int, [c_size_t, POINTER(c_void_p), POINTER(c_size_t), POINTER(c_uint64)]),
    "foundry_modules_dropped": (c_int, []),
    "foundry_modules_started": (c_int, []),
    "foundry_modules_stop": (c_int, []),
    "foundry_modules_keep_images": (None, [c_int]),
    "foundry_captures_driver": (c_uint64, []),
    "foundry_captures_runtime": (c_uint64, []),
    "foundry_modules_error": (c_char_p, []),
    "foundry_inflate": (c_int, [c_void_p, c_size_t, c_void_p, c_size_t]),
    "foundry_inflate_available": (c_int, []),
    "foundry_graph_validate": (
        c_int,
        [c_void_p, c_size_t, c_size_t, c_size_t, POINTER(c_uint64), c_char_p, c_size_t],
    ),
    "foundry_graph_build": (
        c_int,
        [
            c_void_p,
            c_size_t,
            c_void_p,
            c_size_t,
            c_void_p,
            c_size_t,
            c_void_p,
            c_int,
            POINTER(c_void_p),
            POINTER(c_void_p),
            POINTER(c_double),
            c_char_p,
            c_size_t,
        ],
    ),
    "foundry_graph_memory_nodes": (c_int, [c_void_p, c_size_t, POINTER(c_uint64), c_char_p, c_size_t]),
    "foundry_graph_build_ahead": (
        c_int,
        [
            c_void_p,
            c_size_t,
            c_void_p,
            c_size_t,
            c_void_p,
            c_size_t,
            c_uint64,
            c_uint64,
            c_void_p,
            c_size_t,
            POINTER(c_size_t),
            POINTER(c_void_p),
            POINTER(c_void_p),
            POINTER(c_double),
            c_char_p,
            c_size_t,
        ],
    ),
    "foundry_graph_retarget": (c_int, [c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_char_p, c_size_t]),
    "foundry_graph_pack_params": (None, [c_void_p, POINTER(c_uint32), c_size_t, c_void_p]),
    "foundry_graph_node_attrs": (
        c_int64,
        [c_void_p, POINTER(c_int32), c_size_t, POINTER(c_uint32), c_char_p, c_size_t],
    ),
}


@functools.cache
def lib() -> ctypes.CDLL:
    """The library with every signature declared. One policy for all of it: the library is built
    from all of native/*.c together, so a missing file or a missing function (a build older than
    this Python code) raises :class:`NativeLibraryMissing` naming the fix."""
    so = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(so, name, None)
        if fn is None:
            raise NativeLibraryMissing(
                f"{library_path()} has no {name}: it is older than this Foundry; rebuild it with `pip install -e .`"
            )
        fn.restype = restype
        fn.argtypes = argtypes
    return so


def graph_lib() -> ctypes.CDLL | None:
    """The library (its native graph builder included), or None where it is not installed."""
    try:
        return lib()
    except (NativeLibraryMissing, OSError):
        return None


def bytes_address(data: bytes) -> int:
    """Where a bytes object's own buffer lies (it never moves: bytes are immutable), so that native
    code can read it, or fill a fresh one in place, without a copy. Keep ``data`` alive meanwhile."""
    return ctypes.cast(ctypes.c_char_p(data), c_void_p).value or 0


@functools.cache
def inflate_fn():
    """``foundry_inflate(src, src_len, dst, dst_len) -> 0 | -1`` (native/inflate.c), or None where the
    library is not installed or libz cannot be loaded; callers then inflate with Python's zlib."""
    so = graph_lib()
    if so is None or not so.foundry_inflate_available():
        return None
    return so.foundry_inflate


def region_error() -> str:
    return (lib().foundry_region_error() or b"").decode(errors="replace")


def modules_error() -> str:
    return (lib().foundry_modules_error() or b"").decode(errors="replace")
