#!/usr/bin/env bash
# One device call for benchmarks/vllm_h200.py: build the native library, then run the benchmark.
#
#   FOUNDRY_COMMIT=<hash> bash benchmarks/vllm_h200.sh "$OUT" [extra vllm_h200.py flags]
#
# Run from the repository root on the GPU machine, with vLLM's wheels installed in $FOUNDRY_SITE
# (default /tmp/site). Writes $OUT/vllm-h200.json and six logs. Exit status: the benchmark's (0 when
# every check passed), 3 when the native library does not build.
set -uo pipefail
out=${1:?usage: vllm_h200.sh OUT_DIR [flags]}
shift
site=${FOUNDRY_SITE:-/tmp/site}
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
bash benchmarks/build_native.sh || exit 3
exec "${PYTHON:-python}" benchmarks/vllm_h200.py --out "$out/vllm-h200.json" --logs "$out" "$@"
