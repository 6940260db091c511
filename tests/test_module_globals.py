"""Module variables (module_globals.py) and NVSHMEM's device state (nvshmem.py), on the CPU: a cubin's
variables read from its ELF, SAVE's record against a stand-in driver whose "device memory" is host
memory, LOAD's writes, the audit of pointers they hold, and the NVSHMEM calls against a stand-in
libnvshmem_host built here. The same on a GPU: tests/gpu/test_module_variables_gpu.py."""

import ctypes
import logging
import shutil
import subprocess

import pytest
from cuda.bindings import driver as real

from foundry_core import _native, graphs, module_globals, modules, nvshmem
from foundry_core.graphs import GraphError, Segments, WalkMemo, block_auditor
from foundry_core.modules import LoadedModules, ModuleError

REGION = 0x600000000000
OUTSIDE = 0x7F0000000000  # device memory outside the region


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build a real cubin")
def test_elf_globals_on_a_real_cubin(tmp_path):
    src = tmp_path / "v.cu"
    src.write_text(
        "__device__ float scale_d;\n"
        "__device__ int table_d[4] = {1, 2, 3, 4};\n"
        "__constant__ float coeff_c[8];\n"
        "__constant__ int init_c = 7;\n"
        "namespace ns { __device__ unsigned long long counter_d; }\n"
        'extern "C" __global__ void k(float* x) {\n'
        "  x[threadIdx.x] = x[threadIdx.x] * scale_d * coeff_c[threadIdx.x % 8] + table_d[threadIdx.x % 4] + init_c;\n"
        "  atomicAdd(&ns::counter_d, 1ull);\n"
        "}\n"
    )
    cubin = tmp_path / "v.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(src), "-o", str(cubin)], check=True)
    found = modules.elf_globals(cubin.read_bytes())
    assert found == {"scale_d": 4, "table_d": 16, "coeff_c": 32, "init_c": 4, "_ZN2ns9counter_dE": 8}
    assert list(modules.elf_functions(cubin.read_bytes())) == ["k"]


def test_elf_globals_of_something_else_is_empty():
    assert modules.elf_globals(b"not an elf at all" * 10) == {}
    assert modules.elf_globals(b"\x7fELF" + b"\x02" + b"\0" * 100) == {}


class _Device:
    """Host memory standing in for device memory, and the driver calls module_globals makes."""

    CUpointer_attribute = real.CUpointer_attribute

    def __init__(self):
        self._keep = []
        self.images = {}  # image address -> {name: bytes a fresh load holds}
        self.modules = {}  # handle -> {name: (address, size)}
        self.engine = {}  # CUfunction value -> handle of the engine's module
        self.unloaded = []
        self.device_ranges = [(OUTSIDE, 1 << 20)]

    def alloc(self, value: bytes) -> int:
        buf = ctypes.create_string_buffer(value, len(value))
        self._keep.append(buf)
        return ctypes.addressof(buf)

    def module_with(self, values: dict[str, bytes]) -> int:
        handle = 0x1000 + len(self.modules)
        self.modules[handle] = {n: (self.alloc(v), len(v)) for n, v in values.items()}
        return handle

    def value(self, handle: int, name: str) -> bytes:
        addr, size = self.modules[handle][name]
        return ctypes.string_at(addr, size)

    # driver calls
    def cuFuncGetModule(self, func):
        handle = self.engine.get(int(func))
        return (
            (real.CUresult.CUDA_ERROR_INVALID_HANDLE, None)
            if handle is None
            else (real.CUresult.CUDA_SUCCESS, handle)
        )

    def cuModuleLoadData(self, image):
        return real.CUresult.CUDA_SUCCESS, self.module_with(self.images[int(image)])

    def cuModuleUnload(self, module):
        self.unloaded.append(int(module))
        return (real.CUresult.CUDA_SUCCESS,)

    def cuModuleGetGlobal(self, module, name):
        found = self.modules[int(module)].get(name.decode())
        if found is None:
            return real.CUresult.CUDA_ERROR_NOT_FOUND, 0, 0
        return real.CUresult.CUDA_SUCCESS, found[0], found[1]

    def cuMemcpyDtoH(self, dst, src, n):
        ctypes.memmove(dst, int(src), n)
        return (real.CUresult.CUDA_SUCCESS,)

    def cuMemcpyHtoD(self, dst, src, n):
        ctypes.memmove(int(dst), src, n)
        return (real.CUresult.CUDA_SUCCESS,)

    def cuPointerGetAttribute(self, attr, value):
        if any(a <= value < a + n for a, n in self.device_ranges):
            return real.CUresult.CUDA_SUCCESS, 1
        return real.CUresult.CUDA_ERROR_INVALID_VALUE, 0


