#!/usr/bin/env bash
# Multi-node scaletrain run on SLURM: one Ray cluster over the allocated nodes, then the PPO trainer on it.
#
#   sbatch launch/run.sh algorithm.adv_estimator=grpo actor_rollout_ref.model.path=/models/qwen ...
#   salloc -N 2 --gpus-per-node=8 bash launch/run.sh trainer.total_training_steps=100 ...
#
# Arguments are Hydra overrides for `python -m scaletrain.trainer.main_ppo`; this script adds
# trainer.nnodes, trainer.n_gpus_per_node and ray_kwargs.ray_init.address for you.
#
# Edit the #SBATCH lines below (partition, nodes, GPUs, time). Options from the environment
# (export them before sbatch; sbatch passes the environment on by default):
#   GPUS_PER_NODE           GPUs (or, on CPU nodes, ranks) per node    default: $SLURM_GPUS_ON_NODE, else nvidia-smi, else 2
#   CONTAINER               command prefix for every Ray/Python process, e.g. "apptainer exec --nv img.sif"  default: none
#   PYTHON                  Python inside the environment/container    default: python
#   RAY_PORT                Ray head (GCS) port                        default: 6379
#   RAY_OBJECT_STORE_BYTES  object store size per node, in bytes       default: 4000000000
#   RAY_NUM_CPUS            CPUs Ray may use per node                  default: $SLURM_CPUS_ON_NODE, else Ray's count
#   RAY_WAIT_S              seconds to wait for all nodes to join      default: 300
#   SLURM_CMD_TIMEOUT_S     limit for each short slurm client call     default: 60
#   ENTRY                   Python module the driver runs (gets the same overrides), e.g. benchmarks.e2e_step
#                                                                      default: scaletrain.trainer.main_ppo
#   REQUEUE                 1: requeue the job after a preemption checkpoint   default: 1
# Exit status: the trainer's. Ray is stopped on every node on exit, error, scancel or Ctrl-C.
#
# Preemption and time limits: SLURM sends this script SIGUSR1 600 s before the time limit (--signal below; also
# `scancel --signal=USR1 --batch JOB`), and a SIGTERM from the scheduler counts the same. The signal is passed on to
# the trainer, which finishes its step, writes a checkpoint and exits 0; the job then requeues itself (--requeue;
# REQUEUE=0 to stop instead), and the requeued job resumes from that checkpoint (trainer.resume_mode=auto). The
# lead time must cover the rest of a step plus a checkpoint save: raise the @600 for long steps.
#
#SBATCH --job-name=scaletrain
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=scaletrain-%j.out
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail

export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# Ray's token authentication with a fresh random token per job (unless RAY_AUTH_TOKEN is exported), handed to every
# node through the environment, never on a command line: only processes holding it join or submit work.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token} RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}
[[ "$RAY_AUTH_MODE" == disabled ]] && echo "$(basename "$0"): WARNING: RAY_AUTH_MODE=disabled: anyone who reaches" \
  "the Ray ports can run code as $(id -un)" >&2

if [[ -z "${SLURM_JOB_ID:-}" || -z "${SLURM_JOB_NODELIST:-}" ]]; then
  echo "run.sh: not inside a SLURM allocation (submit with sbatch, or run under salloc); on one machine use launch/local.sh" >&2
  exit 2
fi

PYTHON=${PYTHON:-python}
RAY_PORT=${RAY_PORT:-6379}
RAY_OBJECT_STORE_BYTES=${RAY_OBJECT_STORE_BYTES:-4000000000}
RAY_WAIT_S=${RAY_WAIT_S:-300}
RAY_NUM_CPUS=${RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-}}
SLURM_CMD_TIMEOUT_S=${SLURM_CMD_TIMEOUT_S:-60}
ENTRY=${ENTRY:-scaletrain.trainer.main_ppo}
REQUEUE=${REQUEUE:-1}
read -r -a CONTAINER_CMD <<< "${CONTAINER:-}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
  elif command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
  else
    GPUS_PER_NODE=2
  fi
fi

