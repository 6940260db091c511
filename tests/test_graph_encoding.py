"""FGB1, the binary graph encoding, on the CPU: round trips, the native validator's refusals (every
truncation, byte flips, bad indices) and the C structures against a real cuda.h where one exists."""

import base64
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from foundry_core import _native, graph_build, graph_codec, graphs

KERNELS = [["img-a", "k_add", {}], ["img-a", "k_mul", {}], ["img-b", "nvjet", {}]]
IDS = graph_codec.kernel_ids(KERNELS)
ROOT = Path(__file__).resolve().parents[1]
CUDA_INCLUDE = Path("/usr/local/cuda/include")


def _kernel(name, image, layout, seed, attrs=None):
    total = max((o + s for o, s in layout), default=0)
    params = bytes((seed * 31 + i) % 256 for i in range(total))
    return {
        "type": "kernel",
        "image": image,
        "name": name,
        "grid": [seed + 1, 2, 1],
        "block": [128, 1, 1],
        "smem": 1024 * seed,
        "layout": [list(p) for p in layout],
        "params": base64.b64encode(params).decode(),
        "attrs": attrs or {},
    }


def _desc():
    child = {
        "nodes": [_kernel("k_mul", "img-a", [(0, 8)], 7), {"type": "empty"}],
        "edges": [[0, 1, 0, 0, 0]],
    }
    return {
        "nodes": [
            _kernel("k_add", "img-a", [(0, 8), (8, 4), (16, 8)], 1),
            _kernel(
                "k_add",
                "img-a",
                [(0, 8), (8, 4), (16, 8)],
                2,
                {
                    "priority": -3,
                    "cluster_dim": [2, 1, 1],
                    "mem_sync_domain_map": [0, 1],
                    "preferred_carveout": 4294967295,
                },
            ),
            _kernel("nvjet", "img-b", [(0, 600)], 3, {"cooperative": 1, "mem_sync_domain": 1}),
            _kernel("k_mul", "img-a", [], 4),
            {
                "type": "memset",
                "dst": 0x600000001000,
                "pitch": 0,
                "value": 0xDEADBEEF,
                "element_size": 4,
                "width": 256,
                "height": 1,
            },
            {
                "type": "memcpy",
                "src": 0x600000002000,
                "dst": 0x600000003000,
                "src_xy": [0, 0, 0],
                "dst_xy": [16, 0, 0],
                "src_pitch": [0, 0],
                "dst_pitch": [0, 0],
                "extent": [4096, 1, 1],
                "kinds": [2, 4],
            },
            {"type": "event_record", "event": 0},
            {"type": "event_wait", "event": 1},
            {"type": "graph", "graph": child},
            {"type": "graph", "graph": {"nodes": [{"type": "empty"}], "edges": []}},
        ],
        "edges": [
            [0, 1, 0, 0, 0],
            [1, 2, 1, 0, 1],  # a programmatic edge with its own data
            [2, 3, 0, 0, 0],
            [3, 4, 0, 0, 0],
            [4, 5, 0, 0, 0],
            [5, 6, 0, 0, 0],
            [6, 7, 0, 0, 0],
            [7, 8, 0, 0, 0],
            [8, 9, 0, 0, 0],
        ],
        "events": 2,
    }


def _native_or_skip():
    if _native.graph_lib() is None:
        pytest.skip("the native library is not installed (pip install -e .)")


def test_round_trip_is_exact():
    desc = _desc()
    data = graph_codec.encode(desc, IDS)
    assert data[:4] == b"FGB1"
    assert graph_codec.decode(data, KERNELS) == desc
    assert graph_codec.encoded_events(data) == 2
    # A kernel's layout is stored once, not per node.
    assert len(data) < 2000


def test_native_validator_counts():
    _native_or_skip()
    desc = _desc()
    counts = graph_codec.validate_encoding(graph_codec.encode(desc, IDS), len(KERNELS), 2)
    assert counts == {
        "graphs": 3,
        "nodes": graphs.count_nodes(desc),
        "edges": 10,
        "kernels": 4,  # (k_add, 3 params), (k_mul, 1), (nvjet, 1), (k_mul, 0)
        "events": 2,
    }


