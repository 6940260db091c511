#!/usr/bin/env bash
# Real engines on a 2-GPU H200 in one call, side by side:
#   GPU 0: benchmarks/sglang_h200.py (SGLang 0.5.17: stock, SAVE, LOAD)
#   GPU 1: benchmarks/vllm_h200.py   (vLLM 0.26.0: SAVE, stock, LOAD)
# Wheels: the union of both wheel sets was sent beforehand as tar pieces into /tmp/dw (see
# ../shared/tools/device-wheels); .devwheels/lists/{sglang,vllm}.list name each engine's wheels.
# Each engine gets its own --target site, so their pins never meet.
# Usage on the device, from the repository root: FOUNDRY_COMMIT=<hash> bash benchmarks/run_h200_engines.sh
set -u
out=${OUT:?set OUT to the results folder}
logs=/tmp/engine-logs
mkdir -p "$logs" /tmp/wh
t0=$(date +%s)
if [ ! -f /tmp/wh/.unpacked ]; then
  cat /tmp/dw/part-* | tar -xf - -C /tmp/wh && touch /tmp/wh/.unpacked || exit 2
fi
install() {  # engine
  [ -f "/tmp/site-$1/.done" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "/tmp/site-$1" \
    $(sed 's|^|/tmp/wh/|' ".devwheels/lists/$1.list") >"$logs/install-$1.log" 2>&1 && touch "/tmp/site-$1/.done"
}
install sglang & install vllm & wait
echo "wheels unpacked and installed in $(($(date +%s) - t0)) s"
ls -d /tmp/site-*/.done || { tail -n 20 "$logs"/install-*.log; tar -czf "$out/engine-logs.tar.gz" -C "$logs" .; exit 2; }
rm -f src/foundry_core/_foundry_native*.so
gcc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -Inative native/*.c \
  -o src/foundry_core/_foundry_native.so -ldl -lpthread || exit 3
export PYTHONUNBUFFERED=1 FOUNDRY_NO_PROGRESS=1
left=$((${ENGINES_BUDGET_S:-585} - $(date +%s) + t0))

(CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site-sglang:$PWD/src timeout "$left" \
  python3 benchmarks/sglang_h200.py --out "$out/sglang-h200.json" --logs "$logs" --budget $((left - 15)) ${SGLANG_ARGS:-} \
  >"$logs/sglang-driver.log" 2>&1; echo "sglang rc=$?" >>"$logs/sglang-driver.log") &

(CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site-vllm:$PWD/src timeout "$left" \
  python3 benchmarks/vllm_h200.py --out "$out/vllm-h200.json" --logs "$logs" --budget $((left - 15)) \
  >"$logs/vllm-driver.log" 2>&1; echo "vllm rc=$?" >>"$logs/vllm-driver.log") &
wait
tail -n 30 "$logs/sglang-driver.log"; tail -n 30 "$logs/vllm-driver.log"
tar -czf "$out/engine-logs.tar.gz" -C "$logs" .