@pytest.fixture
def device(monkeypatch):
    dev = _Device()
    for module in (module_globals, graphs, modules):
        monkeypatch.setattr(module, "cu", lambda: dev)
    variables = {}  # image bytes -> {name: size}, what elf_globals reads from a real cubin
    monkeypatch.setattr(module_globals, "elf_globals", lambda data: variables.get(data, {}))
    dev.variables = variables
    return dev


def _image(device, data: bytes, fresh: dict[str, bytes]) -> bytes:
    """An image whose variables are ``fresh`` (as a fresh load holds them)."""
    device.images[_native.bytes_address(data)] = fresh
    device.variables[data] = {n: len(v) for n, v in fresh.items()}
    return data


def _audit():
    return block_auditor(Segments(REGION, 1 << 30, [(REGION, 1 << 20)]), WalkMemo())


def test_save_records_only_the_variables_the_engine_changed(device):
    data = _image(
        device,
        b"image-a",
        {"same": b"\x01\x02\x03\x04", "table": bytes(16), "where": bytes(8)},
    )
    engine = device.module_with(
        {
            "same": b"\x01\x02\x03\x04",
            "table": bytes(range(16)),
            "where": (REGION + 64).to_bytes(8, "little"),  # a pointer into the region: LOAD maps it there
        }
    )
    device.engine[0xF1] = engine
    variables = module_globals.record({"a" * 64: data}, {"a" * 64: 0xF1}, _audit())
    assert [e[:2] for e in variables.entries] == [["a" * 64, "table"], ["a" * 64, "where"]]
    assert variables.blob == bytes(range(16)) + (REGION + 64).to_bytes(8, "little")
    assert variables.to_meta() == {"globals": variables.entries}
    assert device.unloaded, "the fresh reference module is unloaded"


def test_a_variable_pointing_outside_the_region_is_left_as_the_image_holds_it(device, caplog):
    data = _image(device, b"image-b", {"ptr": bytes(16), "flag": bytes(4)})
    device.engine[0xF2] = device.module_with(
        {"ptr": bytes(8) + OUTSIDE.to_bytes(8, "little"), "flag": b"\x01\0\0\0"}
    )
    with caplog.at_level(logging.WARNING, logger="foundry.modules"):
        variables = module_globals.record({"b" * 64: data}, {"b" * 64: 0xF2}, _audit())
    assert [e[1] for e in variables.entries] == ["flag"]  # the rest is restored
    assert [s[:2] for s in variables.skipped] == [["b" * 64, "ptr"]]
    assert "variable ptr of module bbbbbbbbbbbb byte 8 points to memory at 0x7f" in variables.skipped[0][2]
    assert variables.to_meta()["globals_skipped"] == variables.skipped
    assert "1 module variable(s) hold pointers outside the region" in caplog.text


def test_a_relocated_variable_is_not_a_change(device):
    """The driver writes an address into a variable initialised with another's: a fresh load holds
    it too, so it is not recorded (it would point into the engine's module, outside the region)."""
    relocated = OUTSIDE.to_bytes(8, "little")
    data = _image(device, b"image-c", {"p": relocated})
    device.engine[0xF3] = device.module_with({"p": relocated})
    assert module_globals.record({"c" * 64: data}, {"c" * 64: 0xF3}, _audit()).entries == []


