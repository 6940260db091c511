"""Compile and JIT caches carried in an archive, so that a LOAD on an empty machine compiles nothing.

An engine's cold start is mostly compilation: torch.compile (Dynamo, Inductor), Triton kernels,
kernels built with nvcc at first use (tvm-ffi, FlashInfer, DeepGEMM) and PTX the driver JIT-compiles.
Each of those tools keeps its results in an on-disk cache that one environment variable relocates.

* SAVE: :meth:`CacheDirs.create` makes one private, empty directory per cache kind and
  :meth:`CacheDirs.redirect` points the engine's variables at them before anything compiles, so
  everything the SAVE process builds or uses lands there; :func:`pack` then stores those files as a
  Foundry archive of its own (checksummed members, atomic publish, fingerprinted to the GPU, driver,
  CUDA, torch, Triton and engine versions).
* LOAD: the same private directories are made and redirected first (the driver reads
  ``CUDA_CACHE_PATH`` when CUDA initialises); :func:`unpack` verifies the carried archive against this
  machine, the location rule and the pinned digest, then writes its files there. Nothing is written
  into the user's own caches. A refused or missing archive leaves the directories empty: the engine
  builds as usual, into them.

The caches archive is separate from the graph archive because the engines go on compiling after
their graphs are captured (vLLM's sampler and kernel warmups), while the graph archive is written
right after capture; the engine layer writes it before the record that marks a SAVE finished.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..archive import (
    ArchiveError,
    ArchiveWriter,
    check_relpath,
    compare_fingerprint,
    open_archive,
)
from ..trust import check_location

logger = logging.getLogger("foundry.caches")

ARCHIVE_KIND = "foundry-caches"
#: Where the private copies are made (default: the system's temporary directory). When set, they
#: are kept after the process ends, so a benchmark can count what was compiled beside them.
ROOT_ENV = "FOUNDRY_CACHE_ROOT"
#: Set by the launching process to the private root it made: the engine processes it starts (which
#: inherit the cache variables with it) use that root instead of making their own.
DIR_ENV = "FOUNDRY_CACHES_DIR"
#: Written into each private root after unpacking: the files that came from the archive.
CARRIED_LIST = ".foundry-carried.json"
#: Kinds whose tool writes some of the entries it loads again (Inductor's AOTAutograd entries and
#: autotune ``.best_config`` files, seen with vLLM 0.26): a rewrite with the same bytes there is
#: bookkeeping, not a compilation.
REWRITTEN_ON_LOAD = frozenset({"vllm", "sglang", "inductor"})


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """One tool's on-disk cache and the variables that relocate it (all set to the same folder)."""

    name: str
    envs: tuple[str, ...]
    what: str


#: Every cache kind the engine layer knows. An engine adapter names the ones its engine uses.
KINDS: dict[str, CacheKind] = {
    k.name: k
    for k in (
        CacheKind("vllm", ("VLLM_CACHE_ROOT",), "vLLM: torch.compile / AOT artifacts, autotune"),
        CacheKind("sglang", ("SGLANG_CACHE_DIR",), "SGLang: torch.compile cache, FlashInfer autotune"),
        CacheKind("inductor", ("TORCHINDUCTOR_CACHE_DIR",), "Inductor: FX graph and kernel caches"),
        CacheKind("triton", ("TRITON_CACHE_DIR",), "Triton: compiled kernels and launchers"),
        CacheKind("tvm-ffi", ("TVM_FFI_CACHE_DIR",), "tvm-ffi: kernels built with nvcc at first use"),
        # SGLang 0.5.23 builds its own JIT kernels with nvcc at first use (about 40 s on an H100 at
        # the first captured batch size); keyed by content, not by the folder, and read at each build.
        CacheKind(
            "sglang-jit", ("SGLANG_JIT_CACHE_DIR",), "SGLang: JIT kernels built with nvcc at first use"
        ),
        # FlashInfer reads its base once, at import: set it before the engine imports FlashInfer.
        CacheKind("flashinfer", ("FLASHINFER_WORKSPACE_BASE",), "FlashInfer: JIT modules"),
        # vLLM's FlashInfer autotune results (FP8 MoE and GEMM tactics). Without the variable, vLLM 0.33
        # leaves FlashInfer's managed store at FlashInfer's own default, outside every carried folder.
        CacheKind(
            "flashinfer-autotune",
            ("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",),
            "vLLM: FlashInfer autotune results (FP8 MoE, GEMM tactics)",
        ),
        # SGLang copies SGLANG_DG_CACHE_DIR over DG_JIT_CACHE_DIR when it imports its DeepGEMM wrapper.
        CacheKind("deep-gemm", ("DG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR"), "DeepGEMM: JIT kernels"),
        # vLLM's quantized-GEMM kernel library builds its launcher with ninja at first use.
        CacheKind("humming", ("HUMMING_CACHE_DIR",), "humming-kernels: launcher built at first use"),
        # The driver reads it when CUDA initialises; used only for PTX without SASS for this GPU.
        CacheKind("cuda", ("CUDA_CACHE_PATH",), "CUDA driver: PTX compiled at load"),
    )
}

