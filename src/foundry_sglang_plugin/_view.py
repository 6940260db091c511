"""Read SGLang server arguments the same way across releases.

From SGLang 0.5.20 on, ``ServerArgs`` is a msgspec record that keeps the operator's raw input, and the
values resolution decided live in a separate declaration log; ``resolution_result`` reads "last
declaration, then raw input, then the declared fallback". Earlier releases resolved in place on a
dataclass, so a plain ``getattr`` is the answer there. Everything in this package that asks what a
setting *is* goes through :func:`reader`, so the two shapes are handled in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def _resolution_result() -> Callable[..., Any] | None:
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:  # releases that resolve in place
        return None
    return resolution_result


def reader(server_args: Any) -> Callable[[str, Any], Any]:
    """``read(name, default)``: the effective value of one server argument, ``default`` when the
    running release has no such field."""
    resolved = _resolution_result()

    def read(name: str, default: Any = None) -> Any:
        if not has_field(server_args, name):
            return default
        if resolved is not None:
            return resolved(server_args, name, default)
        return getattr(server_args, name, default)

    return read


def has_field(server_args: Any, name: str) -> bool:
    """Whether ``name`` is a configuration field of this release's ``ServerArgs``."""
    fields = getattr(type(server_args), "__struct_fields__", None)
    if fields is not None:  # msgspec record: only declared fields count, not bookkeeping
        return name in fields
    dataclass_fields = getattr(type(server_args), "__dataclass_fields__", None)
    if dataclass_fields is not None:
        return name in dataclass_fields
    return getattr(server_args, name, _MISSING) is not _MISSING