def test_nvshmem_state_is_never_copied_and_its_module_is_marked(device):
    state = {"nvshmemi_device_state_d": bytes(64), "nvshmemi_device_lib_version_d": bytes(12)}
    data = _image(device, b"image-d", {**state, "mine": bytes(4)})
    device.engine[0xF4] = device.module_with(
        {
            "nvshmemi_device_state_d": OUTSIDE.to_bytes(8, "little") * 8,  # the SAVE process's heap
            "nvshmemi_device_lib_version_d": b"\x03\0\0\0\x04\0\0\0\x05\0\0\0",
            "mine": b"\x05\x00\x00\x00",
        }
    )
    variables = module_globals.record({"d" * 64: data}, {"d" * 64: 0xF4}, _audit())
    assert [e[1] for e in variables.entries] == ["mine"]
    assert variables.nvshmem == ["d" * 64]
    assert variables.to_meta()["nvshmem_images"] == ["d" * 64]


def test_nvshmem_variables_nvshmem_could_not_set_up_refuse_the_save(device):
    data = _image(device, b"image-n", {"nvshmemi_device_state_d": bytes(64)})
    device.engine[0xF5] = device.module_with({"nvshmemi_device_state_d": bytes(64)})
    with pytest.raises(
        GraphError,
        match="module nnnnnnnnnnnn holds NVSHMEM variables .* without nvshmemi_device_lib_version_d",
    ):
        module_globals.record({"n" * 64: data}, {"n" * 64: 0xF5}, _audit())


def test_variables_that_cannot_be_read_are_named_in_a_warning(device, caplog):
    data = _image(device, b"image-e", {"v": bytes(4)})
    with caplog.at_level(logging.WARNING, logger="foundry.modules"):
        variables = module_globals.record({"e" * 64: data}, {"e" * 64: 0xDEAD}, _audit())
    assert variables.entries == [] and "e" * 64 in variables.unread
    assert "CUDA_ERROR_INVALID_HANDLE" in variables.unread["e" * 64]
    assert "could not be read at SAVE" in caplog.text and "eeeeeeeeeeee" in caplog.text


def _loaded(device, digest: str, values: dict[str, bytes]) -> LoadedModules:
    loaded = LoadedModules()
    loaded._modules[digest] = (device.module_with(values), b"")
    return loaded


def test_load_writes_the_recorded_values_before_the_first_replay(device):
    loaded = _loaded(device, "a" * 64, {"table": bytes(16), "where": bytes(8)})
    meta = {"globals": [["a" * 64, "table", 0, 16], ["a" * 64, "where", 16, 8]]}
    blob = bytes(range(16)) + (REGION + 64).to_bytes(8, "little")
    assert module_globals.restore(meta, {module_globals.MEMBER: blob}.__getitem__, loaded) == 2
    handle = loaded.module("a" * 64)
    assert device.value(handle, "table") == bytes(range(16))
    assert device.value(handle, "where") == (REGION + 64).to_bytes(8, "little")
    assert module_globals.restore({}, {}.__getitem__, loaded) == 0  # an archive with none reads nothing


@pytest.mark.parametrize(
    "entry,blob,why",
    [
        (
            ["a" * 64, "gone", 0, 4],
            bytes(4),
            "variable gone of module aaaaaaaaaaaa: cuModuleGetGlobal failed: CUDA_ERROR_NOT_FOUND",
        ),
        (
            ["a" * 64, "table", 0, 8],
            bytes(8),
            "variable table of module aaaaaaaaaaaa is 16 bytes here, 8 at SAVE",
        ),
        (["a" * 64, "table", 0, 16], bytes(4), "the archive holds 4 bytes"),
    ],
)
def test_load_refuses_a_variable_it_cannot_write_as_saved(device, entry, blob, why):
    loaded = _loaded(device, "a" * 64, {"table": bytes(16)})
    with pytest.raises(ModuleError, match=why):
        module_globals.restore({"globals": [entry]}, {module_globals.MEMBER: blob}.__getitem__, loaded)


# --- NVSHMEM, against a stand-in host library --------------------------------------------------------

_FAKE_NVSHMEM = r"""
static int status, inits, finals;
static void *last;
int nvshmemx_init_status(void) { return status; }
int nvshmemx_cumodule_init(void *m) { inits++; last = m; return m == (void *)0xbad ? 7 : 0; }
int nvshmemx_cumodule_finalize(void *m) { finals++; last = m; return 0; }
void fake_set_status(int s) { status = s; }
int fake_inits(void) { return inits; }
int fake_finals(void) { return finals; }
void *fake_last(void) { return last; }
"""


