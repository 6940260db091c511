"""vLLM's workspace manager across SAVE and LOAD: the shared scratch and the persistent resources.

vLLM's ``WorkspaceManager`` (``vllm.v1.worker.workspace``) holds, per ubatch and lane ("slot"), one
shared scratch buffer (``_current_workspaces``) and, in recent releases, keyed persistent resources
(``_persistent_resources``: Marlin's zeroed locks, the MoE permute scratch, ...). Decode graphs point
into both. vLLM grows them lazily, first in its memory profiling and kernel warmups, which run outside
the Foundry region at SAVE and at LOAD; once its capture is done it locks the manager, after which a
larger scratch or a new resource is an error.

* SAVE, right before vLLM's capture and inside the capture routing: :func:`place` allocates every slot
  and every persistent tensor anew in the region (same sizes, same contents, aliasing kept), so the
  graphs point into memory the archive carries; :func:`place` returns those tensors by name and a
  listing of what they stand for.
* LOAD, once the graphs are restored: :func:`check_restorable` compares this process's manager with
  the listing (before anything is installed), and :func:`install` makes the manager hold the restored
  tensors, so that it ends as SAVE's capture left it: same addresses, same sizes, then locked as it was.
* SAVE's throwaway graph-memory profiling (which LOAD does not run) adds resources for its own capture
  stream; :func:`drop_added` removes them again so both starts reach the setup with the same manager.

Nothing here imports vLLM's GPU modules; a process without a workspace manager gets empty results.
"""

from __future__ import annotations

import enum
import re
from typing import Any

WORKSPACE_PREFIX = "vllm.workspace/"
PERSISTENT_PREFIX = "vllm.persistent/"


class WorkspaceMismatch(RuntimeError):
    """This process's workspace manager cannot take the SAVE's restored workspace; one line."""


def manager() -> Any | None:
    """vLLM's workspace manager, or ``None`` (a release without one, or none initialised)."""
    try:
        from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized
    except ImportError:
        return None
    return current_workspace_manager() if is_workspace_manager_initialized() else None


def locked() -> bool | None:
    """Whether the manager is locked now; ``None`` where there is none."""
    m = manager()
    return None if m is None else bool(m.is_locked())


def lock() -> None:
    """Lock the manager as vLLM's capture does (a no-op where there is none)."""
    m = manager()
    if m is not None:
        m.lock()


def _resources(m: Any) -> list[dict]:
    return list(getattr(m, "_persistent_resources", None) or [])


def resource_keys() -> list[set]:
    """Per slot, the keys of the persistent resources that exist now."""
    m = manager()
    return [] if m is None else [set(slot) for slot in _resources(m)]


def drop_added(before: list[set]) -> int:
    """Remove the persistent resources created since ``before`` (:func:`resource_keys`); returns how
    many. Used around SAVE's throwaway profiling capture, whose resources LOAD never creates."""
    m = manager()
    dropped = 0
    for i, slot in enumerate(_resources(m) if m is not None else []):
        known = before[i] if i < len(before) else set()
        for key in [k for k in slot if k not in known]:
            del slot[key]
            dropped += 1
    return dropped


def describe_key(key: Any) -> str:
    """A description of a resource key that is the same in every process: classes by name, devices
    and enums by value, CUDA streams as ``stream`` (their handles differ from process to process)."""
    if isinstance(key, tuple):
        return "(" + ",".join(describe_key(k) for k in key) + ")"
    if isinstance(key, type):
        return f"{key.__module__}.{key.__qualname__}"
    if isinstance(key, enum.Enum):
        return f"{type(key).__name__}.{key.name}"
    if isinstance(key, (str, int, float, bool)) or key is None:
        return repr(key)
    name = type(key).__name__
    if name == "device":
        return f"device:{key}"
    if "Stream" in name:
        return "stream"
    if name == "dtype":
        return str(key)
    return name