#: torch.compile's profile-guided dynamic shapes (``torch._dynamo.pgo``) remember, per compiled
#: function, which input sizes turned out to vary, in a file under the Inductor cache directory; torch
#: keeps that state only under a job id, and reads the id from these variables when it is imported.
#: Without it a LOAD compiles each such function first for the one shape it meets first (a graph the
#: SAVE process never built, so no carried file has it), then again with dynamic sizes: SGLang's MoE
#: sum-reduce at the warmup prefill, seen on the H200 on 2026-12-02. With the id, the state SAVE left
#: beside the carried Inductor cache makes LOAD's first compile the dynamic one SAVE ended with. The
#: id only names state inside the archive's private folder, so one fixed value serves every archive;
#: a user's own id is kept (their LOAD then compiles as usual if it differs from their SAVE's).
PGO_JOB_ENVS = ("TORCH_COMPILE_JOB_ID", "TORCH_COMPILE_STICKY_PGO_KEY")
PGO_JOB_ID = "foundry"

# Files a cache keeps for its own bookkeeping while a process runs, and logs (FlashInfer appends
# to its flashinfer_jit.log at every import): never carried, never counted as compiled. Ninja's
# .ninja_log is build state, not a log of this kind, and is carried.
_SKIP_SUFFIXES = (".lock", ".tmp", ".pid", ".log")
# Folders of a build still in progress (SGLang's JIT publishes a build by renaming its staging folder).
_IN_PROGRESS_PREFIXES = (".staging-",)


class CacheError(ArchiveError):
    """A carried-caches archive that cannot be used here; the message is one line."""


def _private_parent() -> tuple[Path, bool]:
    """Where the private folders go, and whether they are kept at exit (:data:`ROOT_ENV` set)."""
    root = os.environ.get(ROOT_ENV)
    if root:
        return Path(root), True
    return Path(tempfile.gettempdir()), False


def _owned_private_dir(path: Path) -> bool:
    """``path`` is a real directory (not a link) of this user that nobody else can enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _hold(path: Path) -> int:
    """An open descriptor with an exclusive lock on ``path``; BlockingIOError when another process
    (or another holder in this one) has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise BlockingIOError(e.errno, f"held by another server ({path})") from None
    return fd


def sync_pgo_job_id() -> None:
    """Give an already imported torch the job id the environment now holds (or no longer holds):
    torch read the variable at its import, and a worker forked from this process keeps that value."""
    torch = sys.modules.get("torch")
    config = getattr(getattr(torch, "compiler", None), "config", None)
    if config is None or not hasattr(config, "job_id"):
        return
    wanted = os.environ.get(PGO_JOB_ENVS[0])
    if wanted == PGO_JOB_ID and config.job_id is None:
        config.job_id = PGO_JOB_ID
    elif wanted is None and config.job_id == PGO_JOB_ID:
        config.job_id = None


