"""An opened graph archive's structure, checked without a GPU (``foundry verify --integrity-only``).

:func:`~foundry_core.archive.open_archive` checks what any archive must be: the manifest, and every
member's size and checksum. What makes one a Foundry graph archive that a LOAD can use is checked
here, from the verified bytes alone: the manifest's meta holds every field a LOAD reads, every code
image, memory snapshot and graph it names is there, each graph decodes, has the node count the
manifest gives, and launches only kernels of the archive's own images. Nothing is loaded or
launched, and this machine is not asked anything: that is :func:`foundry_core.verify`'s part.
"""

from __future__ import annotations

import struct

from .archive import Archive, ArchiveError
from .graph_codec import read_description
from .graphs import GraphError, count_nodes, kernel_nodes

ARCHIVE_KIND = "foundry-graphs"

# What a LOAD reads from the manifest's meta, with the type each must have.
_META_FIELDS = (
    ("device", int),
    ("layout", dict),
    ("graphs", list),
    ("kernels", list),
    ("images", list),
    ("tensors", dict),
    ("snapshots", list),
    ("slots", dict),
)
_TENSOR_FIELDS = ("addr", "shape", "stride", "dtype")


def check_structure(archive: Archive) -> None:
    """Raise :class:`ArchiveError` naming the first thing in ``archive`` a LOAD could not use."""
    meta, where = archive.meta, f"archive {archive.path}"
    if meta.get("kind") != ARCHIVE_KIND:
        raise ArchiveError(f"{where} holds {meta.get('kind')!r}, not Foundry graphs")
    for key, kind in _META_FIELDS:
        if not isinstance(meta.get(key), kind):
            raise ArchiveError(f"{where}: manifest.json has no valid {key!r} ({kind.__name__}); SAVE again")
    segments = meta["layout"].get("segments")
    if not isinstance(segments, list):
        raise ArchiveError(f"{where}: manifest.json has no valid layout segments; SAVE again")

    def member(rel: str, what: str) -> None:
        if rel not in archive.files:
            raise ArchiveError(f"{where}: {what} is named in manifest.json but {rel} is not in the archive")

    images = set(meta["images"])
    for image in meta["images"]:
        member(f"modules/{image}.cubin", f"code image {str(image)[:16]}")
    for row in meta["kernels"]:
        if not (isinstance(row, list) and len(row) == 3 and row[0] in images):
            raise ArchiveError(f"{where}: kernel row {str(row)[:120]} does not name one of its code images")
    for row in meta["snapshots"]:
        index = row[0] if isinstance(row, list) and row else None
        if not (isinstance(index, int) and 0 <= index < len(segments)):
            raise ArchiveError(f"{where}: memory snapshot {str(row)[:80]} names no segment of the layout")
        member(f"memory/{index:05d}.bin", f"the snapshot of segment {index}")
    for name, rec in meta["tensors"].items():
        if not (isinstance(rec, dict) and all(k in rec for k in _TENSOR_FIELDS)):
            raise ArchiveError(f"{where}: tensor {name!r} lacks one of {', '.join(_TENSOR_FIELDS)}")
    for entry in meta["graphs"]:
        _check_graph(archive, entry, images, where)


def _check_graph(archive: Archive, entry, images: set, where: str) -> None:
    if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "file" in entry):
        raise ArchiveError(f"{where}: graph entry {str(entry)[:120]} has no name or file")
    name = entry["name"]
    try:
        desc = read_description(archive, entry)
        nodes = count_nodes(desc)
        unknown = [n.get("image") for n in kernel_nodes(desc) if n.get("image") not in images]
    except ArchiveError:
        raise
    except (GraphError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise ArchiveError(f"{where}: graph {name!r} does not decode ({type(e).__name__}: {e})") from None
    if nodes != entry.get("nodes"):
        raise ArchiveError(
            f"{where}: graph {name!r} holds {nodes} nodes, manifest.json says {entry.get('nodes')}"
        )
    if unknown:
        raise ArchiveError(
            f"{where}: graph {name!r} launches a kernel of code image {str(unknown[0])[:16]}, not in the archive"
        )
