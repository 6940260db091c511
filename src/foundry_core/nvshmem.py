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

from ._native import NativeLibraryMissing, built
from .errors import FoundryError, ModuleError

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


# --- the symmetric heap at a recorded address ------------------------------------------------------

#: The heap is the first hint-less reservation at least this large once placement is armed: NVSHMEM
#: reserves NVSHMEM_MAX_MEMORY_PER_GPU (128 GiB by default) per peer at once; its other reservations
#: (multicast groups, which DeepEP turns off) come later.
HEAP_MIN_BYTES = 1 << 30
CUDA_PATH_ENV = "NVSHMEM_CUDA_PATH"
#: NVSHMEM opens its NVML from the same folder once NVSHMEM_CUDA_PATH is set (nvmlwrap.cpp, 3.4.5);
#: without it there its P2P transport does not come up ("init failed for transport: P2P", on the
#: H200 at 9ae1f57), so the folder links the NVML NVSHMEM would have found otherwise.
NVML_NAME = "libnvidia-ml.so.1"


class HeapPlacementError(FoundryError, RuntimeError):
    """NVSHMEM's symmetric heap is not where the archive needs it (the reason is in the message)."""


#: The base :func:`place_heap` armed in this process (None: never called). Read without loading
#: the shim, so a process that never placed the heap never loads it.
_armed: int | None = None


@functools.cache
def _driver_shim() -> ctypes.CDLL:
    """native/nvshmem_cuda.c, loaded privately: the driver NVSHMEM is pointed at."""
    try:
        path = built("_foundry_nvshmem_cuda")
    except NativeLibraryMissing as e:
        raise HeapPlacementError(str(e)) from None
    lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.foundry_nvshmem_real_driver.argtypes = [ctypes.c_char_p]
    lib.foundry_nvshmem_real_driver.restype = ctypes.c_int
    lib.foundry_nvshmem_arm.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    lib.foundry_nvshmem_placement.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 3 + [
        ctypes.POINTER(ctypes.c_int)
    ]
    return lib


@functools.cache
def _driver_folder() -> str:
    """A private folder whose libcuda.so.1 is the shim, for NVSHMEM_CUDA_PATH (NVSHMEM opens
    ``$NVSHMEM_CUDA_PATH/libcuda.so.1``, and its NVML there too: :func:`place_heap` links that);
    removed at exit."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="foundry-nvshmem-cuda-")
    os.symlink(_driver_shim()._name, os.path.join(folder, "libcuda.so.1"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _nvml_path(previous: str | None) -> str | None:
    """The NVML library NVSHMEM would open without Foundry: ``previous/libnvidia-ml.so.1`` where
    NVSHMEM_CUDA_PATH named a folder, else the one the dynamic loader finds (None where there is
    none: then NVSHMEM finds none either)."""
    if previous:
        path = os.path.join(previous, NVML_NAME)
        return path if os.path.exists(path) else None
    try:
        ctypes.CDLL(NVML_NAME, mode=os.RTLD_LOCAL)
    except OSError:
        return None
    with open("/proc/self/maps") as maps:  # where the loader found it
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libnvidia-ml.so"):
                return path
    return None


def _initialised() -> bool:
    try:
        return int(library().nvshmemx_init_status()) >= STATUS_IS_INITIALIZED
    except ModuleError:  # NVSHMEM not loaded yet: not initialised either
        return False


def place_heap(base: int, min_bytes: int = HEAP_MIN_BYTES) -> None:
    """Have this process's NVSHMEM reserve its symmetric heap at ``base`` when it initialises (the
    engine's first NVSHMEM buffer: DeepEP's, or torch's NVSHMEM symmetric memory). Call before that;
    an NVSHMEM initialised already is refused. A driver library named by ``NVSHMEM_CUDA_PATH``
    before this call is still the one NVSHMEM's calls go to. Read the outcome with :func:`check_heap`."""
    if _initialised():
        raise HeapPlacementError("NVSHMEM is initialised already: its heap can no longer be placed")
    shim = _driver_shim()
    folder = _driver_folder()
    previous = os.environ.get(CUDA_PATH_ENV)
    if previous and os.path.abspath(previous) == folder:
        previous = None  # placed before in this process
    if previous:
        if shim.foundry_nvshmem_real_driver(os.path.join(previous, "libcuda.so.1").encode()) != 0:
            raise HeapPlacementError(f"{CUDA_PATH_ENV}={previous}: too late to forward to it")
    nvml, link = _nvml_path(previous), os.path.join(folder, NVML_NAME)
    if nvml and not os.path.lexists(link):
        os.symlink(nvml, link)
    shim.foundry_nvshmem_arm(base, min_bytes)
    os.environ[CUDA_PATH_ENV] = folder
    global _armed
    _armed = base


