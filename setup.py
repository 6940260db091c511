"""Builds the one native library Foundry needs (``foundry_core._foundry_native``).

It is a plain C shared library, loaded with ctypes and by torch's pluggable-allocator
machinery; it links against nothing but libc/libdl and finds libcuda, libcupti and libz at run time,
so it builds on a machine with no CUDA toolkit.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "foundry_core._foundry_native",
            sources=[
                "native/driver.c",
                "native/region.c",
                "native/modules.c",
                "native/graphbuild.c",
                "native/inflate.c",
                "native/symmetric.c",
            ],
            include_dirs=["native"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"],
            libraries=["dl", "pthread"],
        ),
        # The libcuda.so.1 NVSHMEM is pointed at to place its symmetric heap (native/nvshmem_cuda.c):
        # a library of its own, since its cuInit must never stand in for the driver's elsewhere.
        Extension(
            "foundry_core._foundry_nvshmem_cuda",
            sources=["native/nvshmem_cuda.c"],
            include_dirs=["native"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"],
            libraries=["dl", "pthread"],
        ),
    ]
)
