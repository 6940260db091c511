"""The native library on a machine without a GPU: ctypes signatures match the C exports, and the
region log API behaves (reads an empty log, refuses to reserve without a driver)."""

import ctypes
import re
from pathlib import Path

import pytest

from foundry_core import _native

ROOT = Path(__file__).resolve().parents[1]


#: A library of its own (the libcuda.so.1 NVSHMEM is pointed at), not part of _foundry_native.
SHIM = "nvshmem_cuda.c"


def _c_exports(shim: bool = False):
    files = [p for p in (ROOT / "native").glob("*.c") if (p.name == SHIM) == shim]
    text = "\n".join(p.read_text() for p in files)
    exports = {}
    for m in re.finditer(r"EXPORT\s+[\w\s\*]+?\b(foundry_\w+)\s*\(([^)]*)\)", text):
        params = [p for p in m.group(2).split(",") if p.strip() and p.strip() != "void"]
        exports[m.group(1)] = len(params)
    return exports


def test_ctypes_arity_matches_c():
    lib = _native.lib()
    assert _native.graph_lib() is lib  # declares the graph builder's signatures on the same library
    exports = _c_exports()
    assert "foundry_region_log_read" in exports and "foundry_alloc_graph" in exports
    for name, arity in exports.items():
        fn = getattr(lib, name)
        if fn.argtypes is None:  # handed to torch by name (allocator entry points), not called from Python
            assert name in ("foundry_alloc", "foundry_alloc_graph", "foundry_free"), name
            continue
        assert len(fn.argtypes) == arity, f"{name}: ctypes declares {len(fn.argtypes)} args, C has {arity}"


def test_the_nvshmem_driver_shim_is_apart_and_declared():
    """native/nvshmem_cuda.c is built on its own (its cuInit must never be the main library's), and
    Python declares its calls as C has them."""
    from foundry_core import nvshmem

    shim = nvshmem._driver_shim()
    exports = _c_exports(shim=True)
    assert set(exports) == {"foundry_nvshmem_real_driver", "foundry_nvshmem_arm", "foundry_nvshmem_placement"}
    for name, arity in exports.items():
        assert len(getattr(shim, name).argtypes) == arity, name
    with pytest.raises(AttributeError):
        _native.lib().cuInit  # noqa: B018 - the main library exports no driver entry point


def test_empty_log_and_refusals_without_driver():
    lib = _native.lib()
    assert lib.foundry_region_log_len(0) == 0
    assert lib.foundry_region_cursor(0) == 0
    assert lib.foundry_region_map(99, 0, 0, 0) == -1
    assert lib.foundry_region_rewind(99, 0, 0) == -1
    assert lib.foundry_region_rewind(0, 0, 0) == -1  # nothing reserved: nothing to rewind
    assert "cannot rewind" in _native.region_error()
    alloc = ctypes.cast(
        lib.foundry_alloc, ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    )
    assert alloc(1 << 20, 0, None) is None  # no region reserved: allocation refused
    rc = lib.foundry_region_reserve(0, 0x600000000000, 1 << 30)
    if rc == 0:  # pragma: no cover - only on a machine with a driver
        pytest.skip("a CUDA driver is present")
    assert rc == -1
    assert "libcuda" in _native.region_error() or "cuMem" in _native.region_error()


def test_modules_start_reports_missing_cupti():
    lib = _native.lib()
    if lib.foundry_modules_started():  # pragma: no cover
        pytest.skip("recording already running in this process")
    assert lib.foundry_modules_start(b"/nonexistent/libcupti.so") == -1
    assert "cannot open CUPTI" in _native.modules_error()


def test_stop_recording_without_start_is_a_no_op():
    import foundry_core as fc

    lib = _native.lib()
    if lib.foundry_modules_started():  # pragma: no cover
        pytest.skip("recording already running in this process")
    assert lib.foundry_modules_stop() == 0
    fc.stop_recording()
    fc.stop_recording()
    assert not fc.modules.recording()


def test_instantiate_flags_match_between_builders_and_torch():
    """Both builders instantiate restored graphs with torch's own flags (auto-free on launch, per-node
    priority), so a restored graph keeps the kernel priorities it was captured with."""
    from foundry_core import graphs

    text = (ROOT / "native" / "graphbuild.c").read_text()
    m = re.search(r"#define FOUNDRY_INSTANTIATE_FLAGS \((\d+)ULL \| (\d+)ULL\)", text)
    assert m, "FOUNDRY_INSTANTIATE_FLAGS not found in native/graphbuild.c"
    assert int(m.group(1)) | int(m.group(2)) == graphs.INSTANTIATE_FLAGS == 1 | 8
    assert "cu.instantiate(&exec, graph, FOUNDRY_INSTANTIATE_FLAGS)" in text


def test_a_library_older_than_the_code_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setitem(_native.SIGNATURES, "foundry_from_the_future", (ctypes.c_int, []))
    _native.lib.cache_clear()
    try:
        with pytest.raises(
            _native.NativeLibraryMissing, match="has no foundry_from_the_future.*pip install -e"
        ):
            _native.lib()
        assert _native.graph_lib() is None and _native.inflate_fn.__wrapped__() is None
    finally:
        monkeypatch.undo()
        _native.lib.cache_clear()
    assert _native.lib().foundry_region_cursor(0) == 0
