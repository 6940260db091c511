"""A kernel that reads variables its library set at run time, and one that advances a counter in its
module: SAVE, LOAD in a fresh process, the same outputs (needs a GPU and nvcc). Before Foundry
recorded module variables, the restored kernels read the image's zeros instead."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

KERNELS = textwrap.dedent(
    """
    __device__ float scale_d;
    __constant__ float offset_c[4];
    __device__ unsigned int counter_d;
    extern "C" __global__ void scale_add(const float* x, float* y) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      y[i] = x[i] * scale_d + offset_c[i % 4];
    }
    extern "C" __global__ void bump(unsigned int* out) { out[0] = ++counter_d; }
    """
)

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, struct, sys
    import torch
    import foundry_core as fc
    from foundry_core.driver import call
    from cuda.bindings import driver as cu

    mode, cubin, archive = sys.argv[1:4]
    fc.start_recording()
    torch.zeros(1, device="cuda")
    region = fc.Region(0x600000000000, 1 << 30, 0)
    with region.routing():
        x = torch.arange(256, dtype=torch.float32, device="cuda")
        y = torch.zeros(256, dtype=torch.float32, device="cuda")
        n = torch.zeros(1, dtype=torch.int32, device="cuda")
    region.end_setup()

    def replay(graph):
        graph.replay()
        torch.cuda.synchronize()
        return {"y": y.tolist(), "n": int(n.item())}

    if mode == "save":
        # The library's own module, its variables set at run time as a library does.
        module = call(cu.cuModuleLoadData, open(cubin, "rb").read())
        for name, value in ((b"scale_d", struct.pack("<f", 3.0)), (b"offset_c", struct.pack("<4f", 0.5, 1.5, 2.5, 3.5))):
            dptr, size = call(cu.cuModuleGetGlobal, module, name)
            call(cu.cuMemcpyHtoD, dptr, value, size)
        scale_add = call(cu.cuModuleGetFunction, module, b"scale_add")
        bump = call(cu.cuModuleGetFunction, module, b"bump")
        with region.routing():
            g = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g, pool=region.graph_pool_id()):
                stream = torch.cuda.current_stream().cuda_stream
                args = ((x.data_ptr(), y.data_ptr()), (ctypes.c_void_p, ctypes.c_void_p))
                call(cu.cuLaunchKernel, scale_add, 2, 1, 1, 128, 1, 1, 0, stream, args, 0)
                call(cu.cuLaunchKernel, bump, 1, 1, 1, 1, 1, 1, 0, stream, ((n.data_ptr(),), (ctypes.c_void_p,)), 0)
        replay(g)
        replay(g)  # the counter stands at 2 when the SAVE reads it
        fc.save(archive, graphs={"g": g}, region=region, tensors={"y": y, "n": n}, detect_rng=False)
        print(json.dumps(replay(g)))  # what the next replay gives: counter 3
    else:
        restored = fc.load(archive, region=region)
        print(json.dumps({**replay(restored.graphs["g"]), "variables": restored.timings.get("variables")}))
    """
)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to build the kernels")
def test_module_variables_set_at_run_time_are_restored(tmp_path):
    src = tmp_path / "v.cu"
    src.write_text(KERNELS)
    cubin = tmp_path / "v.cubin"
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", str(src), "-o", str(cubin)], check=True)
    outputs = {}
    for mode in ("save", "load"):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode, str(cubin), str(tmp_path / "archive")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        outputs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [i * 3.0 + (0.5, 1.5, 2.5, 3.5)[i % 4] for i in range(256)]
    assert outputs["save"]["y"] == expected
    assert outputs["load"]["y"] == expected, (
        "the restored kernel read its module's variables as SAVE left them"
    )
    assert outputs["save"]["n"] == outputs["load"]["n"] == 3, outputs
    assert outputs["load"]["variables"] == 3.0  # scale_d, offset_c, counter_d
