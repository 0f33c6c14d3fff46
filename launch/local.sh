#!/usr/bin/env bash
# scaletrain on one machine without SLURM: start a Ray head, run the PPO trainer on it, stop that Ray.
#
#   launch/local.sh                                   # the embedded default (tiny model, arithmetic task, CPU ok)
#   NUM_GPUS=8 GPUS_PER_NODE=8 launch/local.sh actor_rollout_ref.model.path=/models/qwen ...
#
# Arguments are Hydra overrides for `python -m scaletrain.trainer.main_ppo`; this script adds
# trainer.nnodes=1, trainer.n_gpus_per_node and ray_kwargs.ray_init.address. Options from the environment:
#   GPUS_PER_NODE           GPUs (on CPU: ranks) the trainer uses      default: nvidia-smi count, else 2
#   NUM_GPUS                GPUs Ray may schedule                      default: nvidia-smi count, else 0
#   NUM_CPUS                CPUs Ray may schedule (may exceed cores)   default: max(cores, 2 x GPUS_PER_NODE)
#   CONTAINER               command prefix for Ray and Python, e.g. "apptainer exec --nv img.sif"  default: none
#   PYTHON                  Python to run                               default: python
#   RAY_PORT                Ray head (GCS) port                        default: 6379
#   RAY_OBJECT_STORE_BYTES  object store size in bytes                 default: 1073741824
#   RAY_WAIT_S              seconds to wait for the head to come up    default: 120
# Only the Ray started here is stopped (its `ray start --block` process is signalled), never other Ray
# clusters on the machine. Exit status: the trainer's.

set -euo pipefail

export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# Ray's token authentication with a fresh random token per job (unless RAY_AUTH_TOKEN is exported), handed to every
# node through the environment, never on a command line: only processes holding it join or submit work.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token} RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}
[[ "$RAY_AUTH_MODE" == disabled ]] && echo "$(basename "$0"): WARNING: RAY_AUTH_MODE=disabled: anyone who reaches" \
  "the Ray ports can run code as $(id -un)" >&2

PYTHON=${PYTHON:-python}
RAY_PORT=${RAY_PORT:-6379}
RAY_OBJECT_STORE_BYTES=${RAY_OBJECT_STORE_BYTES:-1073741824}
RAY_WAIT_S=${RAY_WAIT_S:-120}
read -r -a CONTAINER_CMD <<< "${CONTAINER:-}"
DETECTED_GPUS=0
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
  DETECTED_GPUS=$(nvidia-smi -L | wc -l)
fi
NUM_GPUS=${NUM_GPUS:-$DETECTED_GPUS}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  if (( NUM_GPUS > 0 )); then GPUS_PER_NODE=$NUM_GPUS; else GPUS_PER_NODE=2; fi
fi
CORES=$(nproc)
NUM_CPUS=${NUM_CPUS:-$(( CORES > 2 * GPUS_PER_NODE ? CORES : 2 * GPUS_PER_NODE ))}
NODE_IP=$(hostname -I 2> /dev/null | awk '{print $1}')
NODE_IP=${NODE_IP:-127.0.0.1}
ADDRESS="$NODE_IP:$RAY_PORT"
echo "local.sh: Ray head $ADDRESS with $NUM_CPUS CPU(s), $NUM_GPUS GPU(s); trainer ranks: $GPUS_PER_NODE"

RAY_PID=""
# shellcheck disable=SC2317  # called through the EXIT trap
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [[ -n "$RAY_PID" ]] && kill -0 "$RAY_PID" 2> /dev/null; then
    echo "local.sh: stopping Ray" >&2
    kill -TERM "$RAY_PID" 2> /dev/null || true  # `ray start --block` shuts its node down on SIGTERM
    for _ in $(seq 60); do kill -0 "$RAY_PID" 2> /dev/null || break; sleep 0.5; done
    kill -KILL "$RAY_PID" 2> /dev/null || true
    wait "$RAY_PID" 2> /dev/null || true
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"${CONTAINER_CMD[@]}" ray start --head --block --node-ip-address="$NODE_IP" --port="$RAY_PORT" \
  --num-cpus="$NUM_CPUS" --num-gpus="$NUM_GPUS" --object-store-memory="$RAY_OBJECT_STORE_BYTES" \
  --include-dashboard=false --disable-usage-stats &
RAY_PID=$!

deadline=$((SECONDS + RAY_WAIT_S))
until timeout 60 "${CONTAINER_CMD[@]}" "$PYTHON" -c "
import ray
ray.init(address='$ADDRESS', logging_level='ERROR', include_dashboard=False)
assert any(n['Alive'] for n in ray.nodes())
" > /dev/null 2>&1; do
  if ! kill -0 "$RAY_PID" 2> /dev/null; then
    echo "local.sh: ray start exited early (port $RAY_PORT in use? set RAY_PORT)" >&2
    exit 3
  fi
  if (( SECONDS >= deadline )); then
    echo "local.sh: Ray head at $ADDRESS not up after RAY_WAIT_S=${RAY_WAIT_S}s" >&2
    exit 3
  fi
  sleep 2
done
echo "local.sh: Ray up"

set +e
"${CONTAINER_CMD[@]}" "$PYTHON" -m scaletrain.trainer.main_ppo \
  trainer.nnodes=1 trainer.n_gpus_per_node="$GPUS_PER_NODE" ray_kwargs.ray_init.address="$ADDRESS" "$@"
rc=$?
set -e
echo "local.sh: trainer exited with $rc"
exit "$rc"
