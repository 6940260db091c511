"""Foundry: save CUDA graphs with their device context once, restore them bit-exactly at every start.

The public surface is small::

    start_recording()            begin keeping CUDA module images (call before the model runs)
    stop_recording()             detach CUPTI once graphs are saved or restored, before serving
    Region(base, size, device)   fixed-address device memory that torch allocates from
    save(path, graphs=..., region=..., tensors=..., fingerprint_model=..., slots=...)
    load(path, region=..., fingerprint_model=...) -> Restored (.graphs, .tensors, .slots)
    verify(path)                 check an archive against this machine

Importing this package is cheap: torch, cuda.bindings and the native library load on first use.
"""

__version__ = "0.1.0"

from .api import Restored, RestoredGraph, SaveError, load, save, verify  # noqa: E402
from .archive import Archive, ArchiveError, FingerprintMismatch  # noqa: E402
from .config import ConfigError, FoundryConfig, load_config  # noqa: E402
from .modules import ModuleError, start_recording, stop_recording, stream_captures  # noqa: E402
from .region import PlacementError, Region, RegionError  # noqa: E402

__all__ = [
    "Archive",
    "ArchiveError",
    "ConfigError",
    "FingerprintMismatch",
    "FoundryConfig",
    "ModuleError",
    "PlacementError",
    "Region",
    "RegionError",
    "Restored",
    "RestoredGraph",
    "SaveError",
    "load",
    "load_config",
    "save",
    "start_recording",
    "stop_recording",
    "stream_captures",
    "verify",
]