@dataclasses.dataclass
class CacheDirs:
    """One process's private cache directories: ``root/<kind>`` for each kind in ``kinds``."""

    root: Path
    kinds: tuple[str, ...]
    lock: int | None = None  # the descriptor holding the folder's lock (create() only)

    @classmethod
    def create(cls, kinds: Iterable[str], *, label: str) -> CacheDirs:
        """Fresh, empty, owner-only directories (removed at exit unless :data:`ROOT_ENV` is set).

        The path depends only on ``label`` (the engine layer passes a digest of the archive
        directory) and the user, so SAVE and every later LOAD on a machine use the same one:
        caches record absolute paths (FlashInfer's build files name their folder, and a path that
        changed makes its build tool compile everything again). Whatever a previous start left
        there is removed first. The folder is held with a lock while this object lives: a second
        server started on the same machine with the same archive directory, or a path another
        user could have prepared, gets a random folder instead (with a warning).
        """
        names = _known(kinds)
        parent, keep = _private_parent()
        parent.mkdir(parents=True, exist_ok=True)
        owner = parent / f"foundry-caches-{os.getuid()}"
        root = owner / label
        lock = None
        try:
            owner.mkdir(mode=0o700, exist_ok=True)
            if not _owned_private_dir(owner):
                raise PermissionError(f"{owner} is not a private folder of this user")
            lock = _hold(owner / f"{label}.lock")
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(mode=0o700)
        except OSError as e:
            if lock is not None:
                os.close(lock)
                lock = None
            logger.warning("Foundry caches: %s not usable (%s); using a random folder", root, e)
            root = Path(tempfile.mkdtemp(prefix=f"foundry-caches-{label}-", dir=parent))
        for k in names:
            (root / k).mkdir(mode=0o700)
        if not keep:
            atexit.register(shutil.rmtree, root, True)
        return cls(root, names, lock)

    def close(self) -> None:
        """Let another start use this folder (the lock is also released when the process ends)."""
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    @classmethod
    def inherited(cls, kinds: Iterable[str]) -> CacheDirs | None:
        """The directories the launching process made and redirected (:data:`DIR_ENV`), if any."""
        root = os.environ.get(DIR_ENV)
        if not root or not Path(root).is_dir():
            return None
        names = _known(kinds)
        for k in names:
            (Path(root) / k).mkdir(mode=0o700, exist_ok=True)
        return cls(Path(root), names)

    def path(self, kind: str) -> Path:
        return self.root / kind

    def environment(self) -> dict[str, str]:
        env = {name: str(self.path(k)) for k in self.kinds for name in KINDS[k].envs}
        env[DIR_ENV] = str(self.root)
        if "inductor" in self.kinds and not any(os.environ.get(n) for n in PGO_JOB_ENVS):
            env[PGO_JOB_ENVS[0]] = PGO_JOB_ID
        return env

    def redirect(self) -> None:
        """Point this process (and the processes it starts) at the private directories. Assigned,
        not defaulted: some tools write their default into the environment on first use."""
        os.environ.update(self.environment())
        sync_pgo_job_id()

    def files(self) -> dict[str, dict[str, list[int]]]:
        """kind -> {relative path: [size, mtime_ns]} of the regular files now in the directories."""
        out: dict[str, dict[str, list[int]]] = {}
        for k in self.kinds:
            base = self.path(k)
            found: dict[str, list[int]] = {}
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(_IN_PROGRESS_PREFIXES)]
                for fn in filenames:
                    full = Path(dirpath, fn)
                    if fn.endswith(_SKIP_SUFFIXES) or fn.startswith(".foundry-"):
                        continue
                    try:
                        st = full.lstat()
                    except OSError:  # removed by its tool meanwhile
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found[full.relative_to(base).as_posix()] = [st.st_size, st.st_mtime_ns]
            out[k] = found
        return out

    def new_files(self) -> dict[str, int]:
        """Per kind, the files this process wrote (new, or carried from the archive and changed
        since): what it compiled. ``total`` sums them. In the kinds whose tool rewrites entries it
        loads (:data:`REWRITTEN_ON_LOAD`), a carried file written again with the same bytes is no
        compilation; ``rewritten`` counts those apart. Elsewhere identical bytes prove nothing (a
        build tool that decided to rebuild can make the same ``.so``), so they count."""
        try:
            carried = json.loads((self.root / CARRIED_LIST).read_text())
        except (OSError, ValueError):
            carried = {}
        now = self.files()
        counts, rewritten = {}, 0
        for k in self.kinds:
            before = carried.get(k) or {}
            changed = 0
            for rel, stamp in now[k].items():
                was = before.get(rel)
                if was is None or was[:2] != stamp:
                    same = k in REWRITTEN_ON_LOAD and was is not None and len(was) > 2
                    if same and _crc(self.path(k) / rel) == was[2]:
                        rewritten += 1
                    else:
                        changed += 1
            counts[k] = changed
        counts["total"] = sum(counts.values())
        counts["rewritten"] = rewritten
        return counts


#: The distributions DeepGEMM's JIT kernels (kind ``deep-gemm``) come from: the upstream package and
#: SGLang's fork, which SGLang 0.5.23 installs as ``sgl-deep-gemm`` (module ``deep_gemm``). Carried
#: cubins are valid only for the DeepGEMM that built them, so its version is in the caches' fingerprint.
_DEEP_GEMM_DISTS = ("deep-gemm", "sgl-deep-gemm")