def _tensor_fields(resource: Any) -> list[tuple[str, Any]]:
    """``(field, tensor)`` for each tensor a resource holds: itself, its items, or its attributes."""
    import torch

    if isinstance(resource, torch.Tensor):
        return [("", resource)]
    if isinstance(resource, (tuple, list)):
        return [(str(i), t) for i, t in enumerate(resource) if isinstance(t, torch.Tensor)]
    attrs = vars(resource) if hasattr(resource, "__dict__") else {}
    return [(name, t) for name, t in attrs.items() if isinstance(t, torch.Tensor)]


def _with_fields(resource: Any, new: dict[str, Any]) -> Any:
    """``resource`` with the tensors of ``new`` (field -> tensor) in place of its own."""
    import torch

    if isinstance(resource, torch.Tensor):
        return new[""]
    if isinstance(resource, (tuple, list)):
        items = [new.get(str(i), item) for i, item in enumerate(resource)]
        return type(resource)(items)
    for name, t in new.items():  # the same object: code that kept it sees the new tensors too
        setattr(resource, name, t)
    return resource


def _shape(t: Any) -> list:
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


def listing() -> dict:
    """What the manager holds now, as JSON: per slot the scratch size and each persistent resource
    (key description and the shape of every tensor field)."""
    m = manager()
    if m is None:
        return {"slots": []}
    slots = []
    resources = _resources(m)
    for i, ws in enumerate(m._current_workspaces):
        items = []
        for key, resource in (resources[i] if i < len(resources) else {}).items():
            fields = _tensor_fields(resource)
            items.append(
                {
                    "key": describe_key(key),
                    "kind": type(resource).__name__,
                    "fields": {name: _shape(t) for name, t in fields},
                }
            )
        nbytes = 0 if ws is None else int(ws.numel() * ws.element_size())
        slots.append({"scratch_bytes": nbytes, "persistent": items})
    return {"slots": slots}


def _copy_keeping_aliases(tensors: list, copies: dict) -> list:
    """Each tensor copied into a new allocation of the caller's allocator; views of one storage stay
    views of one new storage (``copies`` maps old storages to new ones across calls)."""
    import torch

    out = []
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.device)
        if key not in copies:
            copies[key] = storage.clone()
        fresh = torch.empty((0,), dtype=t.dtype, device=t.device)
        fresh.set_(copies[key], t.storage_offset(), t.size(), t.stride())
        out.append(fresh)
    return out


def place() -> tuple[dict, dict]:
    """SAVE, inside the capture routing, right before vLLM captures: every scratch slot and every
    persistent tensor allocated anew where allocations go now (the region), at its present size and
    with its present contents. Returns ``(tensors, listing)``: the new tensors by archive name, and
    :func:`listing` of the manager they were placed for."""
    import torch

    m = manager()
    if m is None:
        return {}, {"slots": []}
    tensors: dict[str, Any] = {}
    for i, ws in enumerate(m._current_workspaces):
        if ws is None:
            continue
        m._current_workspaces[i] = None  # the old buffer (outside the region) goes back to the cache
        fresh = torch.empty(ws.shape, dtype=ws.dtype, device=ws.device)
        m._current_workspaces[i] = fresh
        tensors[f"{WORKSPACE_PREFIX}{i}"] = fresh
    copies: dict = {}
    for i, slot in enumerate(_resources(m)):
        for position, (key, resource) in enumerate(list(slot.items())):
            fields = _tensor_fields(resource)
            if not fields:
                continue
            new = dict(
                zip([name for name, _ in fields], _copy_keeping_aliases([t for _, t in fields], copies))
            )
            slot[key] = _with_fields(resource, new)
            for name, t in new.items():
                tensors[f"{PERSISTENT_PREFIX}{i}/{position}/{name}"] = t
    return tensors, listing()


_STREAM_IN_KEY = re.compile(r"(?:^|[(,])stream(?:[,)]|$)")  # describe_key's name for a CUDA stream


