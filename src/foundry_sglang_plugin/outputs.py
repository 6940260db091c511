"""Graph outputs as named tensors plus a JSON layout, and back.

A captured decode graph returns SGLang objects (``LogitsProcessorOutput`` and the like) whose tensors
live in graph memory. SAVE hands the tensors to ``fc.save`` under stable names and keeps the shape of
the object as a JSON layout; LOAD rebuilds the same object around the restored tensors. Only plain
containers, dataclasses and scalars are accepted: anything else is refused at SAVE, not guessed at.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any


class OutputLayoutError(TypeError):
    """A graph output this plugin cannot describe, or a layout it cannot rebuild."""


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def flatten(value: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """(JSON layout, {name: tensor}) for one graph output; names start with ``prefix``."""
    tensors: dict[str, Any] = {}

    def walk(v: Any, path: str) -> Any:
        if _is_tensor(v):
            tensors[path] = v
            return {"k": "tensor", "name": path}
        if isinstance(v, enum.Enum):  # before the scalars: IntEnum members are ints too
            cls = type(v)
            return {"k": "enum", "cls": f"{cls.__module__}:{cls.__qualname__}", "v": v.name}
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"k": "value", "v": v}
        if isinstance(v, (list, tuple)):
            kind = "tuple" if isinstance(v, tuple) else "list"
            return {"k": kind, "items": [walk(x, f"{path}/{i}") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            if not all(isinstance(key, str) for key in v):
                raise OutputLayoutError(f"{path}: dict output with non-string keys")
            return {"k": "dict", "items": {key: walk(x, f"{path}/{key}") for key, x in v.items()}}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            cls = type(v)
            fields = {
                f.name: walk(getattr(v, f.name), f"{path}/{f.name}") for f in dataclasses.fields(v) if f.init
            }
            return {"k": "dataclass", "cls": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
        raise OutputLayoutError(f"{path}: cannot persist a graph output of type {type(v).__qualname__}")

    return walk(value, prefix), tensors


def _resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def unflatten(layout: Any, tensors: dict[str, Any]) -> Any:
    """Rebuild an output from its layout and the restored tensors."""
    kind = layout.get("k") if isinstance(layout, dict) else None
    if kind == "tensor":
        try:
            return tensors[layout["name"]]
        except KeyError:
            raise OutputLayoutError(f"archive has no tensor {layout['name']!r}") from None
    if kind == "value":
        return layout["v"]
    if kind in ("list", "tuple"):
        items = [unflatten(x, tensors) for x in layout["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {key: unflatten(x, tensors) for key, x in layout["items"].items()}
    if kind == "dataclass":
        cls = _resolve(layout["cls"])
        return cls(**{name: unflatten(x, tensors) for name, x in layout["fields"].items()})
    if kind == "enum":
        return _resolve(layout["cls"])[layout["v"]]
    raise OutputLayoutError(f"unknown output layout entry {layout!r}")
