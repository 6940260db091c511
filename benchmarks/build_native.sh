#!/usr/bin/env bash
# Build src/foundry_core/_foundry_native.so and _foundry_nvshmem_cuda.so in place on the GPU machine
# (the tree travels without build outputs, and pip there has no network for an editable install).
# Same flags as setup.py.
set -u
cd "$(dirname "$0")/.."
rm -f src/foundry_core/_foundry_native*.so src/foundry_core/_foundry_nvshmem_cuda*.so
cc="gcc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -Inative"
# nvshmem_cuda.c is a library of its own (the libcuda.so.1 NVSHMEM is pointed at), as in setup.py.
$cc $(ls native/*.c | grep -v nvshmem_cuda.c) -o src/foundry_core/_foundry_native.so -ldl -lpthread &&
  $cc native/nvshmem_cuda.c -o src/foundry_core/_foundry_nvshmem_cuda.so -ldl -lpthread
