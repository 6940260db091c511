"""FGB1, the compact binary encoding SAVE stores each graph description in (native/graphbuild.h,
docs/archive-format.md).

:func:`encode` and :func:`decode` convert a description (graphs.py) to and from FGB1 losslessly;
:func:`validate_encoding` checks an encoding with the native validator (native/graphbuild.c), and
:func:`read_description` reads a graph entry of an archive in either stored form (JSON or FGB1).
"""

from __future__ import annotations

import ctypes
import struct

from . import _native
from .graphs import (
    MEMORYTYPE_DEVICE,
    MEMORYTYPE_UNIFIED,
    NODE_ATTRIBUTES,
    GraphError,
    _b64,
    _param_total,
    param_bytes,
)

FGB_MAGIC = b"FGB1"
FGB_VERSION = 1
ENCODING = "fgb1"  # the value of a graph entry's "encoding" in archive meta
_NODE_CODES = {
    "kernel": 1,
    "memset": 2,
    "memcpy": 3,
    "event_record": 4,
    "event_wait": 5,
    "empty": 6,
    "graph": 7,
}
_NODE_NAMES = {code: name for name, code in _NODE_CODES.items()}
_ATTR_IDS = {key: attr_id for key, (attr_id, _field) in NODE_ATTRIBUTES.items()}
_ATTR_KEYS = {attr_id: key for key, attr_id in _ATTR_IDS.items()}
_SIGNED_ATTRS = {"cooperative", "cluster_scheduling", "priority", "mem_sync_domain"}  # C int members
_HEADER = struct.Struct("<4s5I")
_KERNEL_ENTRY = struct.Struct("<4I")
_LAYOUT_ENTRY = struct.Struct("<2I")
_SECTION = struct.Struct("<2I")
_NODE_HEADER = struct.Struct("<BBH")
_KERNEL_FIXED = struct.Struct("<8I")
_ATTR = struct.Struct("<4I")
_MEMSET = struct.Struct("<QQIIQQ")
_MEMCPY = struct.Struct("<II15Q")
_U32 = struct.Struct("<I")
_EDGE = struct.Struct("<IIBBBB")
_MAX_PARAM_BYTES = 65536


class EncodingError(GraphError):
    """A graph description cannot be encoded, or an encoding is malformed."""


def kernel_ids(kernels: list) -> dict[tuple[str, str], int]:
    """(image, name) -> function index, from archive meta's ``kernels`` list ([image, name, attrs] rows)."""
    return {(row[0], row[1]): i for i, row in enumerate(kernels)}


