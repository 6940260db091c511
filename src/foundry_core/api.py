"""save / prepare / load / verify: the public entry points (a LOAD: api -> restore -> rebuilding, tail).

SAVE (in the process that captured)::

    foundry_core.start_recording()                 # before the model's kernels first run
    region = foundry_core.Region(base, size, device)
    with region.routing():
        model, static inputs, ...                  # built the same way at LOAD
    region.end_setup()                             # what follows, a LOAD does not repeat
    with region.routing():
        model(inp)                                 # warmup
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, pool=region.graph_pool_id()):
            out = model(inp)
    foundry_core.save(path, graphs={"bs8": g}, tensors={"bs8.out": out}, region=region)

LOAD (in a fresh process)::

    region = foundry_core.Region(base, size, device)
    with region.routing():
        model, static inputs, ...                  # same allocations, same order
    restored = foundry_core.load(path, region=region)
    restored.graphs["bs8"].replay(); restored.tensors["bs8.out"]
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from collections.abc import Sequence

from . import __version__, module_globals, nvshmem
from .archive import (
    ANY_VERSION,
    Archive,
    ArchiveError,
    ArchiveWriter,
    compare_fingerprint,
    open_archive,
    require_version,
)
from .driver import call, cu
from .errors import FoundryError
from .fingerprint import current_fingerprint
from .graph_build import check_rebuilds
from .graph_codec import ENCODING, encode, kernel_ids
from .graphs import (
    GraphError,
    Segments,
    WalkMemo,
    block_auditor,
    count_nodes,
    json_form,
    kernel_names,
    kernel_nodes,
    param_bytes,
    serialize,
)
from .modules import ModuleError, Recorded, recording
from .progress import progress_bar
from .rebuilding import finish_rebuild, rebuild_archive
from .region import Region, RegionError, Segment, restore_snapshot, snapshot
from .restore import Prepared, drop, take_whole
from .restored import Restored, RestoredGraph, tensor_at
from .switches import switched_on
from .symmetric import SymmetricBuffer, require_idle
from .symmetric import check as check_symmetric
from .symmetric import ranges as symmetric_ranges
from .trust import check_location, warn_if_world_writable

ARCHIVE_KIND = "foundry-graphs"


class SaveError(FoundryError, RuntimeError):
    """SAVE refused: the captured state cannot be restored faithfully; nothing was written."""


def _torch():
    import torch

    return torch


def _read_words(addrs: list[int]) -> list[int]:
    word = ctypes.c_int64()
    values = []
    for addr in addrs:
        call(cu().cuMemcpyDtoH, ctypes.addressof(word), addr, 8)
        values.append(word.value)
    return values


def _rng_candidates(desc: dict, pointers: set[int]) -> list[int]:
    """The region words that the graph's random-number kernels (by name, child graphs included)
    carry in their parameter blocks: where torch's Philox state points (its seed and offset
    pointers sit at 8-byte-aligned offsets of the block). A handful, where the graph's region
    pointers number in the thousands, each read back with a driver call per replay."""
    words: set[int] = set()
    for node in kernel_nodes(desc):
        if _RANDOM_KERNEL.search(node["name"]):
            block = param_bytes(node["params"])
            words.update(int.from_bytes(block[i : i + 8], "little") for i in range(0, len(block) - 7, 8))
    return sorted(w for w in words & pointers if w % 8 == 0)


def _find_rng_state(graph, desc: dict, pointers: set[int], device: int) -> dict | None:
    """Where a graph that draws Philox random numbers reads its seed and base offset.

    Inside a captured graph, torch's Philox kernels read the seed and offset from two device words
    that each replay fills from the generator, which then advances by the graph's increment. We
    find the increment from the generator, and the two words by replaying with two distinct
    (seed, offset) pairs and keeping the only pointers whose targets followed both: first among
    the words the random-number kernels carry (:func:`_rng_candidates`), then, where those do not
    give exactly one of each (a random kernel with another name), among all the graph's pointers.
    """
    torch = _torch()
    gen = torch.cuda.default_generators[device]
    state = gen.get_state()
    try:
        before = gen.get_offset()
        graph.replay()
        torch.cuda.synchronize(device)
        increment = gen.get_offset() - before
        if increment == 0:
            return None
        first = _rng_candidates(desc, pointers)
        everything = sorted(p for p in pointers if p % 8 == 0)
        rounds = [first] if first else []  # no replays for an empty round
        if everything != first:
            rounds.append(everything)
        seed_ptrs: set[int] = set()
        offset_ptrs: set[int] = set()
        for candidates in rounds:
            seed_ptrs, offset_ptrs = _follow_rng_words(graph, gen, candidates, device)
            if len(seed_ptrs) == 1 and len(offset_ptrs) == 1:
                return {"increment": increment, "seed_ptr": seed_ptrs.pop(), "offset_ptr": offset_ptrs.pop()}
        raise SaveError(
            f"graph draws Philox random numbers (offset +{increment} per replay) but its seed/offset "
            f"words were not identified ({len(seed_ptrs)} seed and {len(offset_ptrs)} offset candidates)"
        )
    finally:
        gen.set_state(state)


def _follow_rng_words(graph, gen, candidates: list[int], device: int) -> tuple[set[int], set[int]]:
    """The words among ``candidates`` that held the generator's seed, and its offset, after each of
    two replays with distinct (seed, offset) pairs."""
    seed_ptrs: set[int] | None = None
    offset_ptrs: set[int] | None = None
    for seed, offset in ((0x5EED_F00D_0001, 4096 * 7), (0x0DDB_A11_0042, 4096 * 13)):
        gen.manual_seed(seed)
        gen.set_offset(offset)
        graph.replay()
        _torch().cuda.synchronize(device)
        values = _read_words(candidates)
        s = {p for p, v in zip(candidates, values) if v == seed}
        o = {p for p, v in zip(candidates, values) if v == offset}
        seed_ptrs = s if seed_ptrs is None else seed_ptrs & s
        offset_ptrs = o if offset_ptrs is None else offset_ptrs & o
    return seed_ptrs, offset_ptrs


# Kernels that draw from torch's Philox generator: distributions, dropout, multinomial, randperm,
# bernoulli, and Inductor's fused rand/randn kernels. A graph holding one needs its RNG state found.
_RANDOM_KERNEL = re.compile(
    r"philox|curand|distribution_elementwise|dropout|multinomial|randperm|bernoulli|_rand(n|int)?_", re.I
)


def _refuse_random_kernels(desc: dict) -> None:
    for name in kernel_names(desc):
        found = _RANDOM_KERNEL.search(name)
        if found:
            raise SaveError(
                f"kernel {name[:120]} looks like a random-number kernel ({found.group(0)!r}) but RNG "
                "detection is off (detect_rng=False): this graph cannot be saved without it"
            )


def _tensor_record(t) -> dict:
    return {
        "addr": int(t.data_ptr()),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype).replace("torch.", ""),
    }


def save(
    path: str | os.PathLike,
    *,
    graphs: dict,
    region: Region,
    tensors: dict | None = None,
    fingerprint_model: dict | None = None,
    slots: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool | None = None,
    lock_timeout: float = 0.0,
    detect_rng: bool = True,
    timings: dict | None = None,
    symmetric: Sequence[SymmetricBuffer] = (),
    expected_version: object = ANY_VERSION,
) -> str:
    """Persist ``graphs`` (name -> ``torch.cuda.CUDAGraph(keep_graph=True)``) with their device context.

    ``tensors`` names outputs (and inputs) to hand back at LOAD. ``fingerprint_model`` holds what
    about the model/engine setup changes the graphs (shapes, dtypes, capture sizes...); LOAD
    refuses an archive whose fingerprint differs. ``slots`` is free-form JSON an engine needs back
    (e.g. memory-pool sizing). Returns the archive digest. On any refusal nothing is written.

    Each graph is replayed once (three times if it draws random numbers, five if none of its
    random-number kernels carries the RNG state words) to find its RNG state, so
    whatever its kernels write, the KV cache included, is written then. ``detect_rng=False`` is for
    engines whose graphs sample outside the graph and whose buffers make a replay at this point
    unsafe (SGLang, vLLM): nothing is replayed, and a graph holding a kernel that looks like a
    random-number kernel is refused instead.

    ``timings``: a dict to fill with where the SAVE's time went (seconds): walk_s (reading the
    graphs back from the driver, with the RNG search; of it recorded_s indexing the recorded code
    images and rng_s the RNG search), snapshot_s (copying eager memory), encode_s,
    check_s (every graph built once from what the archive will hold, as LOAD builds it, and thrown
    away: a graph the driver would refuse at LOAD fails the SAVE instead; FOUNDRY_SAVE_CHECK=0 skips
    it), write_s (compression, files, fsync and publishing).

    ``symmetric``: the torch symmetric-memory buffers the graphs address (tensor-parallel
    all-reduce), each recorded with :meth:`SymmetricBuffer.of` after its rendezvous. Pointers into
    them pass the audit; they are stored, and LOAD refuses unless the same buffers are mapped at the
    same addresses (symmetric.py).

    ``expected_version``: publish only over the archive that was at ``path`` when the caller
    decided to SAVE (``foundry_core.archive.published_version(path)`` then; None for none). If
    another process published there since, :class:`~foundry_core.archive.ArchiveSuperseded` is
    raised and nothing is written; the check is made again under the archive's lock, right before
    writing, so of two replicas saving at the same moment exactly one publishes.
    """
    torch = _torch()
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    require_version(path, expected_version)  # early, to skip the walk; final under the lock
    if not recording():
        raise SaveError("module recording is off: call foundry_core.start_recording() before the model runs")
    if not graphs:
        raise SaveError("nothing to save: no graphs given")
    if region.setup_segments is None:
        raise SaveError(
            "call region.end_setup() after building the model and static buffers, before warmup/capture"
        )
    try:  # NVSHMEM's heap, where this process placed it: LOAD must place it at the same base
        heap = nvshmem.heap_record()
    except nvshmem.HeapPlacementError as e:
        raise SaveError(f"not saved: {e}") from None
    tensors = tensors or {}
    torch.cuda.synchronize(region.device)
    fingerprint = current_fingerprint(
        region.device, model=fingerprint_model or {}, rank=rank, world_size=world_size
    )
    recorded = Recorded()
    timings["recorded_s"] = time.perf_counter() - t0  # the recorded code images, hashed and indexed
    rng_s = 0.0
    seg_list = region.segments()
    try:
        outside = symmetric_ranges(symmetric)
    except ValueError as e:
        raise SaveError(str(e)) from None
    live = [(s.addr, s.size) for s in seg_list if s.live]
    segments = Segments(region.base, region.size, live, outside)
    kernels: dict = {}
    memo = WalkMemo()  # what the walk learns once, shared by the graphs
    walked = []
    try:
        with progress_bar("foundry: walking graphs", len(graphs), progress) as bar:
            for name, graph in graphs.items():
                try:
                    raw = graph.raw_cuda_graph()
                except RuntimeError as e:
                    raise SaveError(
                        f"graph {name!r}: capture it with torch.cuda.CUDAGraph(keep_graph=True) ({e})"
                    ) from None
                desc, pointers = serialize(cu().CUgraph(init_value=raw), recorded, segments, kernels, memo)
                if detect_rng:
                    t_rng = time.perf_counter()
                    desc["rng"] = _find_rng_state(graph, desc, pointers, region.device)
                    rng_s += time.perf_counter() - t_rng
                else:
                    _refuse_random_kernels(desc)
                    desc["rng"] = None
                walked.append((name, desc))
                bar.update()
    except (GraphError, ModuleError) as e:
        raise SaveError(f"graph {name!r}: {e}") from None
    for tname, t in tensors.items():
        if not t.is_cuda or not region.contains(int(t.data_ptr())) or not segments.live(int(t.data_ptr())):
            raise SaveError(f"tensor {tname!r} is not in a live Foundry region allocation")
    images = sorted({image for image, _ in kernels})
    t1 = time.perf_counter()
    timings["walk_s"] = t1 - t0
    timings["rng_s"] = rng_s  # of walk_s: replays that find each graph's RNG state
    snapshots = [(seg, *snapshot(seg, ranges)) for seg, ranges in region.snapshot_candidates()]
    t2 = time.perf_counter()
    timings["snapshot_s"] = t2 - t1
    # The code images' variables as the engine's kernels left them (module_globals.py): after the
    # RNG search's replays, as the memory snapshot is.
    torch.cuda.synchronize(region.device)
    launched = {}
    for func, info in memo.functions.items():
        if info.image is not None:
            launched.setdefault(info.image, cu().CUfunction(init_value=func))
    try:
        variables = module_globals.record(
            {d: recorded.images[d].data for d in images}, launched, block_auditor(segments, memo)
        )
    except GraphError as e:
        raise SaveError(f"not saved: {e}") from None
    timings["variables_s"], t2 = time.perf_counter() - t2, time.perf_counter()
    meta = {
        "kind": ARCHIVE_KIND,
        "device": region.device,
        "layout": region.layout(),
        "graphs": [],
        "kernels": [[image, name, attrs] for (image, name), attrs in sorted(kernels.items())],
        "images": images,
        "tensors": {k: _tensor_record(t) for k, t in tensors.items()},
        "slots": slots or {},
        "snapshots": [[seg.index, chunks] for seg, chunks, _ in snapshots],
        "saved_with": __version__,
        "collectives": _collective_totals(desc for _name, desc in walked),
        **variables.to_meta(),
    }
    if symmetric:
        meta["symmetric"] = [b.to_json() for b in symmetric]
    if heap:
        meta["nvshmem_heap"] = heap
    # Graphs are stored in the FGB1 binary encoding (FOUNDRY_GRAPH_ENCODING=json keeps the JSON form).
    as_json = os.environ.get("FOUNDRY_GRAPH_ENCODING", ENCODING).strip().lower() == "json"
    ids = kernel_ids(meta["kernels"])
    blobs = []
    for name, desc in walked:
        try:
            blobs.append(None if as_json else encode({k: v for k, v in desc.items() if k != "rng"}, ids))
        except GraphError as e:
            raise SaveError(f"graph {name!r}: {e}") from None
    t3 = time.perf_counter()
    timings["encode_s"] = t3 - t2
    if switched_on("FOUNDRY_SAVE_CHECK"):
        try:
            check_rebuilds({d: recorded.images[d].data for d in images}, meta["kernels"], walked, blobs)
        except (GraphError, ModuleError) as e:
            raise SaveError(f"not saved: {e}") from None
        t4 = time.perf_counter()
        timings["check_s"], t3 = t4 - t3, t4
    # Code images, memory snapshots and graph encodings are stored compressed (190 MiB -> 24 MiB in
    # the bench, for up to 0.2 s of inflation per LOAD); FOUNDRY_ARCHIVE_COMPRESS=0 stores them as they are.
    compress = switched_on("FOUNDRY_ARCHIVE_COMPRESS")
    with ArchiveWriter(path, lock_timeout=lock_timeout, expected_version=expected_version) as writer:
        with progress_bar("foundry: writing archive", len(images) + len(walked), progress) as bar:
            for digest in images:
                writer.add_bytes(f"modules/{digest}.cubin", recorded.images[digest].data, compress=compress)
                bar.update()
            for seg, _chunks, data in snapshots:
                writer.add_bytes(f"memory/{seg.index:05d}.bin", data, compress=compress)
            if variables.entries:
                writer.add_bytes(module_globals.MEMBER, variables.blob)
            for i, ((name, desc), blob) in enumerate(zip(walked, blobs)):
                entry = {"name": name, "nodes": count_nodes(desc), "rng": desc["rng"] is not None}
                if desc.get("collectives"):  # what the graph communicates with (foundry inspect)
                    entry["collectives"] = desc["collectives"]
                if desc.get("symmetric_pointers"):
                    entry["symmetric_pointers"] = desc["symmetric_pointers"]
                if blob is None:
                    entry["file"] = f"graphs/{i:04d}.json"
                    writer.add_json(entry["file"], json_form(desc))
                else:
                    entry["file"] = f"graphs/{i:04d}.bin"
                    entry.update(encoding=ENCODING, rng_state=desc["rng"])
                    writer.add_bytes(entry["file"], blob, compress=compress)
                meta["graphs"].append(entry)
                bar.update()
        digest = writer.commit(fingerprint=fingerprint, meta=meta)
    timings["write_s"] = time.perf_counter() - t3
    return digest


def _collective_totals(descs) -> dict[str, int]:
    """Collective kernel nodes of every graph, per kind (graphs.py counts them; NCCL is refused)."""
    totals: dict[str, int] = {}
    for desc in descs:
        for kind, n in (desc.get("collectives") or {}).items():
            totals[kind] = totals.get(kind, 0) + n
    return dict(sorted(totals.items()))


def _require_graph_archive(archive, path) -> None:
    if archive.meta.get("kind") != ARCHIVE_KIND:
        raise ArchiveError(f"archive {path} holds {archive.meta.get('kind')!r}, not Foundry graphs")


def verify(
    path: str | os.PathLike,
    *,
    device: int = 0,
    fingerprint_model: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
    inflate: bool = True,
):
    """Check an archive against this machine without touching the GPU beyond reading its properties.

    With ``fingerprint_model=None`` the saved model facts are not compared (only the machine's).
    ``trusted_root``, when given, is checked first, as :func:`load` does: the archive must resolve
    under it. Returns the verified :class:`~foundry_core.archive.Archive`. ``inflate=False``: every
    check runs (each member's checksum covers its stored bytes), but the compressed members are left
    to inflate where first read, or on the thread that the caller starts with
    :meth:`~foundry_core.archive.Archive.inflate_ahead` once its own urgent work is done (an engine
    start: after Foundry's steps, which a background inflate would slow); :func:`load` inflates or
    waits for what is still pending.
    """
    t0 = time.perf_counter()
    if trusted_root is not None:
        check_location(path, trusted_root)
    t1 = time.perf_counter()
    archive = open_archive(path, expected_digest=expected_digest, inflate=inflate)
    t2 = time.perf_counter()
    saved_model = archive.fingerprint.get("model", {})
    expected = current_fingerprint(
        device,
        model=saved_model if fingerprint_model is None else fingerprint_model,
        rank=rank,
        world_size=world_size,
    )
    compare_fingerprint(archive.fingerprint, expected)
    _require_graph_archive(archive, path)
    _require_device(archive, path, device)
    # Beside open_archive's own steps, for start reports: the rest of the check.
    split = getattr(archive, "open_timings", None)
    if isinstance(split, dict):
        split.update(location_s=round(t1 - t0, 4), fingerprint_s=round(time.perf_counter() - t2, 4))
    return archive


def _require_device(archive, path, device: int) -> None:
    # The fingerprint compares the GPU model, not the ordinal: a replica on another GPU of the same
    # machine (SGLang's --base-gpu-id, a vLLM worker on cuda:1) would pass it, and load() would then
    # refuse only after the engine had sized its memory for a LOAD. Restoring on another ordinal has
    # never been run, so it is refused here, before any memory exists.
    saved = archive.meta.get("device")
    if saved != device:
        raise ArchiveError(
            f"archive {path} was saved on cuda:{saved}, this process restores on cuda:{device}; "
            "give each device its own archive_dir, or let each replica see its GPU as device 0 "
            "(CUDA_VISIBLE_DEVICES)"
        )


def prepare(
    path: str | os.PathLike,
    *,
    device: int = 0,
    archive: Archive | None = None,
    fingerprint_model: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
) -> Prepared:
    """Start rebuilding the archive at ``path`` (its modules and graphs) on a background thread.

    Call it once the archive is accepted and the region is reserved (the thread's own driver
    allocations, code and executable graphs, must not take the region's fixed addresses), before
    the engine's own setup; pass the result to :func:`foundry_core.load` as ``prepared=``. ``archive``:
    what :func:`~foundry_core.verify` returned for ``path``; without it the thread reads and verifies
    the archive first, as :func:`~foundry_core.verify` does with the same ``fingerprint_model``,
    ``rank``, ``world_size`` and ``expected_digest`` (give them as ``load`` will get them). The
    location under ``trusted_root`` is checked here, before the thread starts. Nothing is launched
    on the GPU.
    """
    if trusted_root is not None:
        check_location(path, trusted_root)
    if archive is not None and not isinstance(archive, Archive):
        raise ArchiveError(f"archive= takes what verify() returned, not {type(archive).__name__}")
    verify_args = {
        "fingerprint_model": fingerprint_model,
        "rank": rank,
        "world_size": world_size,
        "expected_digest": expected_digest,
        "trusted_root": trusted_root,
    }
    return Prepared(path, int(device), archive, verify_args, verify=verify)


def _check_verified(archive, path, expected: dict, expected_digest: str | None) -> None:
    """What :func:`load` checks on an archive :func:`verify` already read: same place, pinned digest,
    and this process's fingerprint (verify may have been asked with other model facts)."""
    if not isinstance(archive, Archive):
        raise ArchiveError(f"archive= takes what verify() returned, not {type(archive).__name__}")
    if os.path.realpath(archive.path) != os.path.realpath(path):
        raise ArchiveError(f"archive= was verified at {archive.path}, not at {path}")
    if expected_digest is not None and archive.digest != expected_digest.lower():
        raise ArchiveError(
            f"archive {path}: archive digest {archive.digest} does not match the pinned digest {expected_digest}"
        )
    compare_fingerprint(archive.fingerprint, expected)


def _check_symmetric(archive, path, symmetric: Sequence[SymmetricBuffer]) -> None:
    try:
        saved = [SymmetricBuffer.from_json(row) for row in archive.meta.get("symmetric", [])]
    except (TypeError, ValueError) as e:
        raise ArchiveError(
            f"archive {path}: manifest.json has a damaged symmetric-memory record: {e}"
        ) from None
    check_symmetric(saved, symmetric)
    require_idle(symmetric)


def _check_nvshmem_heap(archive, path) -> None:
    record = archive.meta.get("nvshmem_heap")
    if record is None:
        return
    if not (isinstance(record, dict) and all(isinstance(record.get(k), int) for k in ("base", "size"))):
        raise ArchiveError(f"archive {path}: manifest.json has a damaged NVSHMEM heap record: {record!r}")
    nvshmem.check_recorded(record)


def load(
    path: str | os.PathLike,
    *,
    region: Region,
    fingerprint_model: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
    expected_digest: str | None = None,
    trusted_root: str | os.PathLike | None = None,
    progress: bool | None = None,
    archive: Archive | None = None,
    upload: bool = False,
    prepared: Prepared | None = None,
    symmetric: Sequence[SymmetricBuffer] = (),
) -> Restored:
    """Rebuild the graphs of the archive at ``path`` in this process, without capture or warmup.

    Everything is verified first (location under ``trusted_root`` when given, checksums, digest
    when pinned, fingerprint, memory placement); a mismatch raises with a one-line reason before
    any kernel is launched. An archive that every user may write is loaded with a warning.

    ``archive``: what :func:`verify` returned for this ``path``. Its files were read and checked
    then and are held in memory, so they are used as they are instead of being read again; the
    fingerprint, the pinned digest and the location are still checked here.

    ``prepared``: what :func:`prepare` started for this ``path`` before the engine's setup. Its
    modules and graphs are taken instead of being rebuilt here; if its rebuild failed, they are
    rebuilt here as without it, with a warning. When it is still building graphs once the memory is
    mapped, ``load`` returns without waiting for them: the thread finishes each one as it is built,
    and the first replay of a graph not finished yet waits for that graph (``RestoredGraph.waited_s``;
    ``timings["tail_graphs"]`` counts them, ``timings["tail_s"]`` is how long the thread took after
    the hand-over). It holds the archive it was given or verified (used instead of ``archive``; if
    its verification refused the archive, the archive is read and verified here as without it).
    Every check above still runs, and a refused archive unloads what the background rebuild made.

    ``upload``: also upload each executable graph finished by the time ``load`` returns to the
    device now (cuGraphUpload). Off by default, which leaves the graphs as torch leaves a captured
    one after instantiating it: the first replay of each does the upload (about 2.5 ms for a
    1,700-node graph on an H200).

    ``symmetric``: the torch symmetric-memory buffers this process rendezvoused, as for
    :func:`save`. An archive whose graphs address symmetric memory is refused unless every buffer
    it recorded is given, mapped at the same addresses on every rank, with its signal pad clear.
    """
    torch = _torch()
    timings = {}
    t0 = time.perf_counter()
    rebuilding = tail = None
    building = None  # the prepared rebuild, still building graphs: it may finish them after we return
    if prepared is not None:
        if os.path.realpath(prepared.path) != os.path.realpath(path):
            prepared.discard()
            raise ArchiveError(f"prepared= was started for {prepared.path}, not for {path}")
        ready = prepared.done
        tail_archive = None if ready else prepared.building()
        if tail_archive is not None and all(
            e.get("encoding") == ENCODING for e in tail_archive.meta["graphs"]
        ):
            building, archive = prepared, tail_archive
            timings.update(prepared_ready=0.0, prepared_ok=1.0)
        else:
            verified, rebuilding = take_whole(prepared, timings, ready)
            archive = verified or archive
        timings["prepare_wait_s"] = time.perf_counter() - t0
    try:
        if trusted_root is not None:
            check_location(path, trusted_root)
        warn_if_world_writable(path, stop_at=trusted_root)
        expected = current_fingerprint(
            region.device, model=fingerprint_model or {}, rank=rank, world_size=world_size
        )
        if archive is None:
            archive = open_archive(path, expected_fingerprint=expected, expected_digest=expected_digest)
        else:
            _check_verified(archive, path, expected, expected_digest)
        _require_graph_archive(archive, path)
        meta = archive.meta
        if meta["device"] != region.device:
            raise RegionError(
                f"archive was saved for cuda:{meta['device']}, the region is on cuda:{region.device}"
            )
        _check_symmetric(archive, path, symmetric)
        _check_nvshmem_heap(archive, path)
        # Members left pending (verify(inflate=False)): inflated, or refused, before any mapping.
        inflate = getattr(archive, "inflate", None)
        if inflate is not None:
            t_wait = time.perf_counter()
            inflate()
            timings["inflate_wait_s"] = time.perf_counter() - t_wait
            timings["inflated_after_check_s"] = float(getattr(archive, "inflate_s", 0.0))
    except BaseException:
        drop(rebuilding, building)
        raise
    t1 = time.perf_counter()
    timings["archive_read_s"] = t1 - t0 - timings.get("prepare_wait_s", 0.0)
    try:
        mapped = region.restore_layout(meta["layout"])
    except BaseException:
        drop(rebuilding, building)
        raise
    try:
        saved = meta["layout"]["segments"]
        for index, chunks in meta["snapshots"]:
            seg = Segment.from_json(index, saved[index])
            restore_snapshot(seg, chunks, archive.read_bytes(f"memory/{index:05d}.bin"))
        t2 = time.perf_counter()
        timings["memory_s"] = t2 - t1
        upload_to = torch.cuda.current_stream(region.device).cuda_stream if upload else None
        if building is not None:
            # The memory is mapped: the thread finishes each graph as it builds it from now on, and
            # the graphs it has not built yet are waited for at their first replay, not here.
            tail = building.hand_over([e["name"] for e in meta["graphs"]], timings, upload_to)
            if tail is None:  # it ended meanwhile: take its rebuild whole
                _verified, rebuilding = take_whole(building, timings, False)
                building = None
        if tail is not None:
            graphs = {
                e["name"]: RestoredGraph(
                    e["name"],
                    tail.pending[e["name"]].rebuilt,
                    region.device,
                    e.get("rng_state"),
                    e["nodes"],
                    pending=tail.pending[e["name"]],
                )
                for e in meta["graphs"]
            }
            timings["tail_graphs"] = float(sum(g._rebuilt is None for g in graphs.values()))
            rebuilding = tail.rebuilding
        else:
            if rebuilding is None:
                rebuilding = rebuild_archive(archive, upload_to=upload_to, progress=progress)
                timings.update(rebuilding.timings)
            else:  # the thread's own times, apart: they were not spent on this path
                timings.update({f"background_{k}": v for k, v in rebuilding.timings.items()})
                # Memory nodes re-pointed, graphs the driver would not build ahead built: on this path.
                timings.update(finish_rebuild(archive, rebuilding, upload_to=upload_to, progress=progress))
            graphs = {
                name: RestoredGraph(name, rebuilt, region.device, rng, nodes)
                for name, (rebuilt, rng, nodes) in rebuilding.graphs.items()
            }
        # Before the first replay: the modules' variables as SAVE found them, NVSHMEM's state.
        timings["variables"] = float(module_globals.restore(meta, archive.read_bytes, rebuilding.modules))
        torch.cuda.synchronize(region.device)
        timings["graphs_s"] = time.perf_counter() - t2 - timings.get("modules_s", 0.0)
    except BaseException:
        drop(rebuilding, building, tail)
        region.unmap(mapped)
        raise
    tensors = {
        name: tensor_at(rec["addr"], rec["shape"], rec["stride"], rec["dtype"], region.device)
        for name, rec in meta["tensors"].items()
    }
    timings["total_s"] = time.perf_counter() - t0
    restored = Restored(archive, region, graphs, tensors, meta["slots"], mapped, rebuilding.modules, timings)
    restored._builders = rebuilding.builders
    restored._background = building
    return restored
