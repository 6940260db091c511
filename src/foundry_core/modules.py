"""Code capture and reload: the module images that saved graphs' kernels live in.

SAVE: the native recorder (native/modules.c) keeps every image the driver loads. Each kernel of a
saved graph is matched to its image by CUmodule handle where the load went through the public
driver API, otherwise by its mangled name in the image's ELF symbol table. Only matched images
are stored, content-addressed by sha256.

LOAD: images are loaded with cuModuleLoadData, kernels resolved by name, forced to load (lazy
loading would otherwise defer it past instantiate), and given back the function attributes SAVE
saw (dynamic shared memory, carveout, cluster settings).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import os
import struct
import sys
from collections.abc import Iterator

from cuda.bindings import driver as _drv

from . import _native, nvshmem
from .driver import call, cu
from .errors import ModuleError

# Function attributes a kernel's launch depends on that a library may have set at run time: the
# archive's name and the CUfunction_attribute.
_F = _drv.CUfunction_attribute
SETTABLE_FUNC_ATTRIBUTES = {
    "max_dynamic_shared": int(_F.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
    "preferred_carveout": int(_F.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT),
    "cluster_width": int(_F.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH),
    "cluster_height": int(_F.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT),
    "cluster_depth": int(_F.CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH),
    "non_portable_cluster": int(_F.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED),
    "cluster_scheduling": int(_F.CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE),
}
NUM_REGS = int(_F.CU_FUNC_ATTRIBUTE_NUM_REGS)


def _cupti_candidates() -> Iterator[str]:
    """CUPTI libraries to try, in order, found as they are asked for: a LOAD starts recording on its
    start's critical path, and the first one usually starts."""
    env = os.environ.get("FOUNDRY_CUPTI")
    if env:
        yield env
    for entry in sys.path:
        # Where the NVIDIA wheels keep it (nvidia/cu13/lib, nvidia/cuda_cupti/lib): two directory
        # reads; only a layout without it there walks the whole nvidia tree (thousands of files).
        shallow = glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcupti.so*"))
        yield from sorted(shallow) or sorted(
            glob.glob(os.path.join(entry, "nvidia", "**", "libcupti.so*"), recursive=True)
        )
    for root in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        yield from sorted(glob.glob(os.path.join(root, "extras", "CUPTI", "lib64", "libcupti.so*")))
        yield from sorted(glob.glob(os.path.join(root, "targets", "*", "lib", "libcupti.so*")))
    yield "libcupti.so"


def start_recording(keep_images: bool = True) -> None:
    """Start keeping every CUDA module image this process loads. Idempotent.

    Call it before the kernels a SAVE needs are first used: images loaded earlier are not seen,
    and a SAVE that needs one refuses, naming the kernel. ``keep_images=False`` only counts stream
    captures (:func:`stream_captures`), as a LOAD does to show it captured nothing, without copying
    every module the process loads; the last call decides for images loaded after it.
    """
    lib = _native.lib()
    lib.foundry_modules_keep_images(1 if keep_images else 0)
    if lib.foundry_modules_started():
        return
    errors = []
    for path in _cupti_candidates():
        if lib.foundry_modules_start(path.encode()) == 0:
            return
        errors.append(_native.modules_error())
    raise ModuleError(f"cannot start CUPTI module recording: {errors[-1] if errors else 'no CUPTI found'}")


def stop_recording() -> None:
    """Stop recording and detach CUPTI from the process. Idempotent; a later start begins anew.

    Call it once the graphs are saved or restored, so that the serving loop runs with no profiler
    interface attached (a CUPTI left attached can slow launches; on the H200 stack it measured
    0-4 % on small eager launches, benchmarks/results/cupti-overhead-h200.json). Images kept so far
    stay available, and :func:`stream_captures` keeps returning the counts reached, which no longer
    grow.
    """
    lib = _native.lib()
    if lib.foundry_modules_stop() != 0:
        raise ModuleError(f"cannot stop CUPTI module recording: {_native.modules_error()}")


def recording() -> bool:
    return bool(_native.lib().foundry_modules_started())


def stream_captures() -> dict[str, int]:
    """Stream captures begun in this process since recording started (runtime and driver API)."""
    lib = _native.lib()
    return {"runtime": int(lib.foundry_captures_runtime()), "driver": int(lib.foundry_captures_driver())}


@dataclasses.dataclass
class Image:
    digest: str
    data: bytes
    functions: dict[str, int]  # mangled name -> register count (-1 where unknown)


EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04


