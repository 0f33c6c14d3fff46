"""A vision-language model through the trainer (the CLI's in-process entry point): 2 GRPO steps of the tiny
Qwen2.5-VL on the synthetic visual task, on fsdp (through the agent loops) and on deepspeed (the batched
generate), with the HF rollout engine generating from the images; the exported HF checkpoint is a VLM whose vision
tower trained (left as it was with ``actor.freeze_vision_tower``, the language model trained). SFT of the VLM on
the task's RL parquet, on both backends. What a VLM run cannot do yet is refused before Ray, naming the key
(scaletrain/trainer/config/vision_checks.py)."""

from __future__ import annotations

import os

import pytest
import torch

from scaletrain.models.processor import load_processor
from tests.backends.vlm_batch import save_vlm_head_model
from tests.trainer.runs import metrics, run_in_process


@pytest.fixture(scope="module")
def visual(tmp_path_factory):
    from scaletrain.data.preprocess.visual import write_task
    from scaletrain.models.prepare import prepare_model

    work = tmp_path_factory.mktemp("visual")
    files = write_task("count", str(work / "count"), train_size=16, test_size=4, seed=0)
    return {"model": prepare_model("tiny-qwen2.5-vl", work / "vlm"), "train": files["train"], "test": files["test"]}


HASH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""
VLM_RUN = [
    "data.max_prompt_length=64",  # the image's 16 vision tokens and the question
    "data.max_response_length=3",
    "trainer.val_before_train=false",
    "trainer.plot_at_end=false",
    "trainer.save_freq=-1",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, frozen, agent_loops, critic_and_rm", [("fsdp", False, True, False), ("deepspeed", True, False, True)]
)
def test_two_steps_of_a_vlm_from_images(ray_cluster, visual, tmp_path, backend, frozen, agent_loops, critic_and_rm):
    """GRPO through the agent loops on fsdp; on deepspeed GAE with a VLM critic (from the actor's checkpoint) and a
    VLM reward model (tests/backends/vlm_batch.py's), both reading the rollouts' images."""
    from transformers import AutoModelForImageTextToText

    # a random model scores 0 on the task: a hash of the response gives the samples of one prompt other rewards,
    # so the advantages (and the gradients reaching the vision tower through the image tokens) are not 0
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(HASH_REWARD)
    overrides = [*VLM_RUN, f"backend.name={backend}", f"custom_reward_function.path={reward_file}"]
    overrides.append(f"actor_rollout_ref.actor.freeze_vision_tower={str(frozen).lower()}")
    overrides.append(f"actor_rollout_ref.rollout.multi_turn.enable={str(agent_loops).lower()}")
    if agent_loops:  # and rows of several lengths: token-balanced ranks, micro-batches by token budget
        overrides += ["trainer.balance_batch=true", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
        overrides.append("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160")
    if critic_and_rm:
        rm = save_vlm_head_model(visual["model"], tmp_path / "rm", "reward")
        overrides += ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-3"]
        overrides += ["reward_model.enable=true", f"reward_model.model.path={rm}"]
    result = run_in_process(visual, tmp_path / "run", 2, overrides)
    logged = metrics(result.run_dir)
    for step in (1, 2):
        assert "critic/score/mean" in logged[step] and torch.isfinite(torch.tensor(logged[step]["actor/pg_loss"]))
    assert logged[1]["critic/advantages/max"] > 0
    if critic_and_rm:  # the critic trained and valued the rows; the reward model scored them (differently)
        assert all(torch.isfinite(torch.tensor(logged[s]["critic/vf_loss"])) for s in (1, 2))
        assert logged[1]["critic/values/max"] != logged[1]["critic/values/min"]
        assert logged[1]["reward_model/score/max"] > logged[1]["reward_model/score/min"]
    assert ("agent/generate_requests" in logged[1]) == agent_loops  # the rollout path this run took
    assert any(k.startswith("val-core/scaletrain/visual/count/") for k in logged[2])  # validated on the images
    # the exported checkpoint loads as a VLM, its vision tower trained (or left as it was, frozen)
    before = AutoModelForImageTextToText.from_pretrained(visual["model"]).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(result.hf_checkpoint).state_dict()
    assert load_processor(result.hf_checkpoint) is not None  # the export carries the processor: a VLM to train on
    vision = [name for name in before if ".visual." in name]
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert vision and bool(changed & set(vision)) != frozen, f"vision tower changed: {bool(changed & set(vision))}"
    assert changed - set(vision), "the language model did not train"


def test_freeze_vision_tower_on_a_text_model_is_refused(visual, tmp_path):
    from scaletrain.data import build_embedded_default
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    text = {**visual, "model": build_embedded_default()["model"]}
    args = ppo_overrides(text, tmp_path / "run", 2, [*VLM_RUN, "actor_rollout_ref.actor.freeze_vision_tower=true"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.freeze_vision_tower: .* has no vision tower"):
        checked(*args)


@pytest.mark.slow
def test_lora_on_a_vlms_language_model(ray_cluster, visual, tmp_path):
    """LoRA on the VLM: adapters on the language model's linear layers only (the vision tower gets none, frozen);
    the HF rollout generates from the images with the synced weights; the exported adapter names no vision module."""
    from safetensors.torch import load_file

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(HASH_REWARD)
    overrides = [*VLM_RUN, "actor_rollout_ref.model.lora_rank=4", f"custom_reward_function.path={reward_file}"]
    result = run_in_process(visual, tmp_path / "run", 2, overrides)
    logged = metrics(result.run_dir)
    assert torch.isfinite(torch.tensor(logged[2]["actor/pg_loss"])) and logged[1]["critic/advantages/max"] > 0
    adapter = load_file(os.path.join(result.hf_checkpoint, "adapter_model.safetensors"))
    names = list(adapter)
    assert any(".language_model." in n and "lora_A" in n for n in names), names[:4]
    assert not any("visual" in n for n in names), [n for n in names if "visual" in n][:4]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_asynchronous_training_of_a_vlm(ray_cluster, visual, tmp_path, mode):
    """Split placement (a rollout rank of its own) with the asynchronous schedules: the trained weights, vision
    tower included, reach the rollout engine after every step. fully_async at staleness 0 generates each step with
    the weights being trained, so the rollout's log-probs equal the trainer's (the actor's lr is high enough that a
    tower left unsynced would show)."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(HASH_REWARD)
    overrides = [*VLM_RUN, f"custom_reward_function.path={reward_file}", "actor_rollout_ref.actor.optim.lr=1e-3"]
    overrides += ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1"]
    overrides += ["actor_rollout_ref.rollout.n_gpus_per_node=1", "data.train_batch_size=2"]
    if mode == "fully_async":
        overrides += ["async_training.mode=fully_async", "data.train_batch_size=0"]
    else:
        overrides += ["async_training.mode=one_step_off"]
    logged = metrics(run_in_process(visual, tmp_path / "run", 3, overrides).run_dir)
    staleness = 0.0 if mode == "fully_async" else 1.0
    for step in (2, 3):
        assert logged[step]["async/weight_version"] == step and logged[step]["async/staleness_max"] == staleness
        assert torch.isfinite(torch.tensor(logged[step]["actor/pg_loss"]))
        if mode == "fully_async":
            assert logged[step]["rollout_corr/log_prob_abs_diff_max"] < 1e-4, logged[step]


@pytest.mark.slow
def test_the_recipe_shortened_sft_then_grpo(ray_cluster, tmp_path):
    """launch/recipes/tiny_vlm_visual.sh shortened: its SFT stage as the script runs it (PRINT_ONLY: model, data and
    the SFT checkpoint, fsdp), then 2 GRPO steps of its printed overrides in this process, from that checkpoint."""
    import subprocess
    import sys

    from scaletrain.models.prepare import prepare_model
    from scaletrain.trainer.main_ppo import run
    from tests.trainer.runs import ROOT, env

    run_env = dict(env(), PYTHON=sys.executable, OUT=str(tmp_path), PRINT_ONLY="1", TRAIN_SIZE="64", TEST_SIZE="8")
    run_env.update(SFT_STEPS="2", SFT_STOP="1.0", STEPS="2", TEST_FREQ="2")
    shorter = [
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ]
    script = str(ROOT / "launch/recipes/tiny_vlm_visual.sh")
    proc = subprocess.run([script, *shorter], env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    overrides = proc.stdout.splitlines()
    sft_dir = next(o for o in overrides if o.startswith("actor_rollout_ref.model.path=")).split("=", 1)[1]
    assert load_processor(sft_dir) is not None  # the SFT export is a VLM with its processor, its vision tower trained
    assert_vision_tower_changed(prepare_model("tiny-qwen2.5-vl"), sft_dir)
    result = run([*overrides, "trainer.val_before_train=false", "trainer.plot_at_end=false"])
    logged = metrics(result.run_dir)
    assert torch.isfinite(torch.tensor(logged[2]["actor/pg_loss"]))
    assert "val/scaletrain/visual/colour/acc" in logged[2]


def assert_vision_tower_changed(before_dir: str, after_dir: str) -> None:
    from transformers import AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(before_dir).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(after_dir).state_dict()
    vision = [name for name in before if ".visual." in name]
    assert vision and any(not torch.equal(before[n], after[n]) for n in vision), "the vision tower did not train"


@pytest.mark.slow
def test_sft_of_a_vlm_on_the_tasks_rl_parquet(ray_cluster, visual, tmp_path):
    """SFT reads the task's RL parquet (the answers as responses), trains the whole VLM on the images and measures
    greedy accuracy on the test images; the saved checkpoint is a VLM whose vision tower trained. On deepspeed here;
    fsdp's is the recipe's SFT stage above."""
    backend = "deepspeed"
    from scaletrain.trainer.sft_trainer import run_sft

    data = {"train_files": visual["train"], "val_files": visual["test"], "val_prompts_file": visual["test"]}
    data.update(response_key="reward_model.ground_truth", train_batch_size=8, micro_batch_size_per_gpu=2)
    data.update(max_prompt_length=64, max_response_length=3)
    summary = run_sft(
        {
            "data": data,
            "model": {"path": visual["model"]},
            "backend": {"name": backend},
            "trainer": {"total_steps": 2, "test_freq": 2, "default_local_dir": str(tmp_path), "logger": ["jsonl"]},
        }
    )
    assert summary["step"] == 2 and 0.0 <= summary["val_acc"] <= 1.0 and summary["val_loss"] > 0
    assert load_processor(summary["hf_path"]) is not None
    assert_vision_tower_changed(visual["model"], summary["hf_path"])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["backend.name=megatron"], "backend.name"),
        (["actor_rollout_ref.rollout.name=vllm"], "actor_rollout_ref.rollout.name"),
        (["algorithm.adv_estimator=gae", "critic.model.path=TEXT"], "critic.model.path"),
        (["reward_model.enable=true", "reward_model.model.path=TEXT"], "reward_model.model.path"),
        (
            ["reward_model.enable=true", "reward_model.model.path=RM", "reward_model.model.input_tokenizer=VLM"],
            "reward_model.model.input_tokenizer",
        ),
    ],
)
def test_what_a_vlm_run_cannot_do_yet_is_refused_naming_the_key(visual, tmp_path, overrides, key):
    from scaletrain.data import build_embedded_default
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    text, vlm = build_embedded_default()["model"], visual["model"]
    paths = {"TEXT": text, "VLM": vlm, "RM": save_vlm_head_model(vlm, tmp_path / "rm", "reward")}
    overrides = [o.split("=")[0] + "=" + paths.get(o.split("=")[1], o.split("=")[1]) for o in overrides]
    args = ppo_overrides(visual, tmp_path / "run", 2, [*VLM_RUN, *overrides])
    with pytest.raises(ConfigError, match=rf"^{key}: actor_rollout_ref.model.path=.* is a vision-language model"):
        checked(*args)
