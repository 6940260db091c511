#!/usr/bin/env bash
# Side-by-side starts and serving of one engine (benchmarks/sxs.py) on the GPU machine, one call at a
# time: installs the engine's site (and upstream Foundry's for MODES with peer) from the wheel pieces
# sent beforehand into /tmp/dw (benchmarks/device_wheels.sh; carry .devwheels/lists), builds the native
# library, runs the chosen modes and pairs within the budget, merges everything the work dir holds
# (earlier calls on the same warm machine included) and copies result, chart and logs to $OUT.
# From the repository root:
#   ENGINE=sglang|vllm SHAPE=qwen3-1.7b MODES=stock_naive,stock_best,foundry,peer PAIRS=1 \
#     BUDGET_S=570 [SERVING=1] [START_TIMEOUT_S=300] [FLOOR=0] [FOUNDRY_COMMIT=<hash>] bash benchmarks/run_sxs_h200.sh
# BUDGET_S is the whole call, install included (default 570); the starts get what is left less 25 s
# for the merge. The work dir /tmp/sxs-$ENGINE outlives the call while the machine stays warm; on a
# fresh machine RESUME_FROM=<an earlier call's sxs-$ENGINE-h200-logs.tar.gz, carried in the tree>
# brings its starts back (not its archives or caches: SAVEs and kept caches are made again), so
# that pairs keep adding up across leases. Exit status: 2 the install failed, 3 the native build, 6
# the site cannot import what a start needs (checked before any start); else the merge's.
set -u
out=${OUT:?set OUT to the results folder}
engine=${ENGINE:?ENGINE=sglang or vllm}
t0=$(date +%s)
work=/tmp/sxs-$engine
logs=/tmp/sxs-install-$engine
mkdir -p "$logs"
if [ -n "${RESUME_FROM:-}" ] && [ ! -f "$work/meta.json" ]; then
  mkdir -p "$work" && tar -xzf "$RESUME_FROM" -C "$work" || exit 5
fi
source benchmarks/device_site.sh
engine_ready "$engine" "$logs" "$t0"  # exits 2 (install) or 3 (native build) on failure
case ",${MODES:-}," in
  *,peer,*) engine_site peer "$logs/install-peer.log" || echo "peer site not installed: see install-peer.log" ;;
esac
export PYTHONUNBUFFERED=1 PYTHONPATH=$(site_path "/tmp/site-$engine"):$PWD/src
# The site hook, where the core's wheel puts it for a user (setup.py): the interpreter's own
# site-packages, since the engine site is a --target folder whose .pth lines Python does not run.
# Only a command line naming --foundry-config acts on it, so stock starts are as without it.
cp src/foundry_graphs_early.pth "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
# Before any start: the modules a start of the Qwen3 shapes imports, in one interpreter (about 10 s),
# so that a site that lacks one stops the call here, not after a start per mode (exit 6).
case $engine in
  sglang) mods="sglang.launch_server sglang.srt.managers.scheduler sglang.srt.models.qwen3 sglang.srt.models.qwen3_moe sglang.kernels.ops.gemm.cutedsl_dual_gemm" ;;
  *) mods="vllm.entrypoints.openai.api_server vllm.v1.engine.core vllm.model_executor.models.qwen3 vllm.model_executor.models.qwen3_moe" ;;
esac
# Once per machine: a later call on the same warm machine finds the same site.
checked=/tmp/sxs-site-checked-$engine
if [ ! -f "$checked" ]; then
  python3 -c 'import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)' $mods || { echo "the $engine site cannot import what a start needs: stopped before any start"; exit 6; }
  touch "$checked"
fi
left=$((${BUDGET_S:-570} - $(date +%s) + t0 - 25))
extra=()  # the run's optional flags
[ "${SERVING:-0}" = 1 ] && extra+=(--serving)
# FLOOR=0: no floor this call (about 40 s), for a later call on a machine whose floor is measured
[ "${FLOOR:-1}" = 0 ] && extra+=(--no-floor)
cmd="ENGINE=$engine SHAPE=${SHAPE:-qwen3-1.7b} MODES=${MODES:-} PAIRS=${PAIRS:-1} SERVING=${SERVING:-0} bash benchmarks/run_sxs_h200.sh"
if [ "$left" -gt 60 ]; then
  python3 benchmarks/sxs.py run --engine "$engine" --shape "${SHAPE:-qwen3-1.7b}" \
    --modes "${MODES:-stock_naive,stock_best,foundry}" --pairs "${PAIRS:-1}" --workdir "$work" \
    --budget "$left" --timeout "${START_TIMEOUT_S:-300}" --peer-site /tmp/site-peer "${extra[@]}"
  echo "sxs run rc=$?"
else
  echo "no time left for starts ($left s)"
fi
# named for the card the lease gave (an nvidia-h200 call may run on an H100)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
  *H100*) card=h100 ;;
  *) card=h200 ;;
esac
name=sxs-$engine-$card
python3 benchmarks/sxs.py merge --engine "$engine" --workdir "$work" --out "$out/$name.json" \
  --command "$cmd (calls accumulate in $work)"
echo "sxs merge rc=$?"
tar -czf "$out/$name-logs.tar.gz" -C "$work" --exclude=models --exclude=archive --exclude=peer-archive \
  --exclude=kept-stock --exclude=kept-foundry --exclude=h --exclude=t --exclude=shim . 2>/dev/null
ls -la "$out"
