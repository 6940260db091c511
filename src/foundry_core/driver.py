"""Thin helpers over ``cuda.bindings.driver``: results become exceptions named after the driver error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import FoundryError


class CudaError(FoundryError, RuntimeError):
    """A CUDA driver call failed; ``.name`` is the driver's error name (e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, call: str, result: Any):
        self.call = call
        self.name = getattr(result, "name", str(result))
        self.code = int(result)
        super().__init__(f"{call} failed: {self.name}")


def cu():
    from cuda.bindings import driver

    return driver


def check(result: tuple | Any, call: str = "CUDA driver call"):
    """Unpack a cuda.bindings result tuple ``(CUresult, *values)``; raise :class:`CudaError` on failure."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise CudaError(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(fn: Callable[..., Any], *args):
    """``call(cu().cuGraphCreate, 0)`` runs a ``cuda.bindings.driver`` function and unpacks its
    result; a failure raises :class:`CudaError` with the function's and the error's names."""
    return check(fn(*args), getattr(fn, "__name__", repr(fn)))
