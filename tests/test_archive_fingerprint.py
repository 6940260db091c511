"""foundry_core.fingerprint and the archive's fingerprint comparison: every mismatch is named
(CPU only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foundry_core import __version__
from foundry_core.archive import (
    MISSING,
    ArchiveError,
    FingerprintMismatch,
    compare_fingerprint,
    open_archive,
)
from foundry_core.fingerprint import (
    FINGERPRINT_FIELDS,
    FINGERPRINT_FORMAT,
    current_fingerprint,
    format_driver_version,
    make_fingerprint,
)
from sample_archive import (
    REPO,
    fp,
)

# ---------------------------------------------------------------------------------------------- fingerprint


FIELD_CHANGES = {
    "fingerprint_format": FINGERPRINT_FORMAT + 1,
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "compute_capability": "10.0",
    "sm_count": 114,
    "driver_version": "12.8",
    "cuda_version": "12.8",
    "torch_version": "2.11.0",
    "foundry_version": "0.0.2",
    "rank": 1,
    "world_size": 4,
    "model": {"name": "Qwen3-8B", "capture_sizes": [1, 2, 4, 8], "dtype": "bfloat16"},
}


def test_field_changes_cover_every_field():
    assert set(FIELD_CHANGES) == set(FINGERPRINT_FIELDS)


@pytest.mark.parametrize("field", FINGERPRINT_FIELDS)
def test_every_fingerprint_field_mismatch_is_named(arch, field):
    path, _ = arch
    current = dict(fp())
    current[field] = FIELD_CHANGES[field]
    if field == "rank":
        current["world_size"] = 2  # keep the layout valid; rank is compared first
    with pytest.raises(FingerprintMismatch) as ei:
        open_archive(path, expected_fingerprint=current)
    err = ei.value
    want = "model.name" if field == "model" else field
    assert err.field == want
    assert f"archive was saved for {want}=" in str(err)
    assert "\n" not in str(err)
    assert isinstance(err, ArchiveError)


def test_fingerprint_message_reads_well():
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(fp(gpu_name="NVIDIA H100 80GB HBM3"), fp())
    assert str(ei.value).startswith(
        "archive was saved for gpu_name='NVIDIA H100 80GB HBM3', this machine has 'NVIDIA H200'"
    )
    assert (ei.value.saved, ei.value.current) == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def test_fingerprint_first_field_in_order_wins():
    saved = fp()
    current = fp(gpu_name="other", sm_count=1, torch_version="0.1", model={"x": 1})
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.field == "gpu_name"
    current = fp(driver_version="1.0", cuda_version="1.0", model={"x": 1}, rank=1, world_size=2)
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.field == "driver_version"
    order = list(FINGERPRINT_FIELDS)
    assert order[0] == "fingerprint_format" and order[-1] == "model"
    assert order.index("gpu_name") < order.index("driver_version") < order.index("cuda_version")
    assert order.index("cuda_version") < order.index("torch_version") < order.index("foundry_version")
    assert order.index("foundry_version") < order.index("rank") < order.index("world_size")


def test_model_keys_are_compared_one_by_one():
    saved = fp(model={"name": "m", "capture_sizes": [1, 2, 4], "pools": {"kv": 10, "mamba": 3}})
    # lists element by element: a length difference names the extra elements, on the side that has them
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[2:\]=\[4\], this machine has \[\]; SAVE again"
    ) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2], "pools": {"kv": 10, "mamba": 3}})
        )
    assert (ei.value.field, ei.value.saved, ei.value.current) == ("model.capture_sizes[2:]", [4], [])
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[3:\]=\[\], this machine has \[8\]; SAVE again"
    ):
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2, 4, 8], "pools": {"kv": 10, "mamba": 3}})
        )
    # a differing element is named by its index, with both values
    with pytest.raises(
        FingerprintMismatch, match=r"model.capture_sizes\[1\]=2, this machine has 3; SAVE again"
    ) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 3, 4], "pools": {"kv": 10, "mamba": 3}})
        )
    assert (ei.value.field, ei.value.saved, ei.value.current) == ("model.capture_sizes[1]", 2, 3)
    # nested lists and objects inside lists: the full path to the first difference
    with pytest.raises(FingerprintMismatch, match=r"model.shapes\[1\]\[0\]=4, this machine has 5;"):
        compare_fingerprint(fp(model={"shapes": [[1, 2], [4, 8]]}), fp(model={"shapes": [[1, 2], [5, 8]]}))
    with pytest.raises(FingerprintMismatch, match=r"model.pools\[0\].kv=1, this machine has 2;"):
        compare_fingerprint(fp(model={"pools": [{"kv": 1}]}), fp(model={"pools": [{"kv": 2}]}))
    # JSON types still count inside a list: true is not 1
    with pytest.raises(FingerprintMismatch, match=r"model.flags\[0\]=1, this machine has True;"):
        compare_fingerprint(fp(model={"flags": [1]}), fp(model={"flags": [True]}))
    # a list is not an object, nor a string
    with pytest.raises(FingerprintMismatch, match=r"model.capture_sizes="):
        compare_fingerprint(fp(model={"capture_sizes": [1]}), fp(model={"capture_sizes": {"0": 1}}))
    with pytest.raises(FingerprintMismatch, match=r"model.capture_sizes="):
        compare_fingerprint(fp(model={"capture_sizes": ["1"]}), fp(model={"capture_sizes": "1"}))
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(
            saved, fp(model={"name": "m", "capture_sizes": [1, 2, 4], "pools": {"kv": 10, "mamba": 4}})
        )
    assert ei.value.field == "model.pools.mamba"
    # tuples equal lists (JSON), but a bool is not an int and an int is not a float
    compare_fingerprint(
        saved, dict(fp(), model={"name": "m", "capture_sizes": (1, 2, 4), "pools": {"mamba": 3, "kv": 10}})
    )
    with pytest.raises(FingerprintMismatch, match="model.flag"):
        compare_fingerprint(fp(model={"flag": 1}), fp(model={"flag": True}))
    with pytest.raises(FingerprintMismatch, match="model.scale"):
        compare_fingerprint(fp(model={"scale": 1}), fp(model={"scale": 1.0}))


def test_missing_keys_on_either_side_mismatch():
    saved, current = fp(), fp()
    del saved["torch_version"]
    with pytest.raises(
        FingerprintMismatch, match="archive was saved without torch_version, this machine has '2.13.0'"
    ) as ei:
        compare_fingerprint(saved, current)
    assert ei.value.saved is MISSING
    with pytest.raises(
        FingerprintMismatch,
        match="archive was saved for torch_version='2.13.0', this machine has no torch_version",
    ) as ei:
        compare_fingerprint(current, saved)
    assert ei.value.current is MISSING
    with pytest.raises(FingerprintMismatch, match="model.kv_pool"):
        compare_fingerprint(fp(model={"kv_pool": 5}), fp(model={}))
    with pytest.raises(FingerprintMismatch, match="model.kv_pool"):
        compare_fingerprint(fp(model={}), fp(model={"kv_pool": 5}))
    with pytest.raises(FingerprintMismatch) as ei:
        compare_fingerprint(dict(fp(), hostname="a"), fp())
    assert ei.value.field == "hostname"
    with pytest.raises(FingerprintMismatch, match="saved for model="):
        compare_fingerprint(fp(), dict(fp(), model="m"))
    with pytest.raises(ArchiveError, match="must be dicts"):
        compare_fingerprint(fp(), None)


def test_equal_fingerprints_pass(arch):
    path, _ = arch
    compare_fingerprint(fp(), fp())
    saved = open_archive(path).fingerprint
    compare_fingerprint(saved, fp())
    open_archive(path, expected_fingerprint=fp())


def test_make_fingerprint():
    f = fp(driver_version=12080)
    assert list(f) == list(FINGERPRINT_FIELDS)
    assert f["driver_version"] == "12.8" and f["foundry_version"] == __version__
    assert f["fingerprint_format"] == FINGERPRINT_FORMAT and f["rank"] == 0 and f["world_size"] == 1
    assert fp(model={"s": (1, 2)})["model"] == {"s": [1, 2]}
    assert fp(cuda_version=None)["cuda_version"] is None
    assert format_driver_version(13000) == "13.0" and format_driver_version(12090) == "12.9"
    bad = [
        ({"gpu_nmae": "x"}, "unknown fingerprint field 'gpu_nmae'"),
        ({"sm_count": 0}, "'sm_count'"),
        ({"sm_count": True}, "'sm_count'"),
        ({"compute_capability": "sm90"}, "'compute_capability'"),
        ({"gpu_name": ""}, "'gpu_name'"),
        ({"rank": 2, "world_size": 2}, "outside world_size"),
        ({"world_size": 0}, "'world_size'"),
        ({"model": [1]}, "'model'"),
        ({"model": {1: 2}}, "key 1 is not a string"),
        ({"model": {"x": float("nan")}}, "non-finite"),
        ({"model": {"x": {1, 2}}}, "type set"),
        ({"driver_version": -5}, "driver_version"),
    ]
    for over, message in bad:
        with pytest.raises(ValueError, match=message):
            fp(**over)
    with pytest.raises(ValueError, match="'gpu_name' is required"):
        make_fingerprint(compute_capability="9.0")


def test_current_fingerprint_with_stub_torch(monkeypatch):
    import types

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    torch = types.ModuleType("torch")
    torch.__version__ = "2.13.0+cu130"
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, get_device_properties=lambda d: Props)
    cuda_pkg = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    driver.cuDriverGetVersion = lambda: (0, 13000)
    cuda_pkg.bindings, bindings.driver = bindings, driver
    for name, mod in {
        "torch": torch,
        "cuda": cuda_pkg,
        "cuda.bindings": bindings,
        "cuda.bindings.driver": driver,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    f = current_fingerprint(0, model={"name": "m"}, rank=1, world_size=2)
    assert f == make_fingerprint(
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        driver_version="13.0",
        cuda_version="13.0",
        torch_version="2.13.0+cu130",
        rank=1,
        world_size=2,
        model={"name": "m"},
    )
    torch.cuda.is_available = lambda: False
    with pytest.raises(RuntimeError, match="no CUDA device"):
        current_fingerprint()


def test_archive_imports_without_torch():
    code = "import sys, foundry_core.archive, foundry_core.fingerprint; assert 'torch' not in sys.modules, 'torch'"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