@pytest.fixture
def fake_nvshmem(tmp_path, monkeypatch):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in NVSHMEM library")
    lib_dir = tmp_path / "site" / "nvidia" / "nvshmem" / "lib"
    lib_dir.mkdir(parents=True)
    src = tmp_path / "fake_nvshmem.c"
    src.write_text(_FAKE_NVSHMEM)
    so = lib_dir / "libnvshmem_host.so.3"
    subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{so.name}", "-o", str(so), str(src)], check=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert str(so) in nvshmem._names(), "found where the nvidia-nvshmem wheel puts it"
    # Only a library the process loaded is used: as the engine's DeepEP would have, load it first.
    monkeypatch.setattr(nvshmem, "_names", lambda: [str(so)])
    nvshmem.library.cache_clear()
    with pytest.raises(ModuleError, match="this process has not loaded NVSHMEM"):
        nvshmem.library()
    lib = ctypes.CDLL(str(so))
    yield lib
    nvshmem.library.cache_clear()


def test_nvshmem_is_found_in_the_wheel_and_sets_up_a_restored_module(fake_nvshmem, device):
    fake_nvshmem.fake_set_status(2)
    fake_nvshmem.fake_last.restype = ctypes.c_void_p
    loaded = _loaded(device, "d" * 64, {})
    handle = loaded.module("d" * 64)
    loaded.init_nvshmem("d" * 64)
    loaded.init_nvshmem("d" * 64)  # once per module
    assert fake_nvshmem.fake_inits() == 1 and fake_nvshmem.fake_last() == handle
    loaded.unload()  # NVSHMEM is told before the driver unloads the module
    assert fake_nvshmem.fake_finals() == 1 and fake_nvshmem.fake_last() == handle
    assert device.unloaded == [handle]


def test_nvshmem_not_initialised_refuses_with_the_reason(fake_nvshmem):
    fake_nvshmem.fake_set_status(0)
    with pytest.raises(
        ModuleError, match=r"module dddddddddddd holds NVSHMEM device code and NVSHMEM is not initialised"
    ):
        nvshmem.init_module(0x5000, "d" * 64)
    fake_nvshmem.fake_set_status(2)
    with pytest.raises(ModuleError, match="nvshmemx_cumodule_init returned 7"):
        nvshmem.init_module(0xBAD, "d" * 64)


def test_load_has_nvshmem_set_up_the_marked_modules(device, monkeypatch):
    calls = []
    monkeypatch.setattr(nvshmem, "init_module", lambda module, digest: calls.append(("init", module, digest)))
    monkeypatch.setattr(
        nvshmem, "finalize_module", lambda module, digest: calls.append(("fini", module, digest))
    )
    loaded = _loaded(device, "d" * 64, {})
    module_globals.restore({"nvshmem_images": ["d" * 64]}, {}.__getitem__, loaded)
    handle = loaded.module("d" * 64)
    assert calls == [("init", handle, "d" * 64)]
    loaded.unload()
    assert calls[-1] == ("fini", handle, "d" * 64)
    assert device.unloaded == [handle]


def test_inspect_names_the_modules_whose_state_load_restores(tmp_path, capsys):
    from foundry_core.archive import ArchiveWriter
    from foundry_core.cli import main

    a, d, plain = "a" * 64, "d" * 64, "f" * 64
    meta = {
        "kind": "foundry-graphs",
        "graphs": [],
        "kernels": [[a, "k", {}], [d, "dispatch", {}], [plain, "gemm", {}]],
        "images": [a, d, plain],
        "globals": [[a, "table", 0, 16], [a, "where", 16, 8]],
        "nvshmem_images": [d],
        "globals_skipped": [[a, "ptr", "points outside the region"]],
        "nvshmem_heap": {"base": 0x700000000000, "size": 256 << 30},
        "layout": {},
    }
    with ArchiveWriter(tmp_path / "g") as w:
        for image in meta["images"]:
            w.add_bytes(f"modules/{image}.cubin", b"\0" * 64)
        w.add_bytes(module_globals.MEMBER, bytes(24))
        w.commit(fingerprint={"gpu_name": "NVIDIA H200", "model": {}}, meta=meta)
    assert main(["inspect", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "NVSHMEM heap: 256.0 GiB at 0x700000000000" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:16] in (a[:16], d[:16], plain[:16])}
    assert rows[a[:16]].rstrip().endswith("2 variables, 1 not restored")
    assert rows[d[:16]].rstrip().endswith("NVSHMEM")
    assert rows[plain[:16]].rstrip().endswith("-")


