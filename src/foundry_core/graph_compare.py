"""A restored graph held against the description SAVE wrote of it, node for node and edge for edge.

:func:`compare` takes two plain descriptions: the archive's (decoded, graph_codec.py) and what
:func:`foundry_core.graphs.structure` read back from the driver. Apart from graphs.py, which walks
and reads graphs, because it only compares data and reads nothing from the driver.
"""

from __future__ import annotations

# structure() names node types after the driver's enum; the archive's descriptions say event_wait.
_STRUCTURE_TYPES = {"wait_event": "event_wait"}
_COMPARED = {
    "kernel": ("name", "grid", "block", "smem", "attrs"),
    "memset": ("pitch", "value", "element_size", "width", "height"),
    "memcpy": ("extent",),
}
_ADDRESSED = {"kernel": ("params",), "memset": ("dst",), "memcpy": ("src", "dst")}


def compare(saved: dict, built: dict, *, addresses: bool = True, path: str = "") -> str | None:
    """The first difference between a graph description (``saved``: what SAVE wrote, decoded) and a
    graph read back by :func:`structure` (``built``), as one line; None when they agree node for node
    (type, kernel, geometry, launch attributes, memset and copy fields, child graphs) and edge for
    edge (with their data). ``addresses``: compare what holds addresses too (kernel parameter
    bytes, memset and copy pointers); off to compare a restored graph with one captured elsewhere."""
    ns, nb = saved["nodes"], built["nodes"]
    if len(ns) != len(nb):
        return f"graph {path or 'top'}: {len(ns)} nodes saved, {len(nb)} built"
    for i, (a, b) in enumerate(zip(ns, nb)):
        where = f"node {path}{i}"
        kind, saved_kind = (_STRUCTURE_TYPES.get(n["type"], n["type"]) for n in (b, a))
        if saved_kind != kind:
            return f"{where}: {saved_kind} saved, {kind} built"
        fields = _COMPARED.get(kind, ()) + (_ADDRESSED.get(kind, ()) if addresses else ())
        for field in fields:
            if field in a and a[field] != b.get(field):
                return f"{where} ({a.get('name', kind)}): {field} {a[field]!r} saved, {b.get(field)!r} built"
        if kind == "graph":
            why = compare(a["graph"], b["graph"], addresses=addresses, path=f"{path}{i}.")
            if why is not None:
                return why
    es, eb = sorted(map(list, saved["edges"])), sorted(map(list, built["edges"]))
    if es != eb:
        extra = [e for e in eb if e not in es][:1]
        missing = [e for e in es if e not in eb][:1]
        return (
            f"graph {path or 'top'}: {len(es)} edges saved, {len(eb)} built "
            f"(first saved only: {missing or None}, first built only: {extra or None})"
        )
    return None
