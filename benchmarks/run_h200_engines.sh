#!/usr/bin/env bash
# Real engines on the GPU machine in one call:
#   benchmarks/sglang_h200.py (SGLang 0.5.17: stock, SAVE, LOAD)
#   benchmarks/vllm_h200.py   (vLLM 0.26.0: SAVE, stock, LOAD)
# ENGINES picks them (default "sglang vllm"). With as many GPUs as engines and ENGINES_PARALLEL=1
# they run side by side, one per GPU; otherwise one after the other on GPU 0, alone on the host,
# which is what a decode-throughput comparison needs (the decode loop is host-bound, so a
# neighbour's CPU load shows up in tokens per second).
# With the benchmarks' defaults (Qwen3-1.7B shape, the engines' default decode graphs, 64 prompts x
# 512 tokens x 5 repetitions per run) one engine takes most of a 600 s call (SGLang about 450 s,
# vLLM about 350 s): on one GPU run one engine per call (ENGINES=sglang, then ENGINES=vllm, on the
# same warm machine so the wheels stay installed). Two engines one after the other on one GPU are
# refused unless ENGINE_S gives each its seconds or ENGINES_FORCE=1 (e.g. with the former small
# setup: SGLANG_ARGS/VLLM_ARGS="--model-config examples/qwen3-tiny/config.json --max-bs 8").
# Wheels: the union of both wheel sets was sent beforehand as tar pieces into /tmp/dw (see
# ../shared/tools/device-wheels); .devwheels/lists/{sglang,vllm}.list name each engine's wheels.
# Each engine gets its own --target site, so their pins never meet.
# Usage on the device, from the repository root:
#   FOUNDRY_COMMIT=<hash> ENGINES=sglang bash benchmarks/run_h200_engines.sh
# Also: SGLANG_ARGS / VLLM_ARGS (extra flags of each script), ENGINES_BUDGET_S (default 585: the
# whole call, install included), KEEP_WORK=1 (the work directory outlives the call, see run_engine).
# The engine sites are byte-compiled at install (device_site.sh).
set -u
out=${OUT:?set OUT to the results folder}
engines=${ENGINES:-sglang vllm}
logs=/tmp/engine-logs
mkdir -p "$logs"
t0=$(date +%s)
n_engines=$(echo $engines | wc -w)
n_gpus=$(nvidia-smi --list-gpus | wc -l)
if [ "$n_engines" -gt 1 ] && ! { [ "${ENGINES_PARALLEL:-0}" = 1 ] && [ "$n_gpus" -ge "$n_engines" ]; } &&
  [ -z "${ENGINE_S:-}" ] && [ "${ENGINES_FORCE:-0}" != 1 ]; then
  echo "ENGINES='$engines' one after the other do not fit one call with the default model:" \
    "run one engine per call (ENGINES=sglang, then ENGINES=vllm), or set ENGINE_S or ENGINES_FORCE=1" >&2
  exit 4
fi
source benchmarks/device_site.sh
unpack_wheels || exit 2
for e in $engines; do engine_site "$e" "$logs/install-$e.log" & done
wait
echo "wheels unpacked and installed in $(($(date +%s) - t0)) s"
for e in $engines; do
  [ -f "/tmp/site-$e/.done" ] || { tail -n 20 "$logs"/install-*.log; tar -czf "$out/engine-logs.tar.gz" -C "$logs" .; exit 2; }
done
bash benchmarks/build_native.sh || exit 3
export PYTHONUNBUFFERED=1 FOUNDRY_NO_PROGRESS=1
budget=${ENGINES_BUDGET_S:-585}

run_engine() {  # engine gpu seconds
  # A fresh work directory (archive, compile caches) in every call; with KEEP_WORK=1 one per engine
  # that later calls on the same warm machine reuse: a later call with --order stock,load compares
  # against the earlier call's SAVE (more paired rounds and process pairs: benchmarks/paired_pool.py).
  local extra="" work="/tmp/engine-work-$1-$t0"
  [ "${KEEP_WORK:-0}" = 1 ] && work="/tmp/engine-work-$1-kept"
  [ "$1" = sglang ] && extra=${SGLANG_ARGS:-}
  [ "$1" = vllm ] && extra=${VLLM_ARGS:-}
  CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=/tmp/site-$1:$PWD/src timeout "$3" \
    python3 "benchmarks/$1_h200.py" --out "$out/$1-h200.json" --logs "$logs" --workdir "$work" \
    --budget $(($3 - 15)) $extra >"$logs/$1-driver.log" 2>&1
  echo "$1 rc=$?" >>"$logs/$1-driver.log"
  # Every timed decode-graph replay of the three runs (benchmarks/engine_steps.py), for later looks.
  mkdir -p "$logs/$1-steps"
  for d in "$work"/steps-*; do [ -d "$d" ] && cp -r "$d" "$logs/$1-steps/"; done
}

# The GPUs' SM clock, power and temperature every 200 ms through the runs: a restored graph's
# device time differed from stock's by 5 % in one vLLM run (2026-12-02) with the same kernels; this
# says whether the clock did. Stopped with the call.
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -lms 200 >"$logs/gpu-clocks-${engines// /-}.csv" 2>/dev/null &
clocks=$!

if [ "${ENGINES_PARALLEL:-0}" = 1 ] && [ "$n_gpus" -ge "$n_engines" ]; then
  gpu=0
  for e in $engines; do
    run_engine "$e" "$gpu" $((budget - $(date +%s) + t0)) &
    gpu=$((gpu + 1))
  done
  wait
else
  for e in $engines; do
    left=$((budget - $(date +%s) + t0))
    [ "$left" -gt 60 ] || { echo "$e: no time left ($left s)" >"$logs/$e-driver.log"; continue; }
    # Engines after the first get what is left, the first an equal share unless ENGINE_S says.
    share=$((left / n_engines))
    [ -n "${ENGINE_S:-}" ] && share=$ENGINE_S
    [ "$share" -gt "$left" ] && share=$left
    run_engine "$e" 0 "$share"
    n_engines=$((n_engines - 1))
  done
fi
kill "$clocks" 2>/dev/null
for e in $engines; do tail -n 40 "$logs/$e-driver.log"; done
tar -czf "$out/engine-logs.tar.gz" -C "$logs" .
