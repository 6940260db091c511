"""The native and the Python graph builder restore the same graphs (needs a GPU).

One SAVE, then two fresh LOAD processes of the same archive, one per builder: both must be bit-exact
against the SAVE's outputs, and the rebuilt graphs, read back from the driver (nodes in order with
kernel, geometry, parameter bytes and launch attributes; edges with their edge data), must be equal.
A JSON-encoded archive (FOUNDRY_GRAPH_ENCODING=json) restores through the native builder too.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SIZES = ["1", "2", "5", "8"]


def _worker(phase, archive, reference, *extra, env=None):
    cmd = [
        sys.executable,
        "-m",
        "foundry_tools.demo",
        phase,
        "--archive",
        str(archive),
        "--reference",
        str(reference),
        "--preset",
        "tiny",
        "--batch-sizes",
        *SIZES,
        *extra,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "FOUNDRY_NO_PROGRESS": "1", **(env or {})},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FOUNDRY_RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{phase} failed\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return json.loads(lines[-1][len("FOUNDRY_RESULT ") :]), proc


def _check_load(result):
    assert result["bit_exact_all"], result["mismatched"]
    assert result["load_stream_captures"] == 0
    assert result["load_warmup_forwards"] == 0


def test_native_and_python_builders_agree(tmp_path):
    archive, reference = tmp_path / "archive", tmp_path / "reference.pt"
    _worker("save", archive, reference)
    dumps = {}
    for builder in ("native", "python"):
        dump = tmp_path / f"{builder}.json"
        result, proc = _worker(
            "load", archive, reference, "--dump-graphs", str(dump), env={"FOUNDRY_BUILDER": builder}
        )
        _check_load(result)
        assert result["builder"] == builder, proc.stderr[-2000:]
        split = result["restore_breakdown"]
        for step in ("graph_build_s", "graph_instantiate_s"):  # ahead of the memory or after it
            assert split.get(step, 0.0) + split.get(f"background_{step}", 0.0) > 0, split
        dumps[builder] = json.loads(dump.read_text())
    native, python = dumps["native"], dumps["python"]
    assert sorted(native) == sorted(python) == sorted(f"bs{s}" for s in SIZES)
    for name in native:
        assert len(native[name]["nodes"]) == len(python[name]["nodes"]), name
        assert native[name]["edges"] == python[name]["edges"], name
        assert native[name] == python[name], name


def test_json_archive_restores_natively(tmp_path):
    archive, reference = tmp_path / "archive", tmp_path / "reference.pt"
    _worker("save", archive, reference, env={"FOUNDRY_GRAPH_ENCODING": "json"})
    manifest = json.loads((archive / "manifest.json").read_text())
    assert all(g["file"].endswith(".json") for g in manifest["meta"]["graphs"])
    result, _ = _worker("load", archive, reference, env={"FOUNDRY_BUILDER": "native"})
    _check_load(result)
    assert result["builder"] == "native"


def test_upload_is_optional_and_changes_nothing_replayed(tmp_path):
    """LOAD leaves graphs un-uploaded by default (as torch leaves a captured one); --upload uploads
    each as it is restored. Both replay bit-exact."""
    archive, reference = tmp_path / "archive", tmp_path / "reference.pt"
    _worker("save", archive, reference)
    plain, _ = _worker("load", archive, reference)
    _check_load(plain)
    # On the critical path, or on the background thread when load() handed graphs over to it.
    split = plain["restore_breakdown"]
    assert split.get("graph_upload_s", 0.0) == split.get("background_graph_upload_s", 0.0) == 0.0
    uploaded, _ = _worker("load", archive, reference, "--upload")
    _check_load(uploaded)
    split = uploaded["restore_breakdown"]
    assert split.get("graph_upload_s", 0.0) + split.get("background_graph_upload_s", 0.0) > 0


@pytest.mark.parametrize("prepare", [True, False], ids=["built-ahead", "built-after-mapping"])
def test_restored_graphs_are_the_captured_ones_node_for_node(tmp_path, prepare):
    """Read back from the driver, every restored graph equals the archive's description (parameter
    bytes and addresses included), and the native twins captured in the LOAD process equal it too,
    addresses aside: no node, attribute or edge (with its type) lost or added, built ahead against
    the stand-in and re-pointed or built after the memory mapping."""
    archive, reference = tmp_path / "archive", tmp_path / "reference.pt"
    _worker("save", archive, reference)
    extra = ["--check-structure", "--replays", "3", *([] if prepare else ["--no-prepare"])]
    result, _ = _worker("load", archive, reference, *extra)
    _check_load(result)
    assert result["structure_differences"] == {}
    assert result["twin_structure_differences"] == {}
