#!/usr/bin/env bash
# The core GPU runs of one session: foundry bench (capture vs restore, replay parity), foundry soak,
# and the GPU tests (pytest -m gpu).
#   2 GPUs or more: GPU 0 runs the bench, GPU 1 the soak and then the GPU tests, side by side.
#   1 GPU: the bench, then the GPU tests, one after the other (the soak only with SOAK=1, after them).
#   On one H200 the bench (about 6 min) and the GPU tests (about 3 min) do not both fit one 600 s
#   call: CORE_PARTS=bench, then CORE_PARTS=tests, in two calls (default: both). CORE_PARTS=probe:
#   the launch cost of restored graphs built ahead and after the mapping (four short benches);
#   CORE_PARTS=demo: foundry demo, the README's main command (about a minute). CORE_PARTS=tp:
#   foundry tp over every GPU (on one H200: world size 1, then TP_SHARED="2 4" ranks sharing it,
#   default 2) and the TP GPU tests.
# Usage on the device, from the repository root: FOUNDRY_COMMIT=<hash> bash benchmarks/run_h200_core.sh
# Everything it produces goes to $OUT: the results JSON, and logs, PNG and profile in extras.tar.gz.
set -u
out=${OUT:?set OUT to the results folder}
bash benchmarks/build_native.sh || exit 1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 FOUNDRY_NO_PROGRESS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
budget=${FOUNDRY_RUN_BUDGET_S:-570}
n_gpus=$(nvidia-smi --list-gpus | wc -l)
left() { echo $((budget - 10 - $(date +%s) + start)); }

bench() {  # gpu
  # BENCH_PRESETS: the extra sizes for restore time against nodes (default tiny,small; empty: the
  # 1.7B model alone, about 2 minutes less).
  local presets=${BENCH_PRESETS-tiny,small}
  # --check-structure: after the timings, every restored graph and native twin is read back and
  # compared with the archive (not timed yet: a driver walk of 103,288 nodes, twice)
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m foundry_tools bench --workdir /tmp/bench \
    --check-structure ${presets:+--presets "$presets"} --out "$out/bench-h200.json" >"$out/bench.log" 2>&1
  echo "bench rc=$?" >>"$out/bench.log"
}

soak() {  # gpu
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m foundry_tools soak --tests tests --workdir /tmp/soak \
    --out "$out/reliability-h200.json" --replays 10000 --cycles 20 >"$out/soak.log" 2>&1
  echo "soak rc=$?" >>"$out/soak.log"
  cp /tmp/soak/cpu-suite.json "$out/" 2>/dev/null
}

probe() {  # gpu
  # The launch cost on the CPU of restored graphs built ahead (stand-in, re-pointed), built ahead and
  # uploaded once re-pointed, built ahead and then given executables instantiated afresh (an
  # experiment: is it the in-place re-pointing?), and built after the mapping (--no-prepare), each
  # beside its native twins, three batch sizes: about a minute each. The last one's SAVE is
  # profiled (FOUNDRY_PROFILE_DIR: profile/demo-save-rank0.txt, where the walk spends its time per
  # node; its SAVE times are inflated by it).
  local how flags profile
  # PROBE_HOWS: which of the four (default all)
  for how in ${PROBE_HOWS:-ahead ahead-upload ahead-reinstantiate after}; do
    case $how in
      ahead) flags= ;; ahead-upload) flags=--upload ;; ahead-reinstantiate) flags=--reinstantiate ;;
      after) flags=--no-prepare ;;
    esac
    profile=$([ "$how" = after ] && echo "$out/profile")
    CUDA_VISIBLE_DEVICES=$1 FOUNDRY_PROFILE_DIR=$profile timeout "$(left)" \
      python -m foundry_tools bench --workdir "/tmp/probe-$how" \
      --batch-sizes 1 8 64 --replays 200 $flags \
      --out "$out/launch-$how-h200.json" >"$out/launch-$how.log" 2>&1
    echo "probe $how rc=$?" >>"$out/launch-$how.log"
  done
}