def _known(kinds: Iterable[str]) -> tuple[str, ...]:
    names = tuple(kinds)
    unknown = [k for k in names if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown cache kind {unknown[0]!r} (known: {', '.join(KINDS)})")
    return names


def _versions() -> dict[str, Any]:
    from ..fingerprint import package_version

    out: dict[str, Any] = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for dist in ("triton", "tokenspeed-triton", "flashinfer-python", "apache-tvm-ffi", *_DEEP_GEMM_DISTS):
        out[dist] = package_version(dist)
    return out


def fingerprint(device: int, engine: dict, *, rank: int = 0, world_size: int = 1) -> dict:
    """What carried caches are valid for: the machine (GPU, driver, CUDA, torch) as for graphs, plus
    the compiler versions and the engine facts (name, version) the caller gives."""
    from ..fingerprint import current_fingerprint

    return current_fingerprint(device, model=model_facts(engine), rank=rank, world_size=world_size)


def model_facts(engine: dict) -> dict:
    """The part of the caches' fingerprint that needs no GPU: the engine and compiler versions."""
    return {"engine": engine, "tools": _versions()}


def pack(
    path: str | os.PathLike,
    dirs: CacheDirs,
    *,
    device: int,
    engine: dict,
    rank: int = 0,
    world_size: int = 1,
    listing: dict[str, dict[str, list[int]]] | None = None,
) -> dict[str, Any]:
    """Store every file of ``dirs`` (or those of ``listing``, a :meth:`CacheDirs.files` the caller
    already took) as the caches archive at ``path``; returns its summary (``digest``, and per kind
    ``files`` and ``bytes``). Symlinks and lock files are left out."""
    fp = fingerprint(device, engine, rank=rank, world_size=world_size)
    if listing is None:
        listing = dirs.files()
    summary: dict[str, Any] = {"kinds": {}}
    modes: dict[str, int] = {}
    mtimes: dict[str, int] = {}
    with ArchiveWriter(path) as writer:
        for kind, files in listing.items():
            total = stored = 0
            for rel, _stamp in sorted(files.items()):
                src = dirs.path(kind) / rel
                member = f"caches/{kind}/{rel}"
                try:
                    check_relpath(member)
                except ArchiveError as e:  # a name no archive may hold: that file is built again
                    logger.warning("Foundry caches: %s not carried (%s)", src, e)
                    continue
                try:
                    data = src.read_bytes()
                    st = src.stat()
                except OSError as e:  # removed by its tool while we walked: not part of the cache
                    logger.debug("Foundry caches: %s skipped (%s)", src, e)
                    continue
                writer.add_bytes(member, data, compress=True)
                modes[member] = 0o755 if stat.S_IMODE(st.st_mode) & 0o100 else 0o644
                # Build tools (ninja for FlashInfer and tvm-ffi) compare output and source times.
                mtimes[member] = st.st_mtime_ns
                total += len(data)
                stored += 1
            summary["kinds"][kind] = {"files": stored, "bytes": total, "what": KINDS[kind].what}
        meta = {"kind": ARCHIVE_KIND, "kinds": summary["kinds"], "modes": modes, "mtimes": mtimes}
        summary["digest"] = writer.commit(fingerprint=fp, meta=meta)
    return summary


def unpack(
    path: str | os.PathLike,
    dirs: CacheDirs,
    *,
    device: int,
    engine: dict,
    rank: int = 0,
    world_size: int = 1,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Verify the caches archive at ``path`` against this machine and write its files into ``dirs``.

    Checks, in order, before a single file is written: the archive lies under ``trusted_root``;
    every member's checksum and the pinned digest (:func:`~foundry_core.archive.open_archive`); the
    fingerprint (GPU, driver, CUDA, torch, compiler and engine versions). Raises
    :class:`~foundry_core.archive.ArchiveError` (``ArchiveNotFound`` when nothing is there).
    Returns the summary :func:`pack` stored, with the digest.
    """
    archive = _open(path, expected_digest, trusted_root)
    compare_fingerprint(archive.fingerprint, fingerprint(device, engine, rank=rank, world_size=world_size))
    carried: dict[str, dict[str, list[int]]] = {k: {} for k in dirs.kinds}
    place = _Placer(archive)
    for kind, rel, member in _members(archive, dirs.kinds):
        carried[kind][rel] = place(member, dirs.path(kind) / rel, crc=kind in REWRITTEN_ON_LOAD)
    # What came from the archive, with size and time (and CRC where a rewrite may be bookkeeping):
    # a file changed later counts as compiled.
    (dirs.root / CARRIED_LIST).write_text(json.dumps(carried, sort_keys=True))
    return {"digest": archive.digest, "kinds": archive.meta.get("kinds") or {}}


def unpack_engine_records(
    path: str | os.PathLike,
    dirs: CacheDirs,
    wanted: dict[str, tuple[str, ...]],
    *,
    engine: dict,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
) -> int:
    """In the launching process, which must not initialise CUDA: write only the members under the
    given folders of each kind (``{"vllm": ("modelinfos/",)}``), files the engine reads before it
    starts its workers and checks itself (vLLM keys each model-inspection record by its source's
    hash). No native code is written here. Same checks as :func:`unpack` except the GPU, driver and
    CUDA ones, which the worker's :func:`unpack` makes before anything else is used. Returns the
    number of files written."""
    archive = _open(path, expected_digest, trusted_root)
    if not isinstance(archive.fingerprint, dict):
        raise CacheError(f"archive {path} has no fingerprint")
    # Only the part a launcher can know without CUDA: this machine's side of everything else is
    # taken as the archive's, and the worker compares it before the engine uses any other file.
    compare_fingerprint(archive.fingerprint, {**archive.fingerprint, "model": model_facts(engine)})
    written = 0
    place = _Placer(archive)
    for kind, rel, member in _members(archive, [k for k in wanted if k in dirs.kinds]):
        if rel.startswith(wanted[kind]):
            place(member, dirs.path(kind) / rel)
            written += 1
    return written


def _open(
    path: str | os.PathLike, expected_digest: str | None, trusted_root: str | os.PathLike | None
) -> Any:
    """The caches archive at ``path``, checked in order: under ``trusted_root``, every member's
    checksum and the pinned digest, and that it holds carried caches (not graphs)."""
    if trusted_root is not None:
        check_location(path, trusted_root)
    archive = open_archive(path, expected_digest=expected_digest)
    if archive.meta.get("kind") != ARCHIVE_KIND:
        raise CacheError(f"archive {path} holds {archive.meta.get('kind')!r}, not carried caches")
    return archive


def _members(archive: Any, kinds: Iterable[str]) -> Iterable[tuple[str, str, str]]:
    """``(kind, relative path, member)`` for each carried file of the given kinds."""
    kinds = set(kinds)
    for member in archive.files:
        parts = member.split("/", 2)
        if len(parts) == 3 and parts[0] == "caches" and parts[1] in kinds:
            yield parts[1], parts[2], member


class _Placer:
    """Writes carried files into place, each with its recorded mode and time.

    Each file costs six system calls (create, write, utime, fstat, close, rename) and each folder
    one mkdir, where tempfile.mkstemp, a Python file object, chmod/utime/stat by path and a mkdir
    per file took ten: at LOAD this runs while the graph archive inflates on every core, and each
    system call gives the GIL away and waits its turn to get it back."""

    def __init__(self, archive: Any):
        self.archive = archive
        self.modes: dict = archive.meta.get("modes") or {}
        self.mtimes: dict = archive.meta.get("mtimes") or {}
        self.made: set[Path] = set()

    def __call__(self, member: str, dest: Path, *, crc: bool = False) -> list[int]:
        """``member`` into ``dest``; returns ``[size, mtime_ns]``, with ``crc32`` appended when
        ``crc`` (it costs ~15 ms for 50 MB: only for the kinds where a rewrite with the same bytes
        is told from a rebuild, :data:`REWRITTEN_ON_LOAD`)."""
        parent = dest.parent
        if parent not in self.made:
            parent.mkdir(parents=True, exist_ok=True)
            self.made.add(parent)
        data = self.archive.read_bytes(member)
        mode = 0o700 if self.modes.get(member, 0o644) & 0o100 else 0o600
        mtime = self.mtimes.get(member)
        # Written beside and renamed into place: a tool that looks meanwhile sees all or nothing.
        fd, tmp = _create_beside(parent, mode)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if isinstance(mtime, int) and mtime > 0:
                    os.utime(fd, ns=(mtime, mtime))
                st = os.fstat(fd)  # the times as this file system keeps them; a rename keeps them
                if stat.S_IMODE(st.st_mode) != mode:  # the umask took bits off at creation
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return [st.st_size, st.st_mtime_ns, zlib.crc32(data)] if crc else [st.st_size, st.st_mtime_ns]


_TMP_SEQ = itertools.count()


def _create_beside(folder: Path, mode: int) -> tuple[int, str]:
    """A new file in ``folder`` named ``.foundry-*`` (never listed as a cache file), open for
    writing: a name from this process's id and a counter, made with O_EXCL; tempfile's random
    names where that one is taken (left by an earlier process with the same id)."""
    path = os.path.join(folder, f".foundry-{os.getpid()}-{next(_TMP_SEQ)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, mode), path
    except FileExistsError:
        return tempfile.mkstemp(prefix=".foundry-", dir=folder)


def _crc(path: Path) -> int | None:
    """CRC-32 of a file's bytes (to tell a carried file rewritten unchanged from one rebuilt)."""
    try:
        return zlib.crc32(path.read_bytes())
    except OSError:
        return None
