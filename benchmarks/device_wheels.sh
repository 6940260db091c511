#!/usr/bin/env bash
# Here (not on the device): the current engines' wheel sets for the GPU machine, cut into pieces that
# one device call carries, and the lists benchmarks/device_site.sh installs from.
#   bash benchmarks/device_wheels.sh            # both engines
#   bash benchmarks/device_wheels.sh sglang     # one
#   PIECE_MIB=56 bash benchmarks/device_wheels.sh sglang   # pieces of a given size
# Downloads each engine's resolved list (../shared/tools/device-wheels/lists: SGLang 0.5.23 with
# torch 2.14.1 and upstream foundry-core 0.1.0rc3; vLLM 0.33.0 with torch 2.14.0) with that folder's
# fetch.sh into .devwheels/dl-<engine>/cache, then writes
#   .devwheels/lists/<engine>.list   the engine's wheel file names (carry .devwheels/lists)
#   .devwheels/lists/peer.list       upstream Foundry's wheel, installed into a site of its own: it
#                                    registers an SGLang plugin, so it must never sit in stock's site
#   .devwheels/parts-<engine>/part-* the set in pieces; send each with its own call, carrying only it:
#     run(command="mkdir -p /tmp/dw && cp .devwheels/parts-sglang/* /tmp/dw/ && ls /tmp/dw | wc -l",
#         carry=[".devwheels/parts-sglang/part-aa"])
#   and never pieces of two sets to one machine (device_site.sh concatenates every /tmp/dw/part-*).
# Left out of every set (DROP below): NVSHMEM (the image holds the same 3.4.5), wheels whose
# libraries the device image already holds under the same soname for its CUDA 13 torch (cuDNN, cuFFT, cuRAND, cuSOLVER, cuSPARSE, cuSPARSELt: torch 2.14
# preloads each from the first site on sys.path that has it, the image's when ours lacks it; none is
# on a decode step's path), the CUDA 12 build of the CUTLASS DSL libraries (the device runs CUDA 13),
# and media and solver wheels no serving start imports (torchcodec, PyNvVideoCodec, z3).
# A call carries the whole tracked tree beside its piece and the device takes 64 MiB in all: pieces
# are cut to what the tree leaves, less 4 MiB of margin.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shared=../shared/tools/device-wheels
DROP='^(nvidia_nvshmem_cu13|nvidia_cudnn_cu13|nvidia_cufft|nvidia_curand|nvidia_cusolver|nvidia_cusparse|nvidia_cusparselt_cu13|nvidia_cutlass_dsl_libs_cu12|torchcodec|pynvvideocodec|z3_solver)-'
PEER='^foundry_core-'
grep -qx '/.devwheels/' .git/info/exclude 2>/dev/null || echo /.devwheels/ >>.git/info/exclude
mkdir -p .devwheels/lists
# (files moved out of the checkout for a lease do not travel: du skips them)
tree_bytes=$(git ls-files -z | du --files0-from=- -cb 2>/dev/null | tail -n 1 | cut -f1) || true
tree_mib=$((tree_bytes / 1048576 + 1))
piece=$((64 - tree_mib - 4))
# PIECE_MIB: the size itself, for a lease whose calls carry a smaller tree than the checkout's
piece=${PIECE_MIB:-$piece}
[ "$piece" -ge 16 ] || { echo "the tracked tree takes ${tree_mib} MiB: too little is left for a piece" >&2; exit 1; }
for engine in "${@:-sglang vllm}"; do
  for e in $engine; do
    list=$(ls "$shared/lists" | grep "^$e-" | sort -V | tail -n 1)
    dl=.devwheels/dl-$e
    bash "$shared/fetch.sh" "$shared/lists/$list" "$dl" >/dev/null
    rm -rf "$dl/parts" ".devwheels/parts-$e" "$dl/send" && mkdir -p ".devwheels/parts-$e" "$dl/send"
    ls "$dl/cache" | grep '\.whl$' | grep -Eiv "$DROP" >"$dl/keep"
    grep -Ev "$PEER" "$dl/keep" >".devwheels/lists/$e.list"
    # only the set that holds upstream's wheel (SGLang's) writes its list
    if grep -Eq "$PEER" "$dl/keep"; then grep -E "$PEER" "$dl/keep" >.devwheels/lists/peer.list; fi
    while read -r w; do ln -f "$dl/cache/$w" "$dl/send/$w"; done <"$dl/keep"
    tar -cf - -C "$dl/send" . | split -b "${piece}m" - ".devwheels/parts-$e/part-"
    echo "$e ($list): $(wc -l <"$dl/keep") wheels, $(du -sh "$dl/send" | cut -f1)," \
      "$(ls ".devwheels/parts-$e" | wc -l) pieces of ${piece} MiB; left out: $(ls "$dl/cache" | grep -Eic "$DROP")"
  done
done