def test_a_variable_the_driver_will_not_give_is_named_and_the_others_are_recorded(device, caplog):
    data = _image(device, b"image-f", {"kept": bytes(4), "$str": b"abc\0"})
    device.variables[data]["gone"] = 4  # in the ELF, not in the module the driver loaded
    device.engine[0xF6] = device.module_with({"kept": b"\x09\0\0\0", "$str": b"xyz\0"})
    with caplog.at_level(logging.WARNING, logger="foundry.modules"):
        variables = module_globals.record({"f" * 64: data}, {"f" * 64: 0xF6}, _audit())
    assert [e[1] for e in variables.entries] == ["kept"]  # never the compiler's string literals
    assert (
        variables.unread["f" * 64]
        == "1 of 2 variables, e.g. gone: cuModuleGetGlobal failed: CUDA_ERROR_NOT_FOUND"
    )


# --- against the real nvidia-nvshmem wheel, where an environment has it (the SGLang one does) --------


def _nvshmem_wheel():
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = glob.glob(f"{root}/nvshmem/lib/libnvshmem_host.so.3")
        if lib and glob.glob(f"{root}/nvshmem/include/nvshmem.h"):
            return lib[0], f"{root}/nvshmem"
    return None


WHEEL = _nvshmem_wheel()
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="the nvidia-nvshmem wheel is not installed here")


@needs_wheel
def test_the_real_nvshmem_library_is_used_only_once_the_process_loaded_it():
    """In a fresh process: before the engine loaded NVSHMEM, Foundry does not load a copy of its own;
    once loaded (no GPU here, so not initialised), a restored NVSHMEM module is refused, naming why,
    through the library's real entry points."""
    script = f"""
import ctypes
from foundry_core import nvshmem
from foundry_core.modules import ModuleError
try:
    nvshmem.library()
    print("found before loading")
except ModuleError as e:
    print("before:", e)
ctypes.CDLL({WHEEL[0]!r})
try:
    nvshmem.init_module(0x5000, "d" * 64)
except ModuleError as e:
    print("after:", e)
"""
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "before: the archive holds NVSHMEM device code and this process has not loaded NVSHMEM"
    )
    assert lines[1] == (
        "after: module dddddddddddd holds NVSHMEM device code and NVSHMEM is not initialised in this "
        "process (status 0): create the engine's NVSHMEM buffers (DeepEP's) before the LOAD"
    )


@needs_wheel
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build a real cubin")
def test_a_real_nvshmem_cubin_is_marked_and_its_state_never_copied(tmp_path):
    """A kernel device-linked against the wheel's libnvshmem_device.a, as DeepEP's are: its module
    holds NVSHMEM's state and version variables, which mark it for nvshmemx_cumodule_init."""
    _lib, root = WHEEL
    src = tmp_path / "k.cu"
    src.write_text(
        "#include <nvshmem.h>\n#include <nvshmemx.h>\n"
        'extern "C" __global__ void probe(long long *o) { o[0] = nvshmem_my_pe(); o[1] = nvshmem_n_pes(); }\n'
    )
    obj, cubin = tmp_path / "k.o", tmp_path / "k.cubin"
    subprocess.run(
        ["nvcc", "-arch=sm_90", "-rdc=true", f"-I{root}/include", "-c", str(src), "-o", str(obj)], check=True
    )
    subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-dlink",
            str(obj),
            f"-L{root}/lib",
            "-lnvshmem_device",
            "-cubin",
            "-o",
            str(cubin),
        ],
        check=True,
    )
    names = modules.elf_globals(cubin.read_bytes())
    assert {nvshmem.STATE, nvshmem.VERSION} <= set(names)
    assert nvshmem.check_image(names, "k" * 64) is True
    assert all(nvshmem.owns(n) for n in names if n.startswith("nvshmemi_"))
