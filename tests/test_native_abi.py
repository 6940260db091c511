"""native/cuda_min.h declares the CUDA/CUPTI types Foundry uses instead of including a toolkit.

Where a CUDA toolkit is installed, compile two tiny programs, one against our declarations and one
against the real headers, and compare every size, offset and constant they print.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_INCLUDE = Path("/usr/local/cuda/include")

# (expression in our names, expression in the toolkit's names)
CHECKS = [
    ("sizeof(CUmemLocation)", "sizeof(CUmemLocation)"),
    ("sizeof(CUmemAllocationProp)", "sizeof(CUmemAllocationProp)"),
    ("offsetof(CUmemAllocationProp, location)", "offsetof(CUmemAllocationProp, location)"),
    (
        "offsetof(CUmemAllocationProp, win32HandleMetaData)",
        "offsetof(CUmemAllocationProp, win32HandleMetaData)",
    ),
    ("offsetof(CUmemAllocationProp, allocFlags)", "offsetof(CUmemAllocationProp, allocFlags)"),
    ("sizeof(CUmemAccessDesc)", "sizeof(CUmemAccessDesc)"),
    ("offsetof(CUmemAccessDesc, flags)", "offsetof(CUmemAccessDesc, flags)"),
    ("CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_ALLOCATION_TYPE_PINNED"),
    ("CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_LOCATION_TYPE_DEVICE"),
    ("CU_MEM_ACCESS_FLAGS_PROT_READWRITE", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE"),
    ("CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_MINIMUM"),
    ("sizeof(CUpti_ResourceData)", "sizeof(CUpti_ResourceData)"),
    ("offsetof(CUpti_ResourceData, resourceDescriptor)", "offsetof(CUpti_ResourceData, resourceDescriptor)"),
    ("sizeof(CUpti_ModuleResourceData)", "sizeof(CUpti_ModuleResourceData)"),
    ("offsetof(CUpti_ModuleResourceData, cubinSize)", "offsetof(CUpti_ModuleResourceData, cubinSize)"),
    ("offsetof(CUpti_ModuleResourceData, pCubin)", "offsetof(CUpti_ModuleResourceData, pCubin)"),
    ("sizeof(CUpti_CallbackData)", "sizeof(CUpti_CallbackData)"),
    ("offsetof(CUpti_CallbackData, functionParams)", "offsetof(CUpti_CallbackData, functionParams)"),
    (
        "offsetof(CUpti_CallbackData, functionReturnValue)",
        "offsetof(CUpti_CallbackData, functionReturnValue)",
    ),
    ("offsetof(foundry_module_load_params, module)", "offsetof(cuModuleLoadData_params, module)"),
    ("CUPTI_CB_DOMAIN_DRIVER_API", "CUPTI_CB_DOMAIN_DRIVER_API"),
    ("CUPTI_CB_DOMAIN_RUNTIME_API", "CUPTI_CB_DOMAIN_RUNTIME_API"),
    ("CUPTI_CB_DOMAIN_RESOURCE", "CUPTI_CB_DOMAIN_RESOURCE"),
    ("CUPTI_API_ENTER", "CUPTI_API_ENTER"),
    ("CUPTI_API_EXIT", "CUPTI_API_EXIT"),
    ("CUPTI_CBID_RESOURCE_MODULE_LOADED", "CUPTI_CBID_RESOURCE_MODULE_LOADED"),
]
CBIDS = [
    "CUPTI_DRIVER_TRACE_CBID_cuModuleLoad",
    "CUPTI_DRIVER_TRACE_CBID_cuModuleLoadData",
    "CUPTI_DRIVER_TRACE_CBID_cuModuleLoadDataEx",
    "CUPTI_DRIVER_TRACE_CBID_cuModuleLoadFatBinary",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_ptsz",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCapture_v2_ptsz",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph",
    "CUPTI_DRIVER_TRACE_CBID_cuStreamBeginCaptureToGraph_ptsz",
    "CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000",
    "CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_ptsz_v10000",
    "CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_v12030",
    "CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCaptureToGraph_ptsz_v12030",
]


def _run(tmp_path, name, includes, exprs):
    body = "\n".join(f'  printf("%lld\\n", (long long)({e}));' for e in exprs)
    src = tmp_path / f"{name}.c"
    src.write_text(
        f"#include <stddef.h>\n#include <stdio.h>\n{includes}\nint main(void) {{\n{body}\n  return 0;\n}}\n"
    )
    exe = tmp_path / name
    subprocess.run(
        ["cc", "-std=c11", f"-I{ROOT / 'native'}", f"-I{CUDA_INCLUDE}", str(src), "-o", str(exe)], check=True
    )
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()


@pytest.mark.skipif(
    not (CUDA_INCLUDE / "cupti.h").exists(), reason="no CUDA toolkit headers to compare against"
)
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_declarations_match_toolkit_headers(tmp_path):
    ours = _run(tmp_path, "ours", '#include "cuda_min.h"', [a for a, _ in CHECKS] + CBIDS)
    real = _run(
        tmp_path,
        "real",
        "#include <cuda.h>\n#include <cupti.h>",
        [b for _, b in CHECKS] + CBIDS,
    )
    names = [a for a, _ in CHECKS] + CBIDS
    diffs = [(n, o, r) for n, o, r in zip(names, ours, real) if o != r]
    assert not diffs, diffs
