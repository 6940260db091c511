#!/usr/bin/env bash
# Build src/foundry_core/_foundry_native.so in place on the GPU machine (the tree travels without
# build outputs, and pip there has no network for an editable install). Same flags as setup.py.
set -u
cd "$(dirname "$0")/.."
rm -f src/foundry_core/_foundry_native*.so
gcc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -Inative native/*.c \
  -o src/foundry_core/_foundry_native.so -ldl -lpthread
