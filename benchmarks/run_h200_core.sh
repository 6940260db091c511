#!/usr/bin/env bash
# The core GPU runs of one session on a 2-GPU H200 machine, side by side:
#   GPU 0: foundry bench (issue 3), GPU 1: foundry soak (issue 4), then the GPU tests.
# Usage on the device, from the repository root: FOUNDRY_COMMIT=<hash> bash benchmarks/run_h200_core.sh
# Everything it produces goes to $OUT (results JSON, PNG, logs).
set -u
out=${OUT:?set OUT to the results folder}
bash benchmarks/build_native.sh || exit 1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FOUNDRY_NO_PROGRESS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
budget=${FOUNDRY_RUN_BUDGET_S:-570}

(CUDA_VISIBLE_DEVICES=0 timeout $((budget - 10)) python -m foundry_core.cli bench --workdir /tmp/bench \
  --presets tiny,small --out "$out/bench-h200.json" >"$out/bench.log" 2>&1
 echo "bench rc=$?" >>"$out/bench.log") &

(CUDA_VISIBLE_DEVICES=1 timeout $((budget - 10)) python -m foundry_core.cli soak --tests tests --workdir /tmp/soak \
  --out "$out/reliability-h200.json" --replays 10000 --cycles 20 >"$out/soak.log" 2>&1
 echo "soak rc=$?" >>"$out/soak.log"
 cp /tmp/soak/cpu-suite.json "$out/" 2>/dev/null
 left=$((budget - 10 - $(date +%s) + start))
 if [ "$left" -gt 60 ]; then
   CUDA_VISIBLE_DEVICES=1 FOUNDRY_BUILDER=native timeout "$left" python -m pytest -q -m gpu tests/gpu \
     tests/test_graph_encoding_gpu.py >"$out/pytest-gpu.log" 2>&1
   echo "pytest rc=$? after $(($(date +%s) - start)) s" >>"$out/pytest-gpu.log"
 else
   echo "no time left for the GPU tests ($left s)" >"$out/pytest-gpu.log"
 fi) &
wait
tail -n 25 "$out/bench.log"; tail -n 25 "$out/soak.log"; tail -n 8 "$out/pytest-gpu.log"