def heap_placement() -> dict:
    """What the placing reservation asked for and got: ``asked``, ``base``, ``size`` (0 before it),
    and ``through_foundry``, whether NVSHMEM reached the driver through Foundry's shim at all."""
    vals = [ctypes.c_uint64() for _ in range(3)]
    through = ctypes.c_int()
    _driver_shim().foundry_nvshmem_placement(*(ctypes.byref(v) for v in vals), ctypes.byref(through))
    asked, base, size = (v.value for v in vals)
    return {"asked": asked, "base": base, "size": size, "through_foundry": bool(through.value)}


def check_heap(base: int) -> dict:
    """Raise :class:`HeapPlacementError` unless NVSHMEM's heap was reserved at ``base``; returns
    :func:`heap_placement`."""
    got = heap_placement()
    if not got["through_foundry"]:
        raise HeapPlacementError(
            f"NVSHMEM did not reach the driver through Foundry ({CUDA_PATH_ENV} was set after NVSHMEM "
            "loaded its driver, or NVSHMEM is not initialised yet)"
        )
    if not got["size"]:
        raise HeapPlacementError(
            f"NVSHMEM reserved no range of {HEAP_MIN_BYTES} bytes or more since placement was armed"
        )
    if got["base"] != base:
        raise HeapPlacementError(
            f"NVSHMEM's heap is at {got['base']:#x}, not {base:#x}: the driver did not honour the address"
        )
    return got


def heap_record() -> dict | None:
    """What SAVE records of NVSHMEM's heap: ``{"base", "size"}`` where this process placed it
    (:func:`place_heap`) and NVSHMEM reserved it there; None where placement was never armed or
    NVSHMEM has not reserved its heap (then no kernel can hold an address in it). Raises
    :class:`HeapPlacementError` where placement was armed and NVSHMEM's heap is elsewhere: captured
    kernels holding addresses in it could not be given the same addresses at LOAD."""
    if _armed is None:
        return None
    if not heap_placement()["size"] and not _initialised():
        return None
    got = check_heap(_armed)
    return {"base": got["base"], "size": got["size"]}


def check_recorded(record: dict) -> None:
    """LOAD's check of what :func:`heap_record` recorded at SAVE, before any restored kernel runs:
    this process placed NVSHMEM's heap at the same base, NVSHMEM reserved it there, and it has the
    same size (another PE count or NVSHMEM_MAX_MEMORY_PER_GPU would move its allocations' offsets)."""
    base, size = int(record["base"]), int(record["size"])
    if _armed is None:
        raise HeapPlacementError(
            f"the archive's graphs were captured with NVSHMEM's heap at {base:#x}, and this process "
            f"did not place it: call foundry_core.nvshmem.place_heap({base:#x}) before NVSHMEM initialises"
        )
    if _armed != base:
        raise HeapPlacementError(
            f"this process placed NVSHMEM's heap at {_armed:#x}, the archive's graphs need it at {base:#x}"
        )
    got = check_heap(base)
    if got["size"] != size:
        raise HeapPlacementError(
            f"NVSHMEM's heap is {got['size']} bytes, the archive's was {size}: allocations in it would "
            "land at other offsets (another PE count or NVSHMEM_MAX_MEMORY_PER_GPU); SAVE again"
        )