def _u32(value: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value < 1 << 32:
        raise EncodingError(f"{what} = {value!r} does not fit 32 bits")
    return value


def _u64(value: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise EncodingError(f"{what} = {value!r} does not fit 64 bits")
    return value


def _attr_words(key: str, raw, where: str) -> tuple[int, int, int]:
    if key in ("cluster_dim", "preferred_cluster_dim", "mem_sync_domain_map"):
        values = list(raw) + [0] * (3 - len(raw))
        limit = 1 << 8 if key == "mem_sync_domain_map" else 1 << 32
        if len(raw) != (2 if key == "mem_sync_domain_map" else 3) or any(
            not isinstance(v, int) or not 0 <= v < limit for v in values
        ):
            raise EncodingError(f"{where}: attribute {key} = {raw!r} is malformed")
        return values[0], values[1], values[2]
    if not isinstance(raw, int) or not -(1 << 31) <= raw < 1 << 32:
        raise EncodingError(f"{where}: attribute {key} = {raw!r} does not fit 32 bits")
    return raw & 0xFFFFFFFF, 0, 0


def encode(desc: dict, ids: dict[tuple[str, str], int]) -> bytes:
    """The FGB1 encoding of a graph description (``serialize``'s output; ``rng`` is not part of it).

    ``ids`` maps (image, name) to the function index the encoding refers to (:func:`kernel_ids`).
    """
    entries: dict[tuple, int] = {}
    # id(layout list) -> (that list, checked layout, parameter bytes): serialize gives every node of
    # a function the same list, so each is checked once (the list is held, so its id stays its own).
    layouts: dict[int, tuple] = {}
    kernel_rows: list[bytes] = []
    layout_rows: list[bytes] = []
    n_layout = 0
    n_events = desc.get("events", 0)
    order = [desc]  # graph index -> description; children get the next index when first met
    sections: list[bytes] = []
    g = 0
    while g < len(order):
        graph = order[g]
        out = bytearray()
        nodes, edges = graph["nodes"], graph["edges"]
        out += _SECTION.pack(len(nodes), len(edges))
        for i, node in enumerate(nodes):
            where = f"graph {g} node {i}"
            kind = node.get("type")
            code = _NODE_CODES.get(kind)
            if code is None:
                raise EncodingError(f"{where}: unknown node type {kind!r}")
            if kind == "kernel":
                ref = ids.get((node["image"], node["name"]))
                if ref is None:
                    raise EncodingError(f"{where}: kernel {node['name']} is not in the archive's kernel list")
                checked = layouts.get(id(node["layout"]))
                if checked is None or checked[0] is not node["layout"]:
                    layout = tuple((_u32(o, "offset"), _u32(n, "size")) for o, n in node["layout"])
                    total = _param_total(layout)
                    if total > _MAX_PARAM_BYTES:
                        raise EncodingError(f"{where}: {total} parameter bytes")
                    checked = layouts[id(node["layout"])] = (node["layout"], layout, total)
                _, layout, total = checked
                key = (ref, layout)
                entry = entries.get(key)
                if entry is None:
                    entry = entries[key] = len(kernel_rows)
                    kernel_rows.append(_KERNEL_ENTRY.pack(ref, n_layout, len(layout), total))
                    layout_rows += [_LAYOUT_ENTRY.pack(o, n) for o, n in layout]
                    n_layout += len(layout)
                params = param_bytes(node["params"])
                if len(params) != total:
                    raise EncodingError(f"{where}: {len(params)} parameter bytes, the layout needs {total}")
                attrs = sorted(node.get("attrs", {}).items(), key=lambda kv: _ATTR_IDS.get(kv[0], -1))
                if len(attrs) > 16:
                    raise EncodingError(f"{where}: {len(attrs)} launch attributes")
                out += _NODE_HEADER.pack(code, len(attrs), 0)
                grid, block = node["grid"], node["block"]
                if len(grid) != 3 or len(block) != 3:
                    raise EncodingError(f"{where}: grid and block need 3 dimensions")
                try:  # one pack checks the seven words; the checks below only name a bad one
                    out += _KERNEL_FIXED.pack(entry, *grid, *block, node["smem"])
                except struct.error:
                    for v in grid:
                        _u32(v, f"{where} grid")
                    for v in block:
                        _u32(v, f"{where} block")
                    _u32(node["smem"], f"{where} smem")
                    raise EncodingError(f"{where}: grid, block or smem is not a 32-bit word") from None
                for akey, raw in attrs:
                    if akey not in _ATTR_IDS:
                        raise EncodingError(f"{where}: unknown launch attribute {akey!r}")
                    out += _ATTR.pack(_ATTR_IDS[akey], *_attr_words(akey, raw, where))
                out += params
                continue
            out += _NODE_HEADER.pack(code, 0, 0)
            if kind == "memset":
                out += _MEMSET.pack(
                    _u64(node["dst"], "dst"),
                    _u64(node["pitch"], "pitch"),
                    _u32(node["value"], "value"),
                    _u32(node["element_size"], "element_size"),
                    _u64(node["width"], "width"),
                    _u64(node["height"], "height"),
                )
            elif kind == "memcpy":
                kinds = node["kinds"]
                if len(kinds) != 2 or any(k not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED) for k in kinds):
                    raise EncodingError(f"{where}: memcpy memory types {kinds!r}")
                words = [
                    node["src"],
                    node["dst"],
                    *node["src_xy"],
                    *node["dst_xy"],
                    *node["src_pitch"],
                    *node["dst_pitch"],
                    *node["extent"],
                ]
                if len(words) != 15:
                    raise EncodingError(f"{where}: memcpy description is malformed")
                out += _MEMCPY.pack(*kinds, *(_u64(w, f"{where} memcpy field") for w in words))
            elif kind in ("event_record", "event_wait"):
                slot = _u32(node["event"], f"{where} event")
                if slot >= n_events:
                    raise EncodingError(f"{where}: event slot {slot} of {n_events}")
                out += _U32.pack(slot)
            elif kind == "graph":
                out += _U32.pack(len(order))
                order.append(node["graph"])
        for e, edge in enumerate(edges):
            a, b, from_port, to_port, dep_type = edge
            if not (0 <= a < len(nodes) and 0 <= b < len(nodes)):
                raise EncodingError(f"graph {g} edge {e}: {a} -> {b}, the graph has {len(nodes)} nodes")
            for v in (from_port, to_port, dep_type):
                if not 0 <= v < 256:
                    raise EncodingError(f"graph {g} edge {e}: edge data {edge[2:]!r} does not fit a byte")
            out += _EDGE.pack(a, b, from_port, to_port, dep_type, 0)
        sections.append(bytes(out))
        g += 1
    header = _HEADER.pack(FGB_MAGIC, FGB_VERSION, len(order), n_events, len(kernel_rows), n_layout)
    return b"".join([header, *kernel_rows, *layout_rows, *sections])


def decode(data: bytes, kernels: list) -> dict:
    """The graph description an FGB1 encoding holds (``kernels``: archive meta's list)."""
    try:
        return _decode(memoryview(data), kernels)
    except struct.error as e:
        raise EncodingError(f"graph encoding is truncated or malformed ({e})") from None


def _decode(data: memoryview, kernels: list) -> dict:
    magic, version, n_graphs, n_events, n_kernels, n_layout = _HEADER.unpack_from(data, 0)
    if magic != FGB_MAGIC:
        raise EncodingError("not a Foundry graph encoding (no FGB1 magic)")
    if version != FGB_VERSION:
        raise EncodingError(f"graph encoding version {version} is not supported (this Foundry reads 1)")
    if not 1 <= n_graphs <= 4096:
        raise EncodingError(f"graph encoding declares {n_graphs} graphs")
    pos = _HEADER.size
    if n_kernels * 16 + n_layout * 8 > len(data) - pos:
        raise EncodingError("graph encoding truncated in its kernel table")
    entries = [_KERNEL_ENTRY.unpack_from(data, pos + 16 * k) for k in range(n_kernels)]
    pos += 16 * n_kernels
    layout_pool = [_LAYOUT_ENTRY.unpack_from(data, pos + 8 * j) for j in range(n_layout)]
    pos += 8 * n_layout
    tables = []
    for k, (ref, first, n, total) in enumerate(entries):
        if ref >= len(kernels) or first + n > n_layout:
            raise EncodingError(f"kernel entry {k} refers outside the kernel list or layout")
        layout = [list(pair) for pair in layout_pool[first : first + n]]
        if _param_total(layout) != total:
            raise EncodingError(f"kernel entry {k}: parameter layout and size disagree")
        tables.append((kernels[ref][0], kernels[ref][1], layout, total))
    graphs: list[dict] = [{} for _ in range(n_graphs)]
    referenced = [False] * n_graphs
    for g in range(n_graphs):
        if g and not referenced[g]:
            raise EncodingError(f"graph {g} is not referenced by any child-graph node before it")
        n_nodes, n_edges = _SECTION.unpack_from(data, pos)
        pos += _SECTION.size
        nodes = []
        for i in range(n_nodes):
            code, n_attrs, reserved = _NODE_HEADER.unpack_from(data, pos)
            pos += _NODE_HEADER.size
            kind = _NODE_NAMES.get(code)
            where = f"graph {g} node {i}"
            if kind is None or reserved or (n_attrs and kind != "kernel"):
                raise EncodingError(f"{where}: malformed node header")
            if kind == "kernel":
                entry, gx, gy, gz, bx, by, bz, smem = _KERNEL_FIXED.unpack_from(data, pos)
                pos += _KERNEL_FIXED.size
                if entry >= n_kernels:
                    raise EncodingError(f"{where}: kernel entry {entry} of {n_kernels}")
                attrs = {}
                for _ in range(n_attrs):
                    attr_id, v0, v1, v2 = _ATTR.unpack_from(data, pos)
                    pos += _ATTR.size
                    key = _ATTR_KEYS.get(attr_id)
                    if key is None:
                        raise EncodingError(f"{where}: unknown launch attribute id {attr_id}")
                    if key in ("cluster_dim", "preferred_cluster_dim"):
                        attrs[key] = [v0, v1, v2]
                    elif key == "mem_sync_domain_map":
                        attrs[key] = [v0, v1]
                    else:
                        attrs[key] = v0 - (1 << 32) if key in _SIGNED_ATTRS and v0 >= 1 << 31 else v0
                image, name, layout, total = tables[entry]
                if pos + total > len(data):
                    raise EncodingError(f"{where}: truncated parameters")
                params = bytes(data[pos : pos + total])
                pos += total
                nodes.append(
                    {
                        "type": "kernel",
                        "image": image,
                        "name": name,
                        "grid": [gx, gy, gz],
                        "block": [bx, by, bz],
                        "smem": smem,
                        "layout": [list(p) for p in layout],
                        "params": _b64(params),
                        "attrs": attrs,
                    }
                )
            elif kind == "memset":
                dst, pitch, value, element_size, width, height = _MEMSET.unpack_from(data, pos)
                pos += _MEMSET.size
                nodes.append(
                    {
                        "type": "memset",
                        "dst": dst,
                        "pitch": pitch,
                        "value": value,
                        "element_size": element_size,
                        "width": width,
                        "height": height,
                    }
                )
            elif kind == "memcpy":
                k0, k1, *w = _MEMCPY.unpack_from(data, pos)
                pos += _MEMCPY.size
                if any(k not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED) for k in (k0, k1)):
                    raise EncodingError(f"{where}: memcpy memory types {(k0, k1)}")
                nodes.append(
                    {
                        "type": "memcpy",
                        "src": w[0],
                        "dst": w[1],
                        "src_xy": w[2:5],
                        "dst_xy": w[5:8],
                        "src_pitch": w[8:10],
                        "dst_pitch": w[10:12],
                        "extent": w[12:15],
                        "kinds": [k0, k1],
                    }
                )
            elif kind in ("event_record", "event_wait"):
                (slot,) = _U32.unpack_from(data, pos)
                pos += 4
                if slot >= n_events:
                    raise EncodingError(f"{where}: event slot {slot} of {n_events}")
                nodes.append({"type": kind, "event": slot})
            elif kind == "empty":
                nodes.append({"type": "empty"})
            else:
                (child,) = _U32.unpack_from(data, pos)
                pos += 4
                if not g < child < n_graphs or referenced[child]:
                    raise EncodingError(f"{where}: bad child graph reference {child}")
                referenced[child] = True
                nodes.append({"type": "graph", "graph": graphs[child]})
        edges = []
        for e in range(n_edges):
            a, b, from_port, to_port, dep_type, pad = _EDGE.unpack_from(data, pos)
            pos += _EDGE.size
            if a >= n_nodes or b >= n_nodes or pad:
                raise EncodingError(f"graph {g} edge {e}: {a} -> {b} is malformed")
            edges.append([a, b, from_port, to_port, dep_type])
        graphs[g]["nodes"] = nodes
        graphs[g]["edges"] = edges
    if pos != len(data):
        raise EncodingError(f"graph encoding has {len(data) - pos} bytes after its last graph")
    top = graphs[0]
    top["events"] = n_events
    return top


