#!/usr/bin/env bash
# Build src/foundry_core/_foundry_native.so and _foundry_nvshmem_cuda.so in place on the GPU machine (the tree travels without
# build outputs, and pip there has no network for an editable install). Same flags as setup.py.
set -u
cd "$(dirname "$0")/.."
rm -f src/foundry_core/_foundry_native*.so src/foundry_core/_foundry_nvshmem_cuda*.so
gcc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -Inative $(ls native/*.c | grep -v nvshmem_cuda.c) \
  -o src/foundry_core/_foundry_native.so -ldl -lpthread &&
  gcc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -Inative native/nvshmem_cuda.c \
    -o src/foundry_core/_foundry_nvshmem_cuda.so -ldl -lpthread
