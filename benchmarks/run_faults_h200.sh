#!/usr/bin/env bash
# One engine's fault cases (benchmarks/engine_faults.py) on the GPU machine, in one call.
# Same wheel set and engine site as run_sxs_h200.sh: the wheels were sent beforehand as tar pieces
# into /tmp/dw (../shared/tools/device-wheels), .devwheels/lists/<engine>.list names the engine's
# wheels (carry .devwheels/lists); a machine that already ran run_sxs_h200.sh reuses its
# /tmp/site-<engine>.
# Usage on the device, from the repository root:
#   FOUNDRY_COMMIT=<hash> bash benchmarks/run_faults_h200.sh sglang|vllm [seconds]
# FAULTS_ARGS passes options, e.g. FAULTS_ARGS="--cases two_replicas,damaged_cache".
# The result, the logs and the work directory (with the base SAVE's archive) stay in /tmp between
# calls on the same machine (every call empties $OUT), so a later call adds cases without a new
# base SAVE: FAULTS_ARGS="--cases disk_full,read_only_dir --resume".
# NAME (default faults-<engine>-h200) names the result files.
set -u
engine=${1:?sglang or vllm}
limit=${2:-590}
out=${OUT:?set OUT to the results folder}
t0=$(date +%s)
logs=/tmp/faults-logs-$engine
results=/tmp/faults-results
workdir=/tmp/faults-$engine
name=${NAME:-faults-$engine-h200}
mkdir -p "$logs" "$results"
source benchmarks/device_site.sh
site=/tmp/site-$engine
engine_ready "$engine" "$logs" "$t0"  # exits 2 (install) or 3 (native build) on failure
left=$((limit - $(date +%s) + t0 - 15))
[ "$left" -gt 120 ] || { echo "only $left s left after the install: call again (the site is kept)"; exit 4; }
# SIGTERM at the limit: the benchmark then ends its servers, undoes its mounts and writes the result.
PYTHONPATH=$(site_path "$site"):$PWD/src timeout -k 10 "$left" python3 benchmarks/engine_faults.py --engine "$engine" \
  --out "$results/$name.json" --logs "$logs" --workdir "$workdir" \
  --budget $((left - 10)) --timeout "${RUN_TIMEOUT:-300}" ${FAULTS_ARGS:-}
echo "engine_faults rc=$?"
# Mounts of a run killed past its SIGTERM (only its own: under its work directory).
awk -v w="$workdir/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
cp "$results/$name".json "$out/"
tar -czf "$out/$name-logs.tar.gz" -C "$logs" .