def test_native_refuses_every_truncation_and_extra_bytes():
    _native_or_skip()
    data = graph_codec.encode(_desc(), IDS)
    for n in range(len(data)):
        with pytest.raises(graph_codec.EncodingError):
            graph_codec.validate_encoding(data[:n], len(KERNELS), 2)
        with pytest.raises(graph_codec.EncodingError):
            graph_codec.decode(data[:n], KERNELS)
    with pytest.raises(graph_codec.EncodingError, match="after its last graph"):
        graph_codec.validate_encoding(data + b"\0", len(KERNELS), 2)


def test_native_refuses_bad_references():
    _native_or_skip()
    data = graph_codec.encode(_desc(), IDS)
    with pytest.raises(graph_codec.EncodingError, match="names function 2, only 2"):
        graph_codec.validate_encoding(data, 2, 2)
    with pytest.raises(graph_codec.EncodingError, match="uses 2 events, 1 were given"):
        graph_codec.validate_encoding(data, len(KERNELS), 1)
    with pytest.raises(graph_codec.EncodingError, match="FGB1 magic"):
        graph_codec.validate_encoding(b"JSON" + data[4:], len(KERNELS), 2)
    with pytest.raises(graph_codec.EncodingError, match="version 2"):
        graph_codec.validate_encoding(data[:4] + (2).to_bytes(4, "little") + data[8:], len(KERNELS), 2)
    bad_edge = {"nodes": [{"type": "empty"}], "edges": [[0, 0, 0, 0, 0]]}
    raw = bytearray(graph_codec.encode(bad_edge, IDS))
    raw[-12:-8] = (5).to_bytes(4, "little")  # edge from node 5 of 1
    with pytest.raises(graph_codec.EncodingError, match="edge 0: 5 -> 0"):
        graph_codec.validate_encoding(bytes(raw), len(KERNELS), 0)
    with pytest.raises(graph_codec.EncodingError):
        graph_codec.decode(bytes(raw), KERNELS)


def test_native_survives_random_damage():
    """Flipped bytes are either refused with a message or still describe a well-formed graph."""
    _native_or_skip()
    data = graph_codec.encode(_desc(), IDS)
    rng = random.Random(1234)
    for _ in range(3000):
        raw = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            graph_codec.validate_encoding(bytes(raw), len(KERNELS), 2)
        except graph_codec.EncodingError as e:
            assert str(e)
            continue
        graph_codec.decode(bytes(raw), KERNELS)  # what C accepts, Python reads too


def test_encode_refuses_what_it_cannot_store():
    with pytest.raises(graph_codec.EncodingError, match="not in the archive's kernel list"):
        graph_codec.encode({"nodes": [_kernel("other", "img-a", [(0, 8)], 1)], "edges": []}, IDS)
    bad = _kernel("k_add", "img-a", [(0, 8)], 1)
    bad["params"] = base64.b64encode(b"1234").decode()
    with pytest.raises(graph_codec.EncodingError, match="4 parameter bytes, the layout needs 8"):
        graph_codec.encode({"nodes": [bad], "edges": []}, IDS)
    with pytest.raises(graph_codec.EncodingError, match="event slot 0 of 0"):
        graph_codec.encode({"nodes": [{"type": "event_record", "event": 0}], "edges": []}, IDS)
    with pytest.raises(graph_codec.EncodingError, match="unknown node type"):
        graph_codec.encode({"nodes": [{"type": "host"}], "edges": []}, IDS)
    for field, index, value, message in (
        ("grid", 0, -1, "grid = -1 does not fit 32 bits"),
        ("block", 2, 1 << 32, "block = 4294967296 does not fit 32 bits"),
        ("grid", 1, 2.0, "grid = 2.0 does not fit 32 bits"),
        ("smem", None, -4, "smem = -4 does not fit 32 bits"),
    ):
        bad = _kernel("k_add", "img-a", [(0, 8)], 1)
        if index is None:
            bad[field] = value
        else:
            bad[field][index] = value
        with pytest.raises(graph_codec.EncodingError, match=f"graph 0 node 0 {message}"):
            graph_codec.encode({"nodes": [bad], "edges": []}, IDS)


