#!/usr/bin/env bash
# End-to-end check of launch/run.sh under a real (one-machine, 2-node) SLURM cluster:
#   install slurm-wlm + munge if missing -> stand the cluster up (launch/testing/slurm_cluster.sh) -> sbatch
#   launch/run.sh with a short GRPO run on the embedded default, one rank on each node -> after its first step,
#   preempt it as SLURM's time-limit warning does (SIGUSR1 to the batch script) -> assert the trainer checkpointed
#   and the job requeued itself, resumed from that checkpoint and finished with exit 0, its worker group ran on both
#   nodes, Ray's token authentication was on, and the last checkpoint was written -> tear everything down (also on
#   failure, SIGTERM or Ctrl-C).
#
#   launch/testing/slurm_grpo_check.sh            # run by `make test-slurm` (tests/slurm/test_slurm_cluster.py)
#
# Environment: PYTHON (default .venv/bin/python), JOB_TIMEOUT_S (default 450), KEEP_STATE=1 keeps the state dir
# (configs, daemon and job logs) for debugging. Needs root (network/UTS/mount/PID namespaces).
# Exit status: 0 passed; 1 an assertion failed; 3 SLURM could not be installed (no network/apt: the caller skips);
# other: the cluster could not be stood up.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ $PYTHON == /* ]] || PYTHON=$(command -v "$PYTHON")  # absolute: job steps start elsewhere
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-450}  # (SLURM would hold the requeued job ~2 min; the check releases it at once)
CLUSTER=$ROOT/launch/testing/slurm_cluster.sh
STEPS=8  # the signal goes after step 1 is logged: 7 steps of slack for it to reach the trainer on a loaded machine

"$ROOT/launch/testing/install_slurm.sh" || exit $?

STATE=$(mktemp -d /tmp/scaletrain-slurm.XXXXXX)
JOB_ID=""
# shellcheck disable=SC2317  # called through the traps
cleanup() {
  local status=$?
  trap - EXIT
  trap '' INT TERM  # a second Ctrl-C or SIGTERM must not interrupt the teardown
  if [[ -n $JOB_ID ]]; then "$CLUSTER" run "$STATE" scancel "$JOB_ID" > /dev/null 2>&1 || true; fi
  "$CLUSTER" down "$STATE" || true
  if [[ ${KEEP_STATE:-0} == 1 ]]; then echo "state kept in $STATE"; else rm -rf "$STATE"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  echo "FAIL: $*" >&2
  if [[ -n ${info:-} ]]; then echo "----- scontrol show job -----"; echo "$info"; fi
  echo "----- slurmctld.log, slurmd logs (last lines) -----"
  tail -n 25 "$STATE"/log/slurmctld.log "$STATE"/log/slurmd-node*.log 2> /dev/null || true
  exit 1
}

# The embedded task and its tiny random-init model (built and cached on first use, ~seconds). Passing the model
# path skips the SFT warm-up (up to 1,200 steps, minutes on a cold cache): this checks the launch path, not learning.
MODEL=$("$PYTHON" -c "from scaletrain.data import build_embedded_default; print(build_embedded_default()['model'])" \
        | tail -n 1)

"$CLUSTER" up "$STATE" 2 1
RUN_DIR=$STATE/run

# sbatch options override run.sh's #SBATCH lines (partition gpu, 2 nodes, exclusive) where they differ.
# run.sh adds trainer.nnodes=2 trainer.n_gpus_per_node=$SLURM_GPUS_ON_NODE=1: 2 ranks, which the resource pool
# pins to distinct nodes.
# as in a user's shell: run.sh makes the job's Ray token (the test session itself runs Ray without one)
unset RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH
JOB_ID=$("$CLUSTER" run "$STATE" sbatch --parsable --nodes=2 --gpus-per-node=1 --cpus-per-task=2 --time=15 \
  --chdir="$ROOT" --output="$STATE/job-%j.out" \
  --export="ALL,PATH=$(dirname "$PYTHON"):$PATH,PYTHON=$PYTHON,OMP_NUM_THREADS=1,RAY_OBJECT_STORE_BYTES=300000000,RAY_NUM_CPUS=4,RAY_WAIT_S=120" \
  "$ROOT/launch/run.sh" \
  actor_rollout_ref.model.path="$MODEL" trainer.total_training_steps=$STEPS trainer.save_freq=$STEPS \
  trainer.val_before_train=false data.val_max_samples=32 trainer.plot_at_end=false trainer.save_hf_at_end=false \
  trainer.default_local_dir="$RUN_DIR")
JOB_ID=${JOB_ID%%;*}
echo "submitted job $JOB_ID; log $STATE/job-$JOB_ID.out"

