"""Every config key reaches what it configures: a mutation test generated over the config's leaves (issue 30,
item 7; the static read check in test_config_keys.py passes for a field whose name some other class reads).

Each leaf's value is changed (a bool flipped, a number moved, a known alternative for a string, else a value no
check accepts) in a base config with every role on (GAE's critic, a reward model; fsdp and megatron), and the run is
planned and its workers' configs built as the trainer does before Ray starts (``check_config``, ``plan_run``,
``ppo_worker_configs``). The change must show in the plan or in a worker's config, or be refused with a
``ConfigError`` naming a key. What the driver reads itself, in its loop, is ``DRIVER_READ``; a key that stops
reaching its worker (a dropped line in worker_configs.py) leaves the handed-on set and fails here, and so does a
driver key that starts reaching one (the list must be kept true both ways)."""

from __future__ import annotations

import copy
import typing

import pytest

from scaletrain.trainer.config.checks import check_config
from scaletrain.trainer.config.plan import plan_run, resolve_config
from scaletrain.trainer.config.ppo_config import PPOConfig, load_ppo_config
from scaletrain.trainer.config.worker_configs import ppo_worker_configs
from scaletrain.utils.typed_config import ConfigError, leaf_fields, to_dict
from tests.backends.tiny import save_tiny_reward_model
from tests.trainer.config.test_ppo_config import composed

# a valid other value, by dotted key or else by field name: a string no check accepts would be refused before it
# reaches the worker, which would hide a dropped line
ALTERNATIVES = {
    "backend.name": "deepspeed",
    "actor_rollout_ref.rollout.name": "vllm",
    "loss_agg_mode": "seq-mean-token-sum",
    "dtype": "bfloat16",
    "attn_implementation": "eager",
    "kl_loss_type": "kl",
    "loss_mode": "gspo",
    "load_format": "dummy",
}
# read by the driver itself (the trainer loop, the reward manager, the data loader, the run shell), not handed to a
# worker: their effects are tested where the driver uses them (test_ppo_config.py, the end-to-end runs)
DRIVER_READ = {
    *(f"data.{k}" for k in ("val_batch_size", "filter_overlong_prompts", "truncation", "shuffle", "seed")),
    *(f"data.{k}" for k in ("prompt_key", "reward_fn_key", "image_key", "video_key", "max_samples", "val_max_samples")),
    "critic.enable",  # decides whether a critic exists (the base has one either way: GAE)
    "actor_rollout_ref.actor.optim.total_steps",  # derived by the plan, whatever the key says
    "critic.optim.total_steps",
    *(f"reward_model.{k}" for k in ("timeout_s", "load_timeout_s", "num_processes", "step_timeout_s")),
    "reward_model.max_error_rate",
    "reward_model.max_error_steps",
    "custom_reward_function.name",
    "custom_reward_function.reward_kwargs",
    *(f"algorithm.{k}" for k in ("gamma", "lam", "norm_adv_by_std_in_grpo", "kl_penalty", "filter_overlong_responses")),
    "algorithm.gdpo_reward_keys",  # the advantage step reads it (gdpo)
    *(f"algorithm.kl_ctrl.{k}" for k in ("type", "kl_coef", "horizon", "target_kl")),
    *(f"algorithm.rollout_correction.{k}" for k in ("rollout_is_threshold", "bypass_mode")),
    "algorithm.rollout_correction.mismatch_log_prob_threshold",
    *(f"algorithm.filter_groups.{k}" for k in ("enable", "metric", "max_num_gen_batches")),
    *(f"trainer.{k}" for k in ("total_epochs", "device", "save_freq", "save_freq_minutes", "test_freq")),
    *(f"trainer.{k}" for k in ("val_before_train", "resume_from_path", "max_ckpt_to_keep", "save_hf_at_end")),
    *(f"trainer.{k}" for k in ("save_merged", "plot_at_end", "worker_call_timeout_s", "rollout_data_dir")),
    *(f"trainer.{k}" for k in ("validation_data_dir", "log_val_generations", "critic_warmup", "balance_batch")),
    *(f"trainer.{k}" for k in ("verbose", "device_memory_gib")),
    "async_training.partial_rollout_segment_tokens",
    *(f"ray_kwargs.ray_init.{k}" for k in ("address", "num_cpus", "num_gpus", "object_store_memory", "resources")),
    *(f"ray_kwargs.ray_init.{k}" for k in ("namespace", "runtime_env", "include_dashboard", "dashboard_host")),
    "ray_kwargs.ray_init.dashboard_port",
    "ray_kwargs.timeline_json_file",
    *(f"reward.health.{k}" for k in ("max_zero_variance_groups", "max_format_only", "max_length_corr", "patience")),
    *(f"reward.health.{k}" for k in ("max_judge_rule_disagreement", "format_component", "answer_components")),
    *(f"reward.judge.{k}" for k in ("model", "api_key_env", "max_concurrent", "max_rpm", "timeout_s")),
    *(f"reward.judge.{k}" for k in ("max_retries", "backoff_s")),
    *(f"reward.sandbox_fusion.{k}" for k in ("max_concurrent", "memory_limit_mb", "run_timeout_s", "timeout_s")),
    *(f"reward.sandbox_fusion.{k}" for k in ("max_retries", "backoff_s", "max_rpm")),
    *(f"reward.remote_rm.{k}" for k in ("api_key_env", "max_concurrent", "batch_size", "timeout_s", "max_retries")),
    "reward.remote_rm.backoff_s",  # the driver's RemoteScores calls the service
    "reward.remote_rm.max_rpm",
    "reward.num_workers",
    "reward.stream",
    "reward.rule_weight",  # the driver sums the rewards
    "reward.reward_model_weight",  # the driver's reward manager holds the judge
}


