"""Builds the one native library Foundry needs (``foundry_core._foundry_native``).

It is a plain C shared library, loaded with ctypes and by torch's pluggable-allocator
machinery; it links against nothing but libc/libdl and finds libcuda, libcupti and libz at run time,
so it builds on a machine with no CUDA toolkit.

The wheel also carries ``foundry_graphs_early.pth`` at its top, which installs into site-packages:
its one line starts a LOAD's read-ahead as Python starts, only when the command line names
``--foundry-config`` (``foundry_core/early.py`` says why).
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SITE_HOOK = "foundry_graphs_early.pth"


class BuildPyWithSiteHook(build_py):
    """build_py, and the site hook beside the packages (a .pth works only at the top of site-packages)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join("src", SITE_HOOK), os.path.join(self.build_lib, SITE_HOOK))


setup(
    cmdclass={"build_py": BuildPyWithSiteHook},
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
    ],
)