mapfile -t NODES < <(timeout "$SLURM_CMD_TIMEOUT_S" scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
if (( NNODES == 0 )); then
  echo "run.sh: scontrol returned no hostnames for '$SLURM_JOB_NODELIST'" >&2
  exit 2
fi
HEAD=${NODES[0]}
HEAD_IP=$(timeout "$SLURM_CMD_TIMEOUT_S" srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | awk '{print $1}')
HEAD_IP=${HEAD_IP:-$HEAD}
ADDRESS="$HEAD_IP:$RAY_PORT"
echo "run.sh: job $SLURM_JOB_ID, $NNODES node(s): ${NODES[*]}; Ray head $ADDRESS; $GPUS_PER_NODE GPU(s)/ranks per node"

RAY_ARGS=(--block --disable-usage-stats --object-store-memory="$RAY_OBJECT_STORE_BYTES")
[[ -n "$RAY_NUM_CPUS" ]] && RAY_ARGS+=(--num-cpus="$RAY_NUM_CPUS")

SRUN_PIDS=()
DRIVER_PID=""
PREEMPTED=""
# shellcheck disable=SC2317  # called through the EXIT trap
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  echo "run.sh: stopping Ray on ${NODES[*]}" >&2
  for node in "${NODES[@]}"; do
    timeout "$SLURM_CMD_TIMEOUT_S" srun --overlap --nodes=1 --ntasks=1 -w "$node" \
      "${CONTAINER_CMD[@]}" ray stop --force > /dev/null 2>&1 &
  done
  # the `ray start --block` steps end once their node stops; bounded, then their srun is signalled (ends the step)
  local deadline=$((SECONDS + SLURM_CMD_TIMEOUT_S)) pid left
  while (( SECONDS < deadline )); do
    left=0
    for pid in "${SRUN_PIDS[@]}"; do kill -0 "$pid" 2> /dev/null && left=1; done
    (( left )) || break
    sleep 1
  done
  (( ${#SRUN_PIDS[@]} )) && { kill -TERM "${SRUN_PIDS[@]}" 2> /dev/null || true; }
  wait || true
  if [[ -n "$PREEMPTED" && $status == 0 && $REQUEUE == 1 ]]; then
    echo "run.sh: requeueing job $SLURM_JOB_ID: it resumes from the checkpoint just written" >&2
    timeout "$SLURM_CMD_TIMEOUT_S" scontrol requeue "$SLURM_JOB_ID" || echo "run.sh: scontrol requeue failed" >&2
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" "${CONTAINER_CMD[@]}" \
  ray start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" --include-dashboard=false "${RAY_ARGS[@]}" &
SRUN_PIDS+=($!)
for node in "${NODES[@]:1}"; do
  srun --overlap --nodes=1 --ntasks=1 -w "$node" "${CONTAINER_CMD[@]}" \
    ray start --address="$ADDRESS" "${RAY_ARGS[@]}" &
  SRUN_PIDS+=($!)
done

# wait until every node is alive in the cluster (the head may take a few seconds to accept connections)
deadline=$((SECONDS + RAY_WAIT_S))
alive=0
while (( SECONDS < deadline )); do
  alive=$(timeout 90 srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" "${CONTAINER_CMD[@]}" "$PYTHON" -c "
import ray
ray.init(address='$ADDRESS', logging_level='ERROR', include_dashboard=False)
print(sum(1 for n in ray.nodes() if n['Alive']))
" 2> /dev/null | tail -n 1) || alive=0
  [[ "$alive" =~ ^[0-9]+$ ]] || alive=0
  (( alive >= NNODES )) && break
  running=0
  for pid in "${SRUN_PIDS[@]}"; do kill -0 "$pid" 2> /dev/null && running=$((running + 1)); done
  if (( running < NNODES )); then  # a `ray start --block` step already ended: it will not join
    echo "run.sh: $((NNODES - running)) of $NNODES \`ray start\` step(s) exited early; see the srun output above" \
         "(ray not on PATH inside the job? port $RAY_PORT in use? wrong CONTAINER?)" >&2
    exit 3
  fi
  sleep 3
done
if (( alive < NNODES )); then
  echo "run.sh: only $alive of $NNODES Ray node(s) alive at $ADDRESS after RAY_WAIT_S=${RAY_WAIT_S}s;" \
       "see the srun output above (port $RAY_PORT in use? firewall between nodes? wrong CONTAINER?)" >&2
  exit 3
fi
echo "run.sh: Ray cluster up, $alive node(s)"

# shellcheck disable=SC2317  # called through the USR1 / TERM traps
pass_stop_on() {  # SLURM's warning signal or a TERM: the trainer checkpoints after its step and exits 0
  PREEMPTED=$1
  echo "run.sh: got SIG$1: asking the trainer to checkpoint and stop" >&2
  kill -"$1" "$DRIVER_PID" 2> /dev/null || true  # srun passes it on to the driver
}

# the driver runs on the head node (it needs a local raylet), also when this script runs on a salloc login node
set +e
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" "${CONTAINER_CMD[@]}" "$PYTHON" -m "$ENTRY" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" ray_kwargs.ray_init.address="$ADDRESS" "$@" &
DRIVER_PID=$!
trap 'pass_stop_on USR1' USR1
trap 'pass_stop_on TERM' TERM
while true; do
  wait "$DRIVER_PID"
  rc=$?
  kill -0 "$DRIVER_PID" 2> /dev/null || break  # wait also returns when a trap ran: the driver may still be running
done
trap 'exit 143' TERM
set -e
echo "run.sh: trainer exited with $rc"
exit "$rc"
