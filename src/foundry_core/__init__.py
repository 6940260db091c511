"""Foundry: save CUDA graphs with their device context once, restore them bit-exactly at every start.

The public surface is small::

    start_recording()            begin keeping CUDA module images (call before the model runs)
    stop_recording()             detach CUPTI once graphs are saved or restored, before serving
    Region(base, size, device)   fixed-address device memory that torch allocates from
    save(path, graphs=..., region=..., tensors=..., fingerprint_model=..., slots=...)
    prepare(path, device=...)    start rebuilding modules and graphs early, on a thread
    load(path, region=..., fingerprint_model=..., prepared=...) -> Restored (.graphs, .tensors, .slots)
    SymmetricBuffer.of(handle, name)  torch symmetric memory a multi-GPU graph addresses (save/load symmetric=)
    symmetric.placed(region)     around torch symmetric-memory allocation and rendezvous: fixed addresses
    verify(path)                 check an archive against this machine

Importing this package is cheap: torch, cuda.bindings and the native library load on first use.
"""

__version__ = "0.1.1"

import importlib
from typing import Any

# Where each public name lives. Resolved on first use (PEP 562), so that importing the package, or
# one light module of it (config, the engine layer's records), does not load the archive, graph and
# region machinery: an engine imports its plugin in every process it starts.
_PUBLIC = {
    "FoundryError": "errors",
    "CudaError": "driver",
    "GraphError": "graphs",
    "ArchiveNotFound": "archive",
    "ArchiveSuperseded": "archive",
    "ArchiveLocationError": "trust",
    "Restored": "restored",
    "RestoredGraph": "restored",
    "SaveError": "api",
    "load": "api",
    "save": "api",
    "verify": "api",
    "Archive": "archive",
    "ArchiveError": "archive",
    "FingerprintMismatch": "archive",
    "ConfigError": "config",
    "FoundryConfig": "config",
    "load_config": "config",
    "ModuleError": "errors",
    "start_recording": "modules",
    "stop_recording": "modules",
    "stream_captures": "modules",
    "Prepared": "restore",
    "prepare": "api",
    "PlacementError": "region",
    "Region": "region",
    "RegionError": "region",
    "SymmetricBuffer": "symmetric",
    "SymmetricMismatch": "symmetric",
    "SymmetricPlacementError": "symmetric",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    try:  # a submodule, as ``foundry_core.modules`` after a plain ``import foundry_core``
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # the submodule exists; something it imports does not
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "Archive",
    "ArchiveError",
    "ArchiveLocationError",
    "ArchiveNotFound",
    "ArchiveSuperseded",
    "ConfigError",
    "CudaError",
    "FingerprintMismatch",
    "FoundryConfig",
    "FoundryError",
    "GraphError",
    "ModuleError",
    "PlacementError",
    "Prepared",
    "Region",
    "RegionError",
    "Restored",
    "RestoredGraph",
    "SaveError",
    "SymmetricBuffer",
    "SymmetricMismatch",
    "SymmetricPlacementError",
    "load",
    "load_config",
    "prepare",
    "save",
    "start_recording",
    "stop_recording",
    "stream_captures",
    "verify",
]
