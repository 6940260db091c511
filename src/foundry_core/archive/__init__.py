"""The Foundry archive: one versioned, verified, crash-safe on-disk format (see docs/archive-format.md).

An archive is a directory holding arbitrary files chosen by the caller (module images, serialized
graphs, layout tables...) plus ``manifest.json``, written last, which lists every other file with its
size and sha256 and carries the fingerprint of the setup it was saved for and a caller-supplied
``meta`` object. The archive's digest is the sha256 of the manifest bytes.

Writing::

    with ArchiveWriter(path) as w:
        if not w.has(f"modules/{sha}.cubin"):
            w.add_bytes(f"modules/{sha}.cubin", image)
        w.add_json("layout.json", layout)
        digest = w.commit(fingerprint=current_fingerprint(), meta={...})

Reading::

    ar = open_archive(path, expected_fingerprint=current_fingerprint(), expected_digest=pinned)
    blob = ar.read_bytes("graphs/0003.bin")

On disk, ``path`` is a symlink to a sibling ``.<name>.<digest16>`` directory; a SAVE builds a new
sibling and swaps the symlink atomically, so ``path`` is always either absent, the complete old
archive or the complete new one. Every failure raises :class:`ArchiveError` with a one-line message.

The package, one module per concern:

- ``errors``  -- :class:`ArchiveError` and its subclasses (also raised by the fingerprint comparison);
- ``format``  -- format constants, member-name rules, strict JSON, the manifest schema and checksum;
- ``codec``   -- chunked zlib compression of members and their verified inflation;
- ``publish`` -- sibling names, the lock, the atomic swap, cleanup, :func:`remove_archive`;
- ``writer``  -- :class:`ArchiveWriter`;
- ``reader``  -- :func:`open_archive` and the verified :class:`Archive`.

The fingerprint comparison (:func:`compare_fingerprint`) lives in :mod:`foundry_core.fingerprint`
and is re-exported here. This package does not import torch or the CUDA bindings.
"""

from __future__ import annotations

import sys
import types
from typing import Any

# ``name as name``: re-exported beside __all__, for the library (check_relpath) and for the tests
# and benchmarks that reach into the archive code by its old private names.
from . import codec, errors, format, publish, reader, writer
from .codec import _ZLIB_THREADS as _ZLIB_THREADS
from .codec import COMPRESS_CHUNK
from .codec import _inflate as _inflate
from .codec import _map_on_threads as _map_on_threads
from .errors import MISSING, ArchiveError, ArchiveNotFound, ArchiveSuperseded, FingerprintMismatch
from .format import (
    ENCODING_KIND,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MIN_FORMAT_VERSION,
)
from .format import _check_encoding as _check_encoding
from .format import _manifest_bytes as _manifest_bytes
from .format import _self_checksum as _self_checksum
from .format import _self_checksum_matches as _self_checksum_matches
from .format import check_relpath as check_relpath
from .publish import ANY_VERSION, published_version, remove_archive, require_version
from .reader import Archive, open_archive
from .reader import _open_member as _open_member
from .reader import _read_exact as _read_exact
from .writer import ArchiveWriter

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MIN_FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "MISSING",
    "ANY_VERSION",
    "Archive",
    "ArchiveError",
    "ArchiveNotFound",
    "ArchiveSuperseded",
    "ArchiveWriter",
    "COMPRESS_CHUNK",
    "ENCODING_KIND",
    "FingerprintMismatch",
    "compare_fingerprint",
    "open_archive",
    "published_version",
    "remove_archive",
    "require_version",
]

_SUBMODULES = (errors, format, codec, publish, writer, reader)


def __getattr__(name: str) -> Any:
    # foundry_core.fingerprint imports this package (for the error types and strict JSON), so its
    # compare_fingerprint is looked up on first use rather than imported above.
    if name == "compare_fingerprint":
        from foundry_core.fingerprint import compare_fingerprint

        globals()[name] = compare_fingerprint
        return compare_fingerprint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package as a module object: a name set on it is also set in each submodule that binds
    the same object under that name.

    The archive used to be one module, so a test or benchmark that patches, say,
    ``foundry_core.archive._open_member`` or sets ``foundry_core.archive._ZLIB_THREADS`` changed what
    the code used. Forwarding the assignment keeps that true now that the code reading the name
    lives in a submodule (``mock.patch`` and ``monkeypatch`` undo it the same way, by assignment).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, _UNSET)
        if old is not _UNSET and not name.startswith("__") and not isinstance(old, types.ModuleType):
            for module in _SUBMODULES:
                if module.__dict__.get(name, _UNSET) is old:
                    setattr(module, name, value)
        super().__setattr__(name, value)


_UNSET = object()
sys.modules[__name__].__class__ = _Package