def test_a_layout_shared_by_nodes_is_checked_and_stored_like_separate_ones():
    """serialize gives the nodes of one function the same layout list; encode checks it once."""
    desc = _desc()
    shared = desc["nodes"][0]["layout"]
    desc["nodes"][1]["layout"] = shared
    assert graph_codec.encode(desc, IDS) == graph_codec.encode(_desc(), IDS)
    bad = [_kernel("k_add", "img-a", [(0, 8)], 1), _kernel("k_add", "img-a", [(0, 8)], 2)]
    bad[1]["layout"] = bad[0]["layout"]
    bad[1]["params"] = base64.b64encode(b"1234").decode()  # the shared layout still sizes each node
    with pytest.raises(graph_codec.EncodingError, match="node 1: 4 parameter bytes, the layout needs 8"):
        graph_codec.encode({"nodes": bad, "edges": []}, IDS)


def test_builder_choice(monkeypatch):
    monkeypatch.delenv("FOUNDRY_BUILDER", raising=False)
    assert graph_build.builder_choice() == "auto"
    monkeypatch.setenv("FOUNDRY_BUILDER", "python")
    assert graph_build.builder_choice() == "python"
    monkeypatch.setenv("FOUNDRY_BUILDER", "fast")
    with pytest.raises(graphs.GraphError, match="FOUNDRY_BUILDER"):
        graph_build.builder_choice()


def test_read_description_both_forms():
    desc = {**_desc(), "rng": {"increment": 4, "seed_ptr": 1, "offset_ptr": 2}}

    class FakeArchive:
        meta = {"kernels": KERNELS}
        files = {"g.bin": graph_codec.encode({k: v for k, v in desc.items() if k != "rng"}, IDS)}

        def read_bytes(self, rel):
            return self.files[rel]

        def read_json(self, rel):
            return desc

    entry = {"name": "bs1", "file": "g.bin", "encoding": graph_codec.ENCODING, "rng_state": desc["rng"]}
    assert graph_codec.read_description(FakeArchive(), entry) == desc
    assert graph_codec.read_description(FakeArchive(), {"name": "bs1", "file": "g.json"}) == desc


# (our declaration, the toolkit's)
ABI = [
    ("sizeof(foundry_kernel_node_params)", "sizeof(CUDA_KERNEL_NODE_PARAMS_v2)"),
    (
        "offsetof(foundry_kernel_node_params, kernelParams)",
        "offsetof(CUDA_KERNEL_NODE_PARAMS_v2, kernelParams)",
    ),
    ("offsetof(foundry_kernel_node_params, kern)", "offsetof(CUDA_KERNEL_NODE_PARAMS_v2, kern)"),
    ("offsetof(foundry_kernel_node_params, ctx)", "offsetof(CUDA_KERNEL_NODE_PARAMS_v2, ctx)"),
    ("sizeof(foundry_memset_node_params)", "sizeof(CUDA_MEMSET_NODE_PARAMS_v1)"),
    ("offsetof(foundry_memset_node_params, value)", "offsetof(CUDA_MEMSET_NODE_PARAMS_v1, value)"),
    ("offsetof(foundry_memset_node_params, width)", "offsetof(CUDA_MEMSET_NODE_PARAMS_v1, width)"),
    ("sizeof(foundry_memcpy3d)", "sizeof(CUDA_MEMCPY3D_v2)"),
    ("offsetof(foundry_memcpy3d, srcMemoryType)", "offsetof(CUDA_MEMCPY3D_v2, srcMemoryType)"),
    ("offsetof(foundry_memcpy3d, srcDevice)", "offsetof(CUDA_MEMCPY3D_v2, srcDevice)"),
    ("offsetof(foundry_memcpy3d, srcPitch)", "offsetof(CUDA_MEMCPY3D_v2, srcPitch)"),
    ("offsetof(foundry_memcpy3d, dstMemoryType)", "offsetof(CUDA_MEMCPY3D_v2, dstMemoryType)"),
    ("offsetof(foundry_memcpy3d, dstDevice)", "offsetof(CUDA_MEMCPY3D_v2, dstDevice)"),
    ("offsetof(foundry_memcpy3d, dstPitch)", "offsetof(CUDA_MEMCPY3D_v2, dstPitch)"),
    ("offsetof(foundry_memcpy3d, WidthInBytes)", "offsetof(CUDA_MEMCPY3D_v2, WidthInBytes)"),
    ("offsetof(foundry_memcpy3d, Depth)", "offsetof(CUDA_MEMCPY3D_v2, Depth)"),
    ("sizeof(foundry_edge_data)", "sizeof(CUgraphEdgeData)"),
    ("offsetof(foundry_edge_data, type)", "offsetof(CUgraphEdgeData, type)"),
    ("sizeof(foundry_launch_attr_value)", "sizeof(CUlaunchAttributeValue)"),
    (
        "offsetof(foundry_launch_attr_value, map.remote)",
        "offsetof(CUlaunchAttributeValue, memSyncDomainMap.remote)",
    ),
    ("offsetof(foundry_launch_attr_value, dim.z)", "offsetof(CUlaunchAttributeValue, clusterDim.z)"),
    ("FOUNDRY_ATTR_COOPERATIVE", "CU_LAUNCH_ATTRIBUTE_COOPERATIVE"),
    ("FOUNDRY_ATTR_CLUSTER_DIMENSION", "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION"),
    (
        "FOUNDRY_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE",
        "CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE",
    ),
    ("FOUNDRY_ATTR_PRIORITY", "CU_LAUNCH_ATTRIBUTE_PRIORITY"),
    ("FOUNDRY_ATTR_MEM_SYNC_DOMAIN_MAP", "CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN_MAP"),
    ("FOUNDRY_ATTR_MEM_SYNC_DOMAIN", "CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN"),
    ("FOUNDRY_ATTR_PREFERRED_CLUSTER_DIMENSION", "CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION"),
    ("FOUNDRY_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT", "CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT"),
]


