"""NVSHMEM's symmetric heap at a recorded address (native/nvshmem_cuda.c, foundry_core.nvshmem),
without a GPU: a stand-in libcuda.so.1 that honours address hints (or ignores them) takes the place
of the driver, and a fresh process calls the shim as NVSHMEM does (it dlopens
``$NVSHMEM_CUDA_PATH/libcuda.so.1``, then resolves cuMemAddressReserve through cuGetProcAddress).
The real NVSHMEM's use of it is a GPU test (tests/gpu/test_nvshmem_gpu.py)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

FAKE_DRIVER = textwrap.dedent(
    """
    #include <stdlib.h>
    #include <string.h>
    typedef unsigned long long u64;
    static u64 next_addr = 0x700000000000ULL;
    static int reserve(u64 *ptr, size_t size, size_t align, u64 addr, u64 flags) {
      (void)align; (void)flags;
      if (addr && !getenv("FAKE_IGNORE_HINT")) { *ptr = addr; return 0; }
      *ptr = next_addr; next_addr += size; return 0;
    }
    int cuInit(unsigned flags) { (void)flags; return 0; }
    int cuGetProcAddress(const char *s, void **pfn, int version, u64 flags) {
      (void)version; (void)flags;
      if (!strcmp(s, "cuMemAddressReserve")) { *pfn = (void *)reserve; return 0; }
      if (!strcmp(s, "cuGetProcAddress")) { *pfn = (void *)cuGetProcAddress; return 0; }
      return 500;
    }
    """
)

# NVSHMEM opens its NVML from NVSHMEM_CUDA_PATH too: a stand-in that says it is one.
FAKE_NVML = "int fake_nvml_marker(void) { return 42; }\n"

BASE = 0x6A0000000000
GIB = 1 << 30

SCRIPT = textwrap.dedent(
    f"""
    import ctypes, json, os
    from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p
    from foundry_core import nvshmem

    out = {{}}
    try:
        nvshmem.check_heap({BASE})
    except nvshmem.HeapPlacementError as e:
        out["before"] = str(e)
    nvshmem.place_heap({BASE})
    # As NVSHMEM does: its driver is $NVSHMEM_CUDA_PATH/libcuda.so.1, its entry points come from
    # cuGetProcAddress.
    drv = ctypes.CDLL(os.path.join(os.environ["NVSHMEM_CUDA_PATH"], "libcuda.so.1"))
    assert drv.cuInit(0) == 0
    gpa = drv.cuGetProcAddress
    gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64]
    fn = c_void_p()
    # The lookup itself looked up first (a caller wanting its versioned form): it stays the shim's.
    assert gpa(b"cuGetProcAddress", byref(fn), 10020, 0) == 0
    gpa = CFUNCTYPE(c_int, c_char_p, POINTER(c_void_p), c_int, c_uint64)(fn.value)
    assert gpa(b"cuMemAddressReserve", byref(fn), 10020, 0) == 0
    reserve = CFUNCTYPE(c_int, POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64)(fn.value)
    got = []
    for size in (2 << 20, 128 * {GIB}, 128 * {GIB}):  # a small range, the heap, a later large one
        p = c_uint64()
        assert reserve(byref(p), size, 512, 0, 0) == 0
        got.append(p.value)
    out["reserved"] = got
    try:  # NVSHMEM's NVML, from the same folder (nvmlwrap.cpp)
        out["nvml"] = ctypes.CDLL(os.path.join(os.environ["NVSHMEM_CUDA_PATH"], "libnvidia-ml.so.1")).fake_nvml_marker()
    except OSError as e:
        out["nvml"] = str(e)
    out["placement"] = nvshmem.heap_placement()
    def refusal(call):
        try:
            call()
        except nvshmem.HeapPlacementError as e:
            return str(e)
    try:
        out["record"] = nvshmem.heap_record()
    except nvshmem.HeapPlacementError as e:
        out["record"] = str(e)
    out["load_same"] = refusal(lambda: nvshmem.check_recorded({{"base": {BASE}, "size": 128 * {GIB}}}))
    out["load_other_size"] = refusal(lambda: nvshmem.check_recorded({{"base": {BASE}, "size": 64 * {GIB}}}))
    out["load_other_base"] = refusal(lambda: nvshmem.check_recorded({{"base": {BASE} + {GIB}, "size": 128 * {GIB}}}))
    try:
        out["check"] = nvshmem.check_heap({BASE})
    except nvshmem.HeapPlacementError as e:
        out["check_error"] = str(e)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the stand-in driver")
    folder = tmp_path_factory.mktemp("fake-driver")
    for name, text in (("libcuda.so.1", FAKE_DRIVER), ("libnvidia-ml.so.1", FAKE_NVML)):
        src = folder / (name.split(".")[0] + ".c")
        src.write_text(text)
        subprocess.run(
            ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{name}", str(src), "-o", str(folder / name)], check=True
        )
    return folder


