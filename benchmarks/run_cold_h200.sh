#!/usr/bin/env bash
# One engine's cold/warm start benchmark (benchmarks/cold_start.py) on the GPU machine, in one call.
# The wheel set was sent beforehand as tar pieces into /tmp/dw (made here by benchmarks/device_wheels.sh);
# .devwheels/lists/<engine>.list names the engine's wheels (carry .devwheels/lists).
# Usage on the device, from the repository root:
#   FOUNDRY_COMMIT=<hash> bash benchmarks/run_cold_h200.sh sglang|vllm [seconds]
# The result is kept in /tmp/cold-results between calls on the same machine (every call empties
# $OUT), so COLD_ARGS="--runs load_warm,stock_warm --resume" adds the warm runs in a later call.
# RESUME_FROM=<a result JSON of this commit, carried in the tree> starts /tmp/cold-results from it on a
# fresh machine, so that runs which need no archive (stock_cold) join a SAVE and LOAD measured in an
# earlier lease: COLD_ARGS="--runs stock_cold --resume ..." (the same options otherwise).
# NAME (default cold-<engine>-h200) names the result files, e.g. for the model runs:
#   NAME=models-sglang-moe-h200 COLD_ARGS="--runs save,load_cold,stock_cold --weights seeded
#   --model-config benchmarks/configs/qwen3-moe-4l.json --sampling" bash benchmarks/run_cold_h200.sh sglang
set -u
engine=${1:?sglang or vllm}
limit=${2:-590}
out=${OUT:?set OUT to the results folder}
t0=$(date +%s)
results=/tmp/cold-results
name=${NAME:-cold-$engine-h200}
# Logs and workdir (model, archive, homes) per result name: two benchmarks in one lease must not
# share an archive (a MoE SAVE once replaced the hybrid model's archive before its LOAD ran).
logs=/tmp/cold-logs-$name
mkdir -p "$logs" "$results"
if [ -n "${RESUME_FROM:-}" ] && [ ! -f "$results/$name.json" ]; then
  cp "$RESUME_FROM" "$results/$name.json" || exit 5
fi
source benchmarks/device_site.sh
site=/tmp/site-$engine
engine_ready "$engine" "$logs" "$t0"  # exits 2 (install) or 3 (native build) on failure
left=$((limit - $(date +%s) + t0 - 15))
PYTHONPATH=$site:$PWD/src timeout "$left" python3 benchmarks/cold_start.py --engine "$engine" \
  --out "$results/$name.json" --logs "$logs" --workdir "/tmp/cold-$name" \
  --budget $((left - 10)) --timeout "${RUN_TIMEOUT:-240}" ${COLD_ARGS:-}
echo "cold_start rc=$?"
cp "$results/$name".* "$out/"
tar -czf "$out/$name-logs.tar.gz" -C "$logs" .