def grown_since(placed: dict) -> str | None:
    """SAVE, right after vLLM's capture: why the manager now holds more than :func:`place` put in the
    region (``placed`` is its listing), or None. A scratch slot that grew, or a persistent resource
    added with a key that names no CUDA stream, is memory the graphs point into that a LOAD's
    manager would not hold: once locked, it raises at the first eager call that asks for it, at LOAD
    only. A resource keyed by the capture's own stream is asked for by the capture alone, and its
    memory, allocated in the region, is restored with the graphs."""
    now = listing()["slots"]
    was = placed.get("slots") or []
    for i, slot in enumerate(now):
        before = was[i] if i < len(was) else {"scratch_bytes": 0, "persistent": []}
        if slot["scratch_bytes"] > before["scratch_bytes"]:
            return (
                f"vLLM's workspace slot {i} grew from {before['scratch_bytes']} to "
                f"{slot['scratch_bytes']} bytes during its capture"
            )
        known = {item["key"] for item in before["persistent"]}
        for item in slot["persistent"]:
            if item["key"] not in known and not _STREAM_IN_KEY.search(item["key"]):
                return f"vLLM's capture added the persistent workspace resource {item['key']} (slot {i})"
    return None


def _saved_entries(saved: dict) -> list[tuple[int, int, dict]]:
    return [
        (i, position, item)
        for i, slot in enumerate(saved.get("slots") or [])
        for position, item in enumerate(slot.get("persistent") or [])
    ]


def check_restorable(saved: dict, restored_tensors: dict) -> None:
    """LOAD, before the restored graphs are installed: this manager can take the SAVE's workspace.

    Its scratch slots must be no larger than the SAVE's (the manager is locked afterwards, as at SAVE),
    and each persistent resource the SAVE placed must exist here with the same key and tensor shapes.
    Raises :class:`WorkspaceMismatch` with one line otherwise."""
    m = manager()
    slots = saved.get("slots") or []
    if m is None:
        if slots:
            raise WorkspaceMismatch("the archive holds vLLM workspace, this vLLM has no workspace manager")
        return
    now = listing()["slots"]
    if len(now) != len(slots):
        raise WorkspaceMismatch(f"vLLM has {len(now)} workspace slots, the SAVE had {len(slots)}")
    for i, (have, want) in enumerate(zip(now, slots)):
        if have["scratch_bytes"] > want["scratch_bytes"]:
            raise WorkspaceMismatch(
                f"vLLM's workspace slot {i} grew to {have['scratch_bytes']} bytes before the graphs, "
                f"the SAVE's to {want['scratch_bytes']}"
            )
        if want["scratch_bytes"] and f"{WORKSPACE_PREFIX}{i}" not in restored_tensors:
            raise WorkspaceMismatch(f"the archive lacks vLLM's workspace slot {i}")
    for i, position, item in _saved_entries(saved):
        here = now[i]["persistent"]
        match = here[position] if position < len(here) else None
        if match is None or (match["key"], match["fields"]) != (item["key"], item["fields"]):
            raise WorkspaceMismatch(
                f"vLLM's persistent workspace resource {item['key']} (slot {i}) differs from the SAVE's "
                f"({'missing' if match is None else match['key']})"
            )
        lacking = [
            n for n in item["fields"] if f"{PERSISTENT_PREFIX}{i}/{position}/{n}" not in restored_tensors
        ]
        if lacking:
            raise WorkspaceMismatch(f"the archive lacks vLLM's persistent workspace resource {item['key']}")


def install(saved: dict, restored_tensors: dict) -> int:
    """LOAD, with the restored graphs: the manager holds the restored scratch and persistent tensors
    (the SAVE's, at the SAVE's addresses) in place of its own. Returns the number of tensors taken;
    call :func:`check_restorable` first."""
    m = manager()
    if m is None:
        return 0
    taken = 0
    for i in range(len(m._current_workspaces)):
        t = restored_tensors.get(f"{WORKSPACE_PREFIX}{i}")
        if t is not None:
            m._current_workspaces[i] = t
            taken += 1
    resources = _resources(m)
    for i, position, item in _saved_entries(saved):
        slot = resources[i]
        key = list(slot)[position]
        new = {name: restored_tensors[f"{PERSISTENT_PREFIX}{i}/{position}/{name}"] for name in item["fields"]}
        slot[key] = _with_fields(slot[key], new)
        taken += len(new)
    return taken


__all__ = [
    "WorkspaceMismatch",
    "check_restorable",
    "describe_key",
    "drop_added",
    "install",
    "listing",
    "lock",
    "locked",
    "manager",
    "place",
    "resource_keys",
]