def alternative(key: str) -> str | None:
    return ALTERNATIVES.get(key, ALTERNATIVES.get(key.rsplit(".", 1)[-1]))


def mutated(value, annotation, key):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 + 0.013
    if isinstance(value, str):
        other = alternative(key)
        return other if other not in (None, value) else value + "_mutated"
    if isinstance(value, dict):
        return {**value, "mutated": 1}
    if isinstance(value, list | tuple):
        return [*value, "mutated"]
    kinds = typing.get_args(annotation)  # None: the first concrete type the annotation allows
    return next((example for kind, example in ((int, 3), (float, 0.37), (bool, True)) if kind in kinds), "mutated")


# the sections that travel whole to their workers (each worker's config is its section, ppo_worker_configs)
WORKER_SECTIONS = ("actor_rollout_ref", "critic", "reward_model")


def worker_view(args, section: str):
    """A worker's arguments (its section, its setup) without the section's keys the driver reads: those travel
    with the section, but no worker reads them, so they must show elsewhere or be listed in DRIVER_READ."""
    if args is None:
        return None
    config, setup = args
    data = to_dict(config)
    for key in DRIVER_READ:
        if key.startswith(section + "."):
            *parents, leaf = key.split(".")[1:]
            node = data
            for part in parents:
                node = node[part]
            node.pop(leaf)
    return data, setup


def observed(data: dict) -> str:
    """What the trainer derives before Ray starts: the plan and every worker's arguments (not the config itself)."""
    cfg = check_config(resolve_config(load_ppo_config(data)))
    plan = plan_run(cfg, 64, None)
    workers = ppo_worker_configs(cfg, plan)
    return repr((plan, [worker_view(args, section) for args, section in zip(workers, WORKER_SECTIONS)]))


@pytest.fixture(scope="module")
def bases(task, tmp_path_factory):
    rm = save_tiny_reward_model(str(tmp_path_factory.mktemp("rm")))
    common = [
        f"actor_rollout_ref.model.path={task['model']}",
        f"data.train_files={task['train']}",
        "data.train_batch_size=256",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        "rollout=hf",
        "algorithm.adv_estimator=gae",
        "reward_model.enable=true",
        f"reward_model.model.path={rm}",
        f"reward_model.model.input_tokenizer={task['model']}",
    ]
    return [composed(*common), composed(*common, "backend=megatron")]


def test_every_key_reaches_a_worker_or_is_refused_or_is_read_by_the_driver(bases):
    baselines = [observed(base) for base in bases]
    silent = []
    for key, owner, f in leaf_fields(PPOConfig):
        annotation = typing.get_type_hints(owner)[f.name]
        shown = False
        for base, baseline in zip(bases, baselines):
            data = copy.deepcopy(base)
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                node = node[part]
            node[leaf] = mutated(node[leaf], annotation, key)
            try:
                shown = observed(data) != baseline
            except ConfigError:
                shown = alternative(key) is None  # a valid alternative must reach the worker, not be refused
            if shown:
                break
        if not shown:
            silent.append(key)
    assert set(silent) - DRIVER_READ == set(), "keys that reach no worker and are not read by the driver"
    assert DRIVER_READ - set(silent) == set(), "DRIVER_READ lists keys that do reach a worker: take them out"
