"""The root of every error Foundry raises.

Each concern keeps its own class (``ArchiveError``, ``SaveError``, ``RegionError``, ...), still a
subclass of the builtin it always was (``ValueError``, ``RuntimeError``); ``FoundryError`` is what
they share, so a caller can catch everything Foundry refuses in one ``except``. Every message is
one line naming what to fix. :class:`ModuleError` is here rather than in ``modules.py`` because
both the module loader and the NVSHMEM set-up it calls (``nvshmem.py``) raise it.
"""


class FoundryError(Exception):
    """Base of Foundry's errors."""


class ModuleError(FoundryError, RuntimeError):
    """A kernel's code could not be captured or reloaded; the message names the kernel."""
