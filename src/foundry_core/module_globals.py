"""Module variables: the ``__device__`` and ``__constant__`` variables of the code a saved graph runs.

The driver gives every loaded module its own copy of its variables. A LOAD loads the archive's code
images as modules of its own, so the restored kernels read Foundry's copies, which hold what the image
says, not what the engine's libraries stored into theirs at run time (a table, a flag, a counter a
kernel advances, NVSHMEM's device state). SAVE therefore reads every variable of the images it
stores, in the module the engine's kernels ran from, and compares it with the same image freshly
loaded (the reference, since the driver applies relocations at load: a variable initialised with
another's address differs from the bytes in the file). The variables that differ are stored, and
LOAD writes them into its modules before the first replay. Their words are audited as a kernel's
parameters are: a variable holding a pointer to device memory outside the region is not restored
(LOAD could not make it point at the same thing), with a warning naming it, and the archive lists it
(``globals_skipped``); it is left as the image holds it, as every variable was before Foundry
recorded them. Refusing the SAVE instead would refuse every configuration whose libraries keep such
a variable, used by the saved graphs or not.

NVSHMEM's device state is not copied: it describes the process's NVSHMEM (its heap, its PEs), so
NVSHMEM sets it up in the LOAD process (:mod:`.nvshmem`); the archive names the modules that hold it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable

from . import _native, nvshmem
from .driver import CudaError, call, cu
from .graphs import GraphError
from .modules import LoadedModules, ModuleError, elf_globals

logger = logging.getLogger("foundry.modules")

MEMBER = "globals.bin"  # the archive member holding the recorded values, one after the other


@dataclasses.dataclass
class Variables:
    """What SAVE recorded of the images' variables."""

    entries: list[list]  # [image digest, variable name, offset in blob, size]
    blob: bytes
    nvshmem: list[str]  # images whose NVSHMEM device state LOAD has NVSHMEM initialise
    unread: dict[str, str]  # image digest -> why its variables could not be read (not recorded)
    skipped: list[list[str]] = dataclasses.field(default_factory=list)  # [digest, name, why] not restored

    def to_meta(self) -> dict:
        """The manifest keys (none for the usual archive, whose images hold no changed variable)."""
        meta = {}
        if self.entries:
            meta["globals"] = self.entries
        if self.nvshmem:
            meta["nvshmem_images"] = self.nvshmem
        if self.skipped:
            meta["globals_skipped"] = self.skipped
        return meta


def _read(module, name: str) -> bytes:
    dptr, size = call(cu().cuModuleGetGlobal, module, name.encode())
    buf = ctypes.create_string_buffer(int(size))
    if int(size):
        call(cu().cuMemcpyDtoH, ctypes.addressof(buf), dptr, int(size))
    return buf.raw


def _values(module, names, failed: dict[str, str]) -> dict[str, bytes]:
    """The values of ``names`` in ``module``; those the driver will not give are put in ``failed``."""
    out = {}
    for name in names:
        try:
            out[name] = _read(module, name)
        except CudaError as e:
            failed.setdefault(name, str(e))
    return out


def record(
    images: dict[str, bytes],
    functions: dict[str, object],
    audit: Callable[[bytes, Callable[[int], str]], None],
) -> Variables:
    """Read the variables of ``images`` (digest -> cubin) in the engine's modules and keep those that
    differ from a fresh load of the same image. ``functions``: a kernel of each image as the engine
    launched it (a CUfunction; its module is the engine's). ``audit(data, where)`` raises
    :class:`GraphError` for a pointer ``data`` may not hold (that variable is skipped). Call it once
    the graphs' work is done (the device synchronised). Raises :class:`GraphError` for NVSHMEM
    variables NVSHMEM could not set up at LOAD."""
    entries, chunks, offset = [], [], 0
    marked, unread, skipped = [], {}, []
    for digest, data in images.items():
        names = elf_globals(data)
        if not names:
            continue
        try:
            if nvshmem.check_image(names, digest):
                marked.append(digest)
        except ModuleError as e:
            raise GraphError(str(e)) from None
        # Not NVSHMEM's, and not the string literals the compiler emits ($str...: never written).
        names = [n for n in names if not nvshmem.owns(n) and not n.startswith("$")]
        if not names:
            continue
        func, failed = functions.get(digest), {}
        try:
            if func is None:
                raise ModuleError("no kernel of it was launched")
            live = _values(call(cu().cuFuncGetModule, func), names, failed)
            fresh = call(cu().cuModuleLoadData, _native.bytes_address(data))
            try:
                reference = _values(fresh, live, failed)
            finally:
                call(cu().cuModuleUnload, fresh)
        except (CudaError, ModuleError) as e:
            unread[digest] = str(e)
            continue
        if failed:
            name, why = next(iter(failed.items()))
            unread[digest] = f"{len(failed)} of {len(names)} variables, e.g. {name}: {why}"
        for name, value in live.items():
            if name not in reference or value == reference[name]:
                continue
            try:
                audit(
                    value, lambda off, name=name, d=digest: f"variable {name} of module {d[:12]} byte {off}"
                )
            except GraphError as e:
                skipped.append([digest, name, str(e)])
                continue
            entries.append([digest, name, offset, len(value)])
            chunks.append(value)
            offset += len(value)
    if unread:
        first = next(iter(unread.items()))
        logger.warning(
            "foundry: the variables of %d code module(s) could not be read at SAVE and are restored as "
            "their image holds them (module %s: %s)",
            len(unread),
            first[0][:12],
            first[1],
        )
    if skipped:
        logger.warning(
            "foundry: %d module variable(s) hold pointers outside the region and are restored as their "
            "image holds them (%s)",
            len(skipped),
            skipped[0][2],
        )
    return Variables(entries, b"".join(chunks), marked, unread, skipped)


def restore(meta: dict, read_member: Callable[[str], bytes], modules: LoadedModules) -> int:
    """Write the recorded variables into the modules LOAD loaded, and have NVSHMEM set up the device
    state of the modules that hold one. Before the first replay; nothing is launched. Returns how
    many variables were written."""
    entries = meta.get("globals") or []
    blob = read_member(MEMBER) if entries else b""
    for digest, name, offset, size in entries:
        value = blob[offset : offset + size]
        if len(value) != size:
            raise ModuleError(
                f"variable {name} of module {digest[:12]}: the archive holds {len(value)} bytes"
            )
        try:
            dptr, got = call(cu().cuModuleGetGlobal, modules.module(digest), name.encode())
        except CudaError as e:
            raise ModuleError(f"variable {name} of module {digest[:12]}: {e}") from None
        if int(got) != size:
            raise ModuleError(
                f"variable {name} of module {digest[:12]} is {int(got)} bytes here, {size} at SAVE"
            )
        call(cu().cuMemcpyHtoD, dptr, _native.bytes_address(value), size)
    for digest in meta.get("nvshmem_images") or []:
        modules.init_nvshmem(digest)
    return len(entries)
