"""NVSHMEM for restored modules: device state set up by the NVSHMEM library of this process.

Kernels built with NVSHMEM device code (DeepEP's low-latency dispatch and combine) read NVSHMEM's
device state, variables of their own module that NVSHMEM fills in for the modules it knows: those
linked into a library it initialised. A module Foundry loads from an archive is not one of them,
so LOAD hands each such module to ``nvshmemx_cumodule_init`` of the NVSHMEM the engine initialised,
and to ``nvshmemx_cumodule_finalize`` before unloading it. The library is the one the
engine already loaded (from the ``nvidia-nvshmem`` wheel; nothing to configure); a process that has
not initialised NVSHMEM yet is refused with the reason, since the state would describe no heap.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os

from .modules import ModuleError

# The variables NVSHMEM's device code keeps in each module that links it, set up by
# nvshmemx_cumodule_init (read in NVSHMEM 3.4.5: it looks up the state and the version, the IBGDA
# state where present). Every nvshmemi_* variable describes the process's NVSHMEM and is never
# copied from a SAVE.
STATE = "nvshmemi_device_state_d"
VERSION = "nvshmemi_device_lib_version_d"
PREFIX = "nvshmemi_"
SONAME = "libnvshmem_host.so.3"

# nvshmemx_init_status(): NVSHMEM_STATUS_IS_INITIALIZED and above mean the heap exists.
STATUS_IS_INITIALIZED = 2


def owns(name: str) -> bool:
    """True for a module variable that NVSHMEM sets up itself."""
    return name.startswith(PREFIX)


def check_image(names, digest: str) -> bool:
    """Whether an image with variables ``names`` holds NVSHMEM device code that LOAD must have
    NVSHMEM set up; raises :class:`ModuleError` for NVSHMEM variables NVSHMEM could not set up."""
    ours = [n for n in names if owns(n)]
    if not ours:
        return False
    if STATE not in ours or VERSION not in ours:
        missing = STATE if STATE not in ours else VERSION
        raise ModuleError(
            f"module {digest[:12]} holds NVSHMEM variables ({', '.join(sorted(ours)[:3])}) without "
            f"{missing}: NVSHMEM could not set them up at LOAD"
        )
    return True


def _wheel_paths() -> list[str]:
    found = []
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        found += sorted(glob.glob(os.path.join(root, "nvshmem", "lib", "libnvshmem_host.so*")))
    return found


def _names() -> list[str]:
    """Where this process's NVSHMEM may have come from: its soname, the nvidia-nvshmem wheel."""
    return [SONAME, *_wheel_paths()]


@functools.cache
def library() -> ctypes.CDLL:
    """The NVSHMEM host library this process already loaded (the engine's libraries load it, from
    the nvidia-nvshmem wheel). Never loaded here: a copy opened afresh would be a second NVSHMEM,
    not initialised, and its device state would describe no heap."""
    for name in _names():
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        except OSError:
            continue
        lib.nvshmemx_init_status.restype = ctypes.c_int
        lib.nvshmemx_cumodule_init.argtypes = [ctypes.c_void_p]
        lib.nvshmemx_cumodule_init.restype = ctypes.c_int
        lib.nvshmemx_cumodule_finalize.argtypes = [ctypes.c_void_p]
        lib.nvshmemx_cumodule_finalize.restype = ctypes.c_int
        return lib
    raise ModuleError(
        "the archive holds NVSHMEM device code and this process has not loaded NVSHMEM "
        f"({SONAME}, from the nvidia-nvshmem wheel): create the engine's NVSHMEM buffers (DeepEP's) "
        "before the LOAD"
    )


def init_module(module, digest: str) -> None:
    """Set up NVSHMEM's device state in ``module`` (a CUmodule loaded from image ``digest``)."""
    lib = library()
    status = int(lib.nvshmemx_init_status())
    if status < STATUS_IS_INITIALIZED:
        raise ModuleError(
            f"module {digest[:12]} holds NVSHMEM device code and NVSHMEM is not initialised in this "
            f"process (status {status}): create the engine's NVSHMEM buffers (DeepEP's) before the LOAD"
        )
    rc = int(lib.nvshmemx_cumodule_init(ctypes.c_void_p(int(module))))
    if rc != 0:
        raise ModuleError(f"module {digest[:12]}: nvshmemx_cumodule_init returned {rc}")


def finalize_module(module, digest: str) -> None:
    """Tell NVSHMEM that ``module`` is about to be unloaded (it keeps the modules it set up, to
    update them)."""
    rc = int(library().nvshmemx_cumodule_finalize(ctypes.c_void_p(int(module))))
    if rc != 0:
        raise ModuleError(f"module {digest[:12]}: nvshmemx_cumodule_finalize returned {rc}")
