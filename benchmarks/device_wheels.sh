#!/usr/bin/env bash
# Here (not on the device): the engines' wheel sets for the GPU machine, cut into pieces that one
# device call carries, and the lists benchmarks/device_site.sh installs from.
#   bash benchmarks/device_wheels.sh
# Downloads each engine's resolved list (../shared/tools/device-wheels/lists) with that folder's
# fetch.sh into .devwheels/<engine>/cache, then writes
#   .devwheels/lists/<engine>.list   the engine's wheel file names (carry .devwheels/lists)
#   .devwheels/parts-<engine>/part-* one engine's wheels in pieces (40 MiB on 2026-12-03: SGLang 27,
#                                    vLLM 23): a lease that runs one engine sends only these
#   .devwheels/parts-both/part-*     both engines' wheels (37 pieces): a lease that runs both
# A call carries the whole tracked tree (~20 MB on 2026-12-03, mostly benchmarks/results, whose large
# results cold_start.results_text writes with number lists on one line) beside its
# piece, and the device refuses more than 64 MiB in all: the pieces are cut to what the tree leaves
# (less 4 MiB of margin), at most 44 MiB. Cut them again when benchmarks/results has grown.
# Send each piece of one set with its own call, carrying only that piece, e.g.
#   run(command="mkdir -p /tmp/dw && cp .devwheels/parts-sglang/* /tmp/dw/ && ls /tmp/dw | wc -l",
#       carry=[".devwheels/parts-sglang/part-aa"])
# and never pieces of two sets to one machine (device_site.sh concatenates every /tmp/dw/part-*).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shared=../shared/tools/device-wheels
grep -qx '/.devwheels/' .git/info/exclude 2>/dev/null || echo /.devwheels/ >>.git/info/exclude
mkdir -p .devwheels/lists .devwheels/union
tree_mib=$(($(git ls-files -z | du --files0-from=- -cb | tail -n 1 | cut -f1) / 1048576 + 1))
piece=$((64 - tree_mib - 4))
[ "$piece" -gt 44 ] && piece=44
[ "$piece" -ge 16 ] || { echo "the tracked tree takes ${tree_mib} MiB: too little is left for a piece" >&2; exit 1; }
piece=${piece}m
for engine in sglang vllm; do
  list=$(ls "$shared/lists" | grep "^$engine-")
  bash "$shared/fetch.sh" "$shared/lists/$list" ".devwheels/$engine" >/dev/null
  rm -rf ".devwheels/$engine/parts"
  ls ".devwheels/$engine/cache" | grep '\.whl$' >".devwheels/lists/$engine.list"
  cp -ln ".devwheels/$engine/cache/"*.whl .devwheels/union/ 2>/dev/null || true
  rm -rf ".devwheels/parts-$engine" && mkdir -p ".devwheels/parts-$engine"
  tar -cf - -C ".devwheels/$engine/cache" . | split -b "$piece" - ".devwheels/parts-$engine/part-"
done
rm -rf .devwheels/parts50 .devwheels/parts-both && mkdir -p .devwheels/parts-both
tar -cf - -C .devwheels/union . | split -b "$piece" - .devwheels/parts-both/part-
for set in parts-sglang parts-vllm parts-both; do echo "$set: $(ls .devwheels/$set | wc -l) pieces"; done