def _regcounts(data: bytes, off: int, size: int) -> dict[int, int]:
    """Register counts by symbol index, from a cubin's ``.nv.info`` attribute records."""
    counts, p, end = {}, off, off + size
    while p + 4 <= end:
        fmt, attr = data[p], data[p + 1]
        if fmt == EIFMT_SVAL:
            (n,) = struct.unpack_from("<H", data, p + 2)
            if attr == EIATTR_REGCOUNT and n >= 8:
                sym, regs = struct.unpack_from("<II", data, p + 4)
                counts[sym] = regs
            p += 4 + n
        else:  # the other record formats carry their value in the two bytes after the header
            p += 4
    return counts


class _Elf:
    """The section table and symbols of a cubin (ELF64), read once for the queries below."""

    def __init__(self, data: bytes):
        self.data = data
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        # (name offset, type, file offset, size, link) per section
        self.sections = []
        for i in range(shnum):
            name, typ, _flags, _addr, off, size, link, _info, _align, _entsize = struct.unpack_from(
                "<IIQQQQIIQQ", data, shoff + i * shentsize
            )
            self.sections.append((name, typ, off, size, link))
        shstr_off = self.sections[shstrndx][2]
        self.names = [self.cstr(shstr_off, sec[0]) for sec in self.sections]

    def cstr(self, base: int, at: int) -> str:
        end = self.data.index(b"\0", base + at)
        return self.data[base + at : end].decode("latin-1")

    def symbols(self):
        """(index, name, type, section index, size) of every symbol-table entry."""
        for _name, typ, off, size, link in self.sections:
            if typ != SHT_SYMTAB:
                continue
            str_off = self.sections[link][2]
            for j in range(size // 24):
                st_name, st_info, _other, st_shndx, _value, st_size = struct.unpack_from(
                    "<IBBHQQ", self.data, off + 24 * j
                )
                yield j, self.cstr(str_off, st_name), st_info & 0xF, st_shndx, st_size


SHT_SYMTAB = 2
STT_OBJECT, STT_FUNC = 1, 2


def _elf(data: bytes) -> _Elf | None:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    try:
        return _Elf(data)
    except (struct.error, IndexError, ValueError):
        return None


def elf_functions(data: bytes) -> dict[str, int]:
    """Kernel names defined in a cubin (ELF64) and their register counts (-1 where not recorded).

    Kernels are the function symbols of ``.text.*`` sections; nvcc records each one's register
    count in the ``.nv.info`` section (attribute REGCOUNT, keyed by symbol index). Non-ELF
    images give {}.
    """
    elf = _elf(data)
    if elf is None:
        return {}
    try:
        text_sections = {i for i, n in enumerate(elf.names) if n.startswith(".text.")}
        regs: dict[int, int] = {}
        for i, n in enumerate(elf.names):
            if n == ".nv.info":
                regs.update(_regcounts(data, elf.sections[i][2], elf.sections[i][3]))
        return {
            name: regs.get(j, -1)
            for j, name, typ, shndx, _size in elf.symbols()
            if typ == STT_FUNC and shndx in text_sections
        }
    except (struct.error, IndexError, ValueError):
        return {}


def _is_variable_section(name: str) -> bool:
    """Sections that hold a module's own variables: ``__device__`` ones (``.nv.global``, zeroed, and
    ``.nv.global.init``) and ``__constant__`` ones (``.nv.constant3`` from nvcc; any bank but 0, which
    holds each kernel's parameters). The driver gives every loaded module its own copy of them."""
    if name in (".nv.global", ".nv.global.init"):
        return True
    return name.startswith(".nv.constant") and not name.startswith(".nv.constant0")


def elf_globals(data: bytes) -> dict[str, int]:
    """The variables a cubin (ELF64) defines, ``{name: size in bytes}``, the names as
    ``cuModuleGetGlobal`` takes them. Their initial values are not read here: the driver applies
    relocations at load (a variable initialised to another's address), so a module freshly loaded
    is the reference (:mod:`.module_globals`). Non-ELF images give {}."""
    elf = _elf(data)
    if elf is None:
        return {}
    try:
        wanted = {i for i, n in enumerate(elf.names) if _is_variable_section(n)}
        return {
            name: size
            for _j, name, typ, shndx, size in elf.symbols()
            if typ == STT_OBJECT and shndx in wanted and size > 0 and name
        }
    except (struct.error, IndexError, ValueError):
        return {}


class Recorded:
    """The images recorded so far, indexed for matching kernels to code."""

    def __init__(self):
        lib = _native.lib()
        if lib.foundry_modules_dropped():
            raise ModuleError("module images were lost to host memory exhaustion during recording")
        self.images: dict[str, Image] = {}
        self._by_handle: dict[int, str] = {}
        self._by_name: dict[str, list[str]] = {}
        data_p, size, handle = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_uint64()
        for i in range(int(lib.foundry_modules_count())):
            if lib.foundry_modules_get(i, ctypes.byref(data_p), ctypes.byref(size), ctypes.byref(handle)):
                continue
            data = ctypes.string_at(data_p.value, size.value)
            digest = hashlib.sha256(data).hexdigest()
            if digest not in self.images:
                image = Image(digest, data, elf_functions(data))
                self.images[digest] = image
                for name in image.functions:
                    self._by_name.setdefault(name, []).append(digest)
            if handle.value:
                self._by_handle[handle.value] = digest

    def match(self, func, name: str) -> str:
        """The digest of the image that holds kernel ``func`` (mangled ``name``)."""
        try:
            module = call(cu().cuFuncGetModule, func)
            digest = self._by_handle.get(int(module))
        except RuntimeError:
            digest = None
        if digest is not None:
            return digest
        candidates = self._by_name.get(name, [])
        if not candidates:
            for digest, image in self.images.items():  # images without an ELF symbol table
                if not image.functions and name.encode() in image.data:
                    candidates.append(digest)
        if not candidates:
            raise ModuleError(
                f"kernel {name}: no recorded module image holds it (was it loaded before "
                f"foundry_core.start_recording()?)"
            )
        if len(candidates) > 1:
            regs = int(call(cu().cuFuncGetAttribute, cu().CUfunction_attribute(NUM_REGS), func))
            same = [d for d in candidates if self.images[d].functions.get(name, -1) == regs]
            candidates = same or candidates
        # Several images holding one symbol with the same register count are copies of one
        # template instantiation compiled into several translation units; any of them will do.
        return candidates[0]


def function_attributes(func) -> dict[str, int]:
    attrs = {}
    for key, attr in SETTABLE_FUNC_ATTRIBUTES.items():
        try:
            attrs[key] = int(call(cu().cuFuncGetAttribute, cu().CUfunction_attribute(attr), func))
        except RuntimeError:
            pass
    return attrs


class LoadedModules:
    """Modules loaded from an archive's images in this process, and the kernels resolved in them."""

    def __init__(self):
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._nvshmem: list[str] = []  # modules whose NVSHMEM device state NVSHMEM set up

    def module(self, digest: str):
        """The CUmodule this process loaded for image ``digest``."""
        return self._modules[digest][0]

    def init_nvshmem(self, digest: str) -> None:
        """Have NVSHMEM set up the device state of module ``digest`` (it holds NVSHMEM device code);
        NVSHMEM is told again before the module is unloaded."""
        if digest in self._nvshmem:
            return
        nvshmem.init_module(self.module(digest), digest)
        self._nvshmem.append(digest)

    def load(self, digest: str, data: bytes) -> None:
        if digest in self._modules:
            return
        # The driver may read the image after the call returns for lazily loaded kernels: the
        # bytes object (immutable, so its buffer never moves) is kept with the module. Passing its
        # own buffer saves copying ~120 MB of images per LOAD.
        data = bytes(data)  # a no-op for bytes; a copy only for other buffer types
        module = call(cu().cuModuleLoadData, _native.bytes_address(data))
        self._modules[digest] = (module, data)

    def function(self, digest: str, name: str, attrs: dict[str, int]):
        key = (digest, name)
        func = self._functions.get(key)
        if func is not None:
            return func
        module, _ = self._modules[digest]
        try:
            func = call(cu().cuModuleGetFunction, module, name.encode())
        except RuntimeError as e:
            raise ModuleError(f"kernel {name} not found in module {digest[:12]}: {e}") from None
        call(cu().cuFuncLoad, func)
        for attr_name, value in attrs.items():
            attr = cu().CUfunction_attribute(SETTABLE_FUNC_ATTRIBUTES[attr_name])
            if int(call(cu().cuFuncGetAttribute, attr, func)) != value:
                try:
                    call(cu().cuFuncSetAttribute, func, attr, value)
                except RuntimeError as e:
                    raise ModuleError(f"kernel {name}: cannot set {attr_name}={value}: {e}") from None
        self._functions[key] = func
        return func

    def unload(self) -> None:
        if self._nvshmem:
            for digest in self._nvshmem:
                nvshmem.finalize_module(self.module(digest), digest)
            self._nvshmem.clear()
        for module, _buf in self._modules.values():
            call(cu().cuModuleUnload, module)
        self._modules.clear()
        self._functions.clear()