# preempt after the first trained step: SLURM's warning signal (run.sh asks for it with --signal=B:USR1@600)
deadline=$((SECONDS + JOB_TIMEOUT_S))
until grep -q '"step"' "$RUN_DIR/metrics.jsonl" 2> /dev/null; do
  (( SECONDS < deadline )) || fail "job $JOB_ID trained no step within ${JOB_TIMEOUT_S}s"
  sleep 1 & wait $!
done
"$CLUSTER" run "$STATE" scancel --signal=USR1 --batch "$JOB_ID"
echo "sent SIGUSR1 to job $JOB_ID after its first step"

state=""
released=""
while (( SECONDS < deadline )); do
  info=$("$CLUSTER" run "$STATE" scontrol show job -o "$JOB_ID" 2> /dev/null || true)
  state=$(grep -o 'JobState=[A-Z_]*' <<< "$info" | cut -d= -f2 || true)
  case $state in
    COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | PREEMPTED | BOOT_FAIL | DEADLINE) break ;;
  esac
  # SLURM holds a requeued job for ~2 min (its begin time); what is checked is that it requeues and resumes, so
  # start it as soon as both nodes are idle again (released while a node was still completing the first run, the
  # requeued job once failed at launch without a line of output: CI, 2026-12-05)
  if [[ $state == PENDING && -z $released ]] && grep -q "run.sh: requeueing job" "$STATE/job-$JOB_ID.out" 2> /dev/null \
    && [[ $("$CLUSTER" run "$STATE" sinfo -h -N -o %T 2> /dev/null | sort -u) == idle ]] \
    && "$CLUSTER" run "$STATE" scontrol update JobId="$JOB_ID" StartTime=now > /dev/null 2>&1; then
    released=1
    echo "requeued job $JOB_ID released at ${SECONDS}s (StartTime=now)"
  fi
  sleep 2 & wait $!  # a trap runs at once, not after the sleep
done
LOG=$STATE/job-$JOB_ID.out
echo "----- job log (last 60 lines without Ray's state dumps and raylet lines; all of it: KEEP_STATE=1) -----"
grep -v -e '\[state-dump\]' -e '(raylet)' "$LOG" 2> /dev/null | tail -n 60 || true
echo "-----------------------------------"
exit_code=$(grep -o 'ExitCode=[0-9:]*' <<< "$info" | cut -d= -f2 || true)
echo "job $JOB_ID: state ${state:-unknown}, exit code ${exit_code:-unknown}, after ${SECONDS}s"

# 1. the job (run.sh, hence the trainer) finished with exit 0
[[ $state == COMPLETED && $exit_code == 0:0 ]] || fail "job $JOB_ID ended in state '${state:-still running}', exit code '${exit_code:-?}'"
grep -q "run.sh: trainer exited with 0" "$LOG" || fail "run.sh did not report the trainer's exit 0"
# 2. the preemption: a checkpoint and exit 0, the job requeued, the requeued run resumed from that checkpoint
grep -q "run.sh: got SIGUSR1" "$LOG" || fail "run.sh did not get the warning signal"
grep -q "preempted by SIGUSR1 after step" "$LOG" || fail "the trainer did not checkpoint and stop on SIGUSR1"
grep -q "run.sh: requeueing job $JOB_ID" "$LOG" || fail "the job did not requeue itself"
grep -q "resumed from $RUN_DIR/global_step_" "$LOG" || fail "the requeued job did not resume from the checkpoint"
grep -q "RAY_AUTH_MODE=disabled" "$LOG" && fail "Ray ran without token authentication"
# 3. both Ray nodes joined and the trainer's worker group ran on both (the INFO line of RayWorkerGroup)
grep -q "run.sh: Ray cluster up, 2 node(s)" "$LOG" || fail "the Ray cluster did not come up with 2 nodes"
placement=$(grep -m1 "worker group .* worker(s) on" "$LOG" || true)
echo "placement: ${placement:-none logged}"
[[ $placement == *"on 2 node(s)"* && $placement == *node1* && $placement == *node2* ]] \
  || fail "the worker group did not run on both node1 and node2"
# 4. the last checkpoint was written
[[ -d $RUN_DIR/global_step_$STEPS ]] || fail "no checkpoint $RUN_DIR/global_step_$STEPS (have: $(ls "$RUN_DIR" 2> /dev/null | tr '\n' ' '))"
echo "checkpoint: $RUN_DIR/global_step_$STEPS ($(du -sh "$RUN_DIR/global_step_$STEPS" | cut -f1))"
echo "PASS: launch/run.sh ran GRPO on 2 SLURM nodes, preempted and requeued (job $JOB_ID, ${SECONDS}s in all)"