def encoded_events(data: bytes) -> int:
    return _HEADER.unpack_from(data, 0)[3]


def validate_encoding(data: bytes, n_funcs: int, n_events: int | None = None) -> dict:
    """Check an encoding with the native validator; returns its counts. Raises :class:`EncodingError`."""
    so = _native.graph_lib()
    if so is None:
        raise EncodingError("the native library has no graph builder (rebuild it)")
    counts = (ctypes.c_uint64 * 5)()
    err = ctypes.create_string_buffer(512)
    buf = ctypes.c_char_p(data)
    rc = so.foundry_graph_validate(
        ctypes.cast(buf, ctypes.c_void_p),
        len(data),
        n_funcs,
        (1 << 32) if n_events is None else n_events,
        counts,
        err,
        len(err),
    )
    if rc != 0:
        raise EncodingError(err.value.decode(errors="replace"))
    return dict(zip(("graphs", "nodes", "edges", "kernels", "events"), (int(c) for c in counts)))


def read_description(archive, entry: dict) -> dict:
    """The description of graph ``entry`` (a row of archive meta's ``graphs``), in either stored form."""
    encoding = entry.get("encoding")
    if encoding is None:
        return archive.read_json(entry["file"])
    if encoding != ENCODING:
        raise EncodingError(f"graph {entry.get('name')!r} is stored in encoding {encoding!r}, unknown here")
    desc = decode(archive.read_bytes(entry["file"]), archive.meta.get("kernels", []))
    desc["rng"] = entry.get("rng_state")
    return desc
