"""One config tree resolved once: the embedded recipe overlay, the pure ``resolve_config``, ``check_config`` changing
nothing, and the frozen run plan."""

import copy
import dataclasses

import pytest

from scaletrain.trainer.config.checks import check_config
from scaletrain.trainer.config.plan import plan_run, resolve_config
from scaletrain.trainer.config.ppo_config import PPOConfig, load_ppo_config
from scaletrain.trainer.embedded_default import apply_embedded_overlay, embedded_overlay
from scaletrain.utils.typed_config import to_dict
from tests.trainer.config.test_ppo_config import composed


def test_overlay_sets_the_embedded_sizes_only_where_the_user_did_not():
    raw = composed("data.train_batch_size=64", "trainer.test_freq=-1")
    out, applied = apply_embedded_overlay(raw, explicit=["data.train_batch_size", "trainer.test_freq"])
    cfg = load_ppo_config(out)
    assert cfg.data.train_batch_size == 64 and cfg.trainer.test_freq == -1  # named on the command line: kept
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (8, 5)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-4 and cfg.trainer.total_training_steps == 700
    assert "data.train_batch_size" not in applied and "data.max_prompt_length" in applied
    assert raw["data"]["max_prompt_length"] == 512, "the input dict is not changed"
    # a Python caller's dict: a value moved off the default is the user's
    python_raw = to_dict(PPOConfig())
    python_raw["actor_rollout_ref"]["actor"]["optim"]["lr"] = 3e-5
    cfg = load_ppo_config(apply_embedded_overlay(python_raw)[0])
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-5 and cfg.data.max_prompt_length == 8


def test_overlay_is_off_with_the_users_data(tmp_path):
    raw = composed(f"data.train_files={tmp_path / 'train.parquet'}")
    out, applied = apply_embedded_overlay(raw)
    assert applied == [] and out == raw
    assert load_ppo_config(out).data.max_prompt_length == PPOConfig().data.max_prompt_length == 512


def test_every_overlay_key_is_a_config_key():
    defaults = to_dict(PPOConfig())

    def walk(tree, node, prefix=""):
        for key, value in tree.items():
            assert key in node, f"configs/recipe/embedded.yaml: {prefix}{key} is not a config key"
            if isinstance(value, dict):
                walk(value, node[key], f"{prefix}{key}.")

    walk(embedded_overlay(), defaults)


def test_resolve_fills_the_fallbacks_and_leaves_its_input_alone():
    cfg = load_ppo_config(
        composed("backend=megatron", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=true")
    )
    before = copy.deepcopy(to_dict(cfg))
    resolved = resolve_config(cfg)
    assert to_dict(cfg) == before
    arr = resolved.actor_rollout_ref
    assert (arr.rollout.prompt_length, arr.rollout.response_length) == (512, 512)
    assert arr.rollout.log_prob_use_dynamic_bsz is True and arr.ref.log_prob_use_dynamic_bsz is True
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.actor.ppo_max_token_len_per_gpu
    assert resolved.critic.ppo_mini_batch_size == 256 and resolved.critic.ppo_epochs == 1
    assert resolved.trainer.experiment_name == "gae_megatron" and resolved.trainer.device in ("cpu", "cuda")
    assert resolved.trainer.default_local_dir == "checkpoints/scaletrain/gae_megatron"
    assert resolved.backend.extra["megatron"]["tensor_model_parallel_size"] == 1
    assert resolve_config(resolved) == resolved, "resolving twice changes nothing"
    explicit = resolve_config(load_ppo_config(composed("actor_rollout_ref.rollout.response_length=7")))
    assert explicit.actor_rollout_ref.rollout.response_length == 7


def test_check_config_changes_nothing():
    cfg = resolve_config(load_ppo_config(composed("backend=megatron", "algorithm.adv_estimator=gae")))
    before = copy.deepcopy(to_dict(cfg))
    assert check_config(cfg) is cfg and to_dict(cfg) == before


def test_plan_counts_steps_and_names_the_resume_point(tmp_path):
    cfg = resolve_config(
        load_ppo_config(
            composed(
                "algorithm.adv_estimator=gae",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_epochs=2",
                "critic.ppo_mini_batch_size=2",
                "trainer.total_epochs=3",
                f"trainer.default_local_dir={tmp_path}",
            )
        )
    )
    plan = plan_run(cfg, train_rows=20, latest_checkpoint=str(tmp_path / "global_step_4"))
    assert (plan.steps_per_epoch, plan.total_steps) == (2, 6)
    assert plan.actor_optim_steps == 6 * 2 * 2 and plan.critic_optim_steps == 6 * 4 * 2
    assert plan.use_critic and not plan.use_ref and plan.run_dir == str(tmp_path)
    assert (plan.resume_path, plan.resume_step) == (str(tmp_path / "global_step_4"), 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.total_steps = 1
    fresh = plan_run(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode="disable")), 20, "x")
    assert fresh.resume_path is None and fresh.resume_step is None
