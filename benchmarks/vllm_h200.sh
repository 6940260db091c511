#!/usr/bin/env bash
# One device call for benchmarks/vllm_h200.py: build the native library, then run the benchmark.
#
#   FOUNDRY_COMMIT=<hash> bash benchmarks/vllm_h200.sh "$OUT" [extra vllm_h200.py flags]
#
# Run from the repository root on the GPU machine, with vLLM's wheels installed in $FOUNDRY_SITE
# (default /tmp/site). Writes $OUT/vllm-h200.json and six logs. Exit status: the benchmark's (0 when
# every check passed), 3 when the native library does not build. With the defaults (Qwen3-1.7B shape,
# max_num_seqs 512 and vLLM's 51 default decode graphs, 64 prompts x 512 tokens x 5 repetitions per
# run) it takes about 350 s of its --budget (default 570 s: one 600 s device call); the former small
# setup: add --model-config examples/qwen3-tiny/config.json --max-bs 8.
set -uo pipefail
out=${1:?usage: vllm_h200.sh OUT_DIR [flags]}
shift
site=${FOUNDRY_SITE:-/tmp/site}
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
bash benchmarks/build_native.sh || exit 3
exec "${PYTHON:-python}" benchmarks/vllm_h200.py --out "$out/vllm-h200.json" --logs "$out" "$@"
