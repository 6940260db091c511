"""The one error both plugins raise for a configuration Foundry cannot restore correctly."""

from __future__ import annotations

from ..config import ConfigError


class FoundryUnsupportedError(ConfigError):
    """An engine configuration Foundry refuses at startup, before any GPU work (fail closed).

    ``str(err)`` is one line naming every reason: ``Foundry cannot run this <engine> configuration:
    <reason>; <reason>``. ``reasons`` holds them one by one.
    """

    def __init__(self, engine: str, reasons: list[str]):
        self.engine = engine
        self.reasons = list(reasons)
        super().__init__(f"Foundry cannot run this {engine} configuration: " + "; ".join(self.reasons))


_EXITING: dict[type, type] = {}


def exiting(error: BaseException) -> BaseException:
    """``error`` as an error of its own class that is also a :class:`SystemExit` carrying its one
    line: left uncaught at a server's start (``sglang serve``, ``vllm serve``), the process ends
    with that line and status 1 instead of a 25-45 line traceback; code that catches the error's own
    class (or ``ValueError``, ``Exception``) still does."""
    cls = type(error)
    if isinstance(error, SystemExit):
        return error
    if cls not in _EXITING:
        _EXITING[cls] = type(cls.__name__, (cls, SystemExit), {"__module__": cls.__module__})
    new = _EXITING[cls].__new__(_EXITING[cls])
    new.args = error.args
    new.__dict__.update(getattr(error, "__dict__", {}))
    new.code = f"error: {' '.join(str(error).split())}"
    return new
