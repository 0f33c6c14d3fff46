#!/usr/bin/env bash
# A vision-language model learns a visual task on a 2-core CPU machine: SFT warm-up, then GRPO, from images.
# The tiny random-init Qwen2.5-VL (python -m scaletrain.models.prepare tiny-qwen2.5-vl) on the synthetic `colour`
# task (one shape, six colours: "what colour?"), FSDP2 on 2 ranks, the HF rollout engine generating from the images.
# SFT trains on the task's RL parquet (the answers as responses) until greedy accuracy on the held-out images reaches
# SFT_STOP, then GRPO starts from its checkpoint; validation (greedy, the held-out images) before GRPO and every
# TEST_FREQ steps. The SFT checkpoint is cached per seed and backend under OUT (delete it to redo the warm-up).
#
#   launch/recipes/tiny_vlm_visual.sh                                  # the measured recipe (docs/multimodal.md)
#   BACKEND=deepspeed STEPS=2 launch/recipes/tiny_vlm_visual.sh trainer.val_before_train=false
#   python launch/recipes/seeds.py --out DIR -- $(PRINT_ONLY=1 launch/recipes/tiny_vlm_visual.sh)  # GRPO, 3 seeds
#
# Arguments are extra Hydra overrides for the GRPO run (`python -m scaletrain.trainer.main_ppo`). From the environment:
#   PYTHON      Python to run                                          default: .venv/bin/python, else python
#   TASK        visual task (scaletrain/data/preprocess/visual.py)      default: colour
#   TRAIN_SIZE  training problems / TEST_SIZE held-out problems        default: 2000 / 200
#   SFT_STOP    SFT stops at this greedy held-out accuracy             default: 0.3
#   SFT_STEPS   SFT steps at most                                      default: 600
#   STEPS       GRPO steps / TEST_FREQ steps between validations       default: 60 / 10
#   BACKEND     fsdp | deepspeed                                       default: fsdp
#   SEED        the SFT warm-up's seed                                 default: 1
#   OUT         where data and runs go                                 default: outputs/tiny_vlm_visual
#   PRINT_ONLY  set: prepare the model, data and SFT checkpoint, print the GRPO run's overrides, do not train GRPO
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
TASK=${TASK:-colour}
TRAIN_SIZE=${TRAIN_SIZE:-2000}
TEST_SIZE=${TEST_SIZE:-200}
SFT_STOP=${SFT_STOP:-0.3}
SFT_STEPS=${SFT_STEPS:-600}
STEPS=${STEPS:-60}
TEST_FREQ=${TEST_FREQ:-10}
BACKEND=${BACKEND:-fsdp}
SEED=${SEED:-1}
OUT=${OUT:-outputs/tiny_vlm_visual}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL=$("$PYTHON" -m scaletrain.models.prepare tiny-qwen2.5-vl)
DATA="$OUT/data/$TASK"
if [[ ! -f "$DATA/test.parquet" ]]; then
  "$PYTHON" -m scaletrain.data.preprocess.visual --task "$TASK" --output_dir "$DATA" \
    --train_size "$TRAIN_SIZE" --test_size "$TEST_SIZE" --seed 0 >&2
fi

SFT_DIR="$OUT/sft/${TASK}_${BACKEND}_seed${SEED}_acc${SFT_STOP}"
if [[ ! -f "$SFT_DIR/hf/config.json" ]]; then
  "$PYTHON" -m scaletrain.trainer.main_sft backend.name="$BACKEND" model.path="$MODEL" \
    data.train_files="$DATA/train.parquet" data.val_prompts_file="$DATA/test.parquet" \
    data.response_key=reward_model.ground_truth data.max_prompt_length=64 data.max_response_length=8 \
    data.train_batch_size=64 data.micro_batch_size_per_gpu=32 data.seed="$SEED" trainer.seed="$SEED" \
    optim.lr=1e-3 optim.warmup_steps=20 trainer.total_steps="$SFT_STEPS" trainer.test_freq=5 \
    trainer.stop_at_val_acc="$SFT_STOP" trainer.project_name=tiny_vlm_visual trainer.experiment_name=sft \
    trainer.default_local_dir="$SFT_DIR" trainer.logger=[console,jsonl] >&2
fi

RUN_NAME="${TASK}_${BACKEND}"
ARGS=(
  backend="$BACKEND" rollout=hf algorithm.adv_estimator=grpo
  actor_rollout_ref.model.path="$SFT_DIR/hf"
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet"
  data.train_batch_size=32 data.max_prompt_length=64 data.max_response_length=8
  actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64
  actor_rollout_ref.actor.optim.lr=1e-4
  trainer.total_training_steps="$STEPS" trainer.test_freq="$TEST_FREQ" trainer.save_freq=-1
  trainer.project_name=tiny_vlm_visual trainer.experiment_name="$RUN_NAME"
  trainer.default_local_dir="$OUT/runs/$RUN_NAME" trainer.logger=[console,jsonl]
  "$@"
)
if [[ -n "${PRINT_ONLY:-}" ]]; then  # the GRPO run's overrides, one per line, for scaletrain.trainer.main_ppo.run
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
exec "$PYTHON" -m scaletrain.trainer.main_ppo "${ARGS[@]}"