def _run(env: dict) -> dict:
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_heap_is_reserved_at_the_armed_base(fake_driver):
    out = _run({"LD_LIBRARY_PATH": str(fake_driver), "NVSHMEM_CUDA_PATH": None, "FAKE_IGNORE_HINT": None})
    assert "did not reach the driver through Foundry" in out["before"]
    small, heap, later = out["reserved"]
    assert heap == BASE, "the first large hint-less reservation is the heap, asked for at the base"
    assert small != BASE and later != BASE, "every other reservation goes to the driver unchanged"
    assert out["placement"] == {"asked": BASE, "base": BASE, "size": 128 * GIB, "through_foundry": True}
    assert out["check"]["base"] == BASE and "check_error" not in out
    assert out["nvml"] == 42, "NVSHMEM finds the NVML the loader would have given it"
    assert out["record"] == {"base": BASE, "size": 128 * GIB}, "what SAVE records"
    assert out["load_same"] is None, "a LOAD that placed the heap as SAVE did goes through"
    assert "land at other offsets" in out["load_other_size"]
    assert f"need it at {BASE + GIB:#x}" in out["load_other_base"]


def test_a_driver_that_ignores_the_address_is_refused(fake_driver):
    out = _run({"LD_LIBRARY_PATH": str(fake_driver), "NVSHMEM_CUDA_PATH": None, "FAKE_IGNORE_HINT": "1"})
    assert out["reserved"][1] != BASE and out["placement"]["asked"] == BASE
    assert "did not honour the address" in out["check_error"]
    assert "did not honour the address" in out["record"], "SAVE refuses a heap it could not place"


def test_a_driver_folder_set_before_is_still_the_one_called(fake_driver):
    """NVSHMEM_CUDA_PATH named the driver's folder already: Foundry's shim takes the variable over
    and forwards to that folder's libcuda.so.1 (no LD_LIBRARY_PATH to find it otherwise)."""
    out = _run({"LD_LIBRARY_PATH": None, "NVSHMEM_CUDA_PATH": str(fake_driver), "FAKE_IGNORE_HINT": None})
    assert out["reserved"][1] == BASE and out["check"]["through_foundry"] is True
    assert out["nvml"] == 42, "and that folder's NVML"


def test_a_process_that_never_placed_the_heap_records_none_and_refuses_a_recorded_one():
    from foundry_core import nvshmem

    if nvshmem._armed is not None:
        pytest.skip("this process placed the heap already")
    assert nvshmem.heap_record() is None, "nothing placed: nothing recorded (and the shim not loaded)"
    with pytest.raises(
        nvshmem.HeapPlacementError,
        match=r"did not place it: call foundry_core\.nvshmem\.place_heap\(0x6a0000000000\)",
    ):
        nvshmem.check_recorded({"base": BASE, "size": 128 * GIB})