def _print_values(tmp_path, name, include, exprs):
    body = "\n".join(f'  printf("%lld\\n", (long long)({e}));' for e in exprs)
    src = tmp_path / f"{name}.c"
    src.write_text(
        f"#include <stddef.h>\n#include <stdio.h>\n{include}\nint main(void) {{\n{body}\n  return 0;\n}}\n"
    )
    exe = tmp_path / name
    subprocess.run(
        ["cc", "-std=c11", f"-I{ROOT / 'native'}", f"-I{CUDA_INCLUDE}", str(src), "-o", str(exe)], check=True
    )
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()


@pytest.mark.skipif(
    not (CUDA_INCLUDE / "cuda.h").exists() or shutil.which("cc") is None,
    reason="no CUDA toolkit headers or cc",
)
def test_graphbuild_h_matches_cuda_h(tmp_path):
    ours = _print_values(tmp_path, "ours", '#include "graphbuild.h"', [a for a, _ in ABI])
    theirs = _print_values(tmp_path, "theirs", "#include <cuda.h>", [b for _, b in ABI])
    assert dict(zip([a for a, _ in ABI], ours)) == dict(zip([a for a, _ in ABI], theirs))


def test_attribute_ids_match_python_table():
    header = (ROOT / "native" / "graphbuild.h").read_text()
    for key, (attr_id, _field) in graphs.NODE_ATTRIBUTES.items():
        assert f" {attr_id}\n" in header, key
    assert set(graph_codec._ATTR_IDS.values()) == {2, 4, 5, 8, 9, 10, 11, 14}


def test_parameters_as_bytes_encode_as_their_base64_form_and_json_gets_text():
    """The SAVE walk leaves each kernel's parameters as bytes (no base64 round trip per node): the
    encoding is the same as from the base64 form, and the JSON form gets base64 text back."""
    import json

    desc = _desc()
    as_bytes = json.loads(json.dumps(desc))

    def to_bytes(graph):
        for node in graph["nodes"]:
            if node["type"] == "kernel":
                node["params"] = base64.b64decode(node["params"])
            elif node["type"] == "graph":
                to_bytes(node["graph"])

    to_bytes(as_bytes)
    assert isinstance(as_bytes["nodes"][-2]["graph"]["nodes"][0]["params"], bytes)  # a child's kernel
    assert graph_codec.encode(as_bytes, IDS) == graph_codec.encode(desc, IDS)
    assert graphs.json_form(as_bytes) == desc
    json.dumps(graphs.json_form(as_bytes))  # JSON-able again
    assert graphs.param_bytes(desc["nodes"][0]["params"]) == as_bytes["nodes"][0]["params"]
