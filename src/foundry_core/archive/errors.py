"""The archive's error types and the helpers that keep their messages to one line.

Separate because every other module of the archive package raises these, and so does the
fingerprint comparison in :mod:`foundry_core.fingerprint` (:class:`FingerprintMismatch` is an
:class:`ArchiveError`): this module imports nothing else of Foundry, so it can be imported from
either side without an import cycle.
"""

from __future__ import annotations

from typing import Any

from ..errors import FoundryError


class ArchiveError(FoundryError):
    """An archive that cannot be written or used; the message is one line a user can act on."""


class ArchiveNotFound(ArchiveError):
    """``open_archive`` found nothing at the path (a first start in ``auto`` mode SAVEs instead)."""


class ArchiveSuperseded(ArchiveError):
    """A SAVE that was to publish only over the archive its caller had seen found that another SAVE
    published one since (``expected_version`` of :class:`ArchiveWriter`); nothing was written."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Stands for the absent side in :class:`FingerprintMismatch` when a key exists on one side only.
MISSING: Any = _Missing()


class FingerprintMismatch(ArchiveError):
    """The archive was saved for a different setup. ``field`` is e.g. ``"gpu_name"`` or ``"model.dtype"``;
    ``saved``/``current`` are the two values (:data:`MISSING` for an absent key)."""

    def __init__(self, message: str, field: str, saved: Any, current: Any):
        super().__init__(message)
        self.field = field
        self.saved = saved
        self.current = current


# Tracebacks and pickles name the errors where users import them from, as before the split.
for _cls in (ArchiveError, ArchiveNotFound, ArchiveSuperseded, FingerprintMismatch):
    _cls.__module__ = "foundry_core.archive"
del _cls


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _oserr(e: OSError) -> str:
    return e.strerror or type(e).__name__