demo() {  # gpu
  # The README's main command, as a user runs it: SAVE, LOAD in a fresh process, verify, times.
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m foundry_tools demo --workdir /tmp/demo \
    --out "$out/demo-h200.json" >"$out/demo.log" 2>&1
  echo "demo rc=$?" >>"$out/demo.log"
}

tp() {  # gpus, as a CUDA_VISIBLE_DEVICES list: one rank each
  # foundry tp: the embedded model tensor-parallel over these GPUs (a group of one on one GPU), the
  # all-reduce through torch symmetric memory inside the graph; SAVE twice (--reproduce), LOAD once.
  # First the placement test alone (seconds; it says whether the rest can work), then foundry tp
  # (on one GPU also two ranks sharing it), then the tensor-parallel GPU tests (also in gpu_tests).
  local world
  world=$(echo "$1" | tr ',' '\n' | wc -l)
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m pytest -q -m gpu tests/gpu/test_symmetric_placement.py \
    >"$out/tp-placement.log" 2>&1
  echo "pytest placement rc=$?" >>"$out/tp-placement.log"
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m foundry_tools tp --world-size "$world" --reproduce \
    --workdir /tmp/tp --out "$out/tp-h200x$world.json" >"$out/tp.log" 2>&1
  echo "tp rc=$?" >>"$out/tp.log"
  if [ "$world" -eq 1 ]; then  # more ranks on the one GPU too (TP_SHARED, default 2): all of TP but NVLink
    for ranks in ${TP_SHARED:-2}; do
      CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m foundry_tools tp --world-size "$ranks" --share-gpus \
        --all-reduce one_shot --reproduce --workdir "/tmp/tp-shared$ranks" \
        --out "$out/tp$ranks-h200x1-shared.json" >>"$out/tp.log" 2>&1
      echo "tp shared $ranks rc=$?" >>"$out/tp.log"
    done
  fi
  CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" python -m pytest -q -m gpu tests/gpu/test_tensor_parallel.py \
    >>"$out/tp.log" 2>&1
  echo "pytest tp rc=$?" >>"$out/tp.log"
}

gpu_tests() {  # gpu
  if [ "$(left)" -gt 60 ]; then
    # SIGINT at the limit: pytest then still prints its failures (a plain timeout's SIGTERM left
    # only the progress dots of the 6640e28 run, one F among them, with no name or reason).
    CUDA_VISIBLE_DEVICES=$1 FOUNDRY_BUILDER=native timeout -s INT -k 20 "$(left)" python -m pytest -q -rfE -m gpu tests/gpu \
      tests/test_graph_encoding_gpu.py >"$out/pytest-gpu.log" 2>&1
    echo "pytest rc=$? after $(($(date +%s) - start)) s" >>"$out/pytest-gpu.log"
  else
    echo "no time left for the GPU tests ($(left) s)" >"$out/pytest-gpu.log"
  fi
}

if [ "${CORE_PARTS:-}" = tp ]; then
  tp "$(seq -s, 0 $((n_gpus - 1)))"
elif [ "$n_gpus" -ge 2 ]; then
  bench 0 &
  (soak 1; gpu_tests 1) &
  wait
else
  parts=${CORE_PARTS:-bench tests}
  case " $parts " in *" probe "*) probe 0 ;; esac
  case " $parts " in *" bench "*) bench 0 ;; esac
  case " $parts " in *" demo "*) demo 0 ;; esac
  case " $parts " in *" tests "*) gpu_tests 0 ;; esac
  [ "${SOAK:-0}" = 1 ] && soak 0
fi
for f in launch-ahead.log launch-ahead-upload.log launch-ahead-reinstantiate.log launch-after.log bench.log demo.log tp-placement.log tp.log soak.log pytest-gpu.log; do [ -f "$out/$f" ] && tail -n 25 "$out/$f"; done
# At most 8 files come back from the device (its README): the JSON results come back as they are,
# and everything else (logs, plots, the SAVE profile) in one archive beside them, extras.tar.gz.
extras=$(cd "$out" && find . -mindepth 1 -type f ! -name '*.json' ! -name extras.tar.gz | sort)
if [ -n "$extras" ]; then
  (cd "$out" && tar -czf extras.tar.gz $extras && rm -f $extras && find . -mindepth 1 -type d -empty -delete)
fi
