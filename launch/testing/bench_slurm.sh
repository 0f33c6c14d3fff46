#!/usr/bin/env bash
# benchmarks/e2e_step.py across the one-machine SLURM test cluster: GRPO tokens/s at 1 node vs 2 nodes.
#
#   launch/testing/bench_slurm.sh [e2e_step.py options]     # default: --steps 2 (after 2 warm-up steps)
#
# Stands the test cluster up (launch/testing/slurm_cluster.sh, 2 nodes x 2 fake GPUs), submits launch/run.sh with
# ENTRY=benchmarks.e2e_step three times, one job after another:
#   1 node  x 1 rank     the baseline
#   2 nodes x 1 rank     the multi-node run (ratio vs the first: scaling from 1 to 2 nodes)
#   1 node  x 2 ranks    the same world size on one node (ratio vs the second: the cost of crossing nodes)
# (GPUS_PER_NODE is set: run.sh's --exclusive would otherwise hand each job every GPU of its nodes)
# then prints tokens/s and step time of each with the ratios, and tears everything down (also on Ctrl-C).
# All "nodes" share this machine's cores, so 2 nodes add ranks, not compute: read the ratios as overhead figures.
# Needs root; installs slurm-wlm + munge if missing. KEEP_STATE=1 keeps configs and job logs.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ $PYTHON == /* ]] || PYTHON=$(command -v "$PYTHON")
CLUSTER=$ROOT/launch/testing/slurm_cluster.sh
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-900}
BENCH_ARGS=("$@")
(( ${#BENCH_ARGS[@]} )) || BENCH_ARGS=(--steps 2)

"$ROOT/launch/testing/install_slurm.sh"
reason=$("$ROOT/launch/testing/probe.sh") || { echo "bench_slurm.sh: cannot stand the cluster up: $reason" >&2; exit 3; }

STATE=$(mktemp -d /tmp/scaletrain-slurm-bench.XXXXXX)
JOB_ID=""
# shellcheck disable=SC2317  # called through the traps
cleanup() {
  local status=$?
  trap - EXIT
  trap '' INT TERM
  if [[ -n $JOB_ID ]]; then "$CLUSTER" run "$STATE" scancel "$JOB_ID" > /dev/null 2>&1 || true; fi
  "$CLUSTER" down "$STATE" || true
  if [[ ${KEEP_STATE:-0} == 1 ]]; then echo "state kept in $STATE"; else rm -rf "$STATE"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$CLUSTER" up "$STATE" 2 2

declare -A TOKS STEP
run_case() {  # name nodes gpus_per_node
  local name=$1 nodes=$2 gpus=$3 result log
  JOB_ID=$("$CLUSTER" run "$STATE" sbatch --parsable --nodes="$nodes" --gpus-per-node="$gpus" --cpus-per-task=2 \
    --time=30 --chdir="$ROOT" --output="$STATE/job-%j.out" \
    --export="ALL,PATH=$(dirname "$PYTHON"):$PATH,PYTHON=$PYTHON,GPUS_PER_NODE=$gpus,ENTRY=benchmarks.e2e_step,OMP_NUM_THREADS=1,RAY_OBJECT_STORE_BYTES=500000000,RAY_NUM_CPUS=4,RAY_WAIT_S=120" \
    "$ROOT/launch/run.sh" "${BENCH_ARGS[@]}")
  JOB_ID=${JOB_ID%%;*}
  log=$STATE/job-$JOB_ID.out
  echo "bench_slurm.sh: $name: job $JOB_ID ($nodes node(s) x $gpus rank(s)), log $log"
  # in the background: a trap (SIGTERM) runs at once instead of after the wait
  "$CLUSTER" wait "$STATE" "$JOB_ID" "$JOB_TIMEOUT_S" > "$STATE/wait.out" &
  wait $!
  result=$(cat "$STATE/wait.out")
  JOB_ID=""
  grep -E "^(GRPO step|phase|[a-z_]+ +[0-9.]+ +[0-9.]+%|step |tokens/s|share|controller)" "$log" || true
  grep -m1 "worker group .* worker(s) on" "$log" | sed 's/^.*worker group/worker group/' || true
  if [[ $result != "COMPLETED 0:0" ]]; then
    echo "bench_slurm.sh: $name: job ended $result; last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  TOKS[$name]=$(grep -o 'tokens/s (whole step, all ranks): [0-9,.]*' "$log" | awk '{print $NF}' | tr -d ,)
  STEP[$name]=$(awk '$1 == "step" && NF == 2 {print $2}' "$log" | tail -n 1)
}

run_case "1 node x 1" 1 1
run_case "2 nodes x 1" 2 1
run_case "1 node x 2" 1 2

echo
echo "e2e GRPO step (${BENCH_ARGS[*]}) on the SLURM test cluster (all nodes share $(nproc) cores)"
printf '%-14s %12s %10s\n' "layout" "tokens/s" "step s"
for name in "1 node x 1" "2 nodes x 1" "1 node x 2"; do
  printf '%-14s %12s %10s\n' "$name" "${TOKS[$name]}" "${STEP[$name]}"
done
awk -v a="${TOKS[1 node x 1]}" -v b="${TOKS[2 nodes x 1]}" -v c="${TOKS[1 node x 2]}" 'BEGIN {
  printf "tokens/s ratio 2 nodes / 1 node (1 rank per node): %.2fx\n", b / a
  printf "tokens/s ratio 2 nodes x 1 / 1 node x 2 (same ranks, across nodes vs within one): %.2fx\n", b / c }'
