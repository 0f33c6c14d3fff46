"""Checks of the reward's services before Ray (layer 4's config): the remote judge (``reward.judge.*``), the code
sandbox (``reward.sandbox_fusion.*``), a generative judge on the run's own engines (``reward_model.rollout.*``,
``enable_resource_pool``) and a reward model served over HTTP (``reward.remote_rm.*``); each raises ConfigError
naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.config.rollout_checks import validate_rollout_model, validate_rollout_tp
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.rm_config import serves_judge

JUDGE_ENGINES = ("vllm", "hf")


def validate_reward_services(cfg: PPOConfig) -> None:
    _validate_judge(cfg)
    _validate_sandbox_fusion(cfg)
    _validate_generative_judge(cfg)
    _validate_remote_rm(cfg)


def _service_checked(settings: Any, check: Callable[[Any], None]) -> bool:
    """Whether a service section (``settings.enabled``: its URL set) is in use, its settings checked by ``check``
    (a ValueError naming the key becomes a ConfigError) when it is."""
    if not settings.enabled:
        return False
    try:
        check(settings)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return True


def _validate_remote_rm(cfg: PPOConfig) -> None:
    """``reward.remote_rm.*``: good settings, and no second reward model."""
    from scaletrain.reward.remote_rm import check_remote_rm_settings

    remote = cfg.reward.remote_rm
    if not _service_checked(remote, check_remote_rm_settings):
        return
    if cfg.reward_model.enable:
        raise ConfigError(
            f"reward.remote_rm.url ({remote.url}) and reward_model.enable=true are two reward models: the reward "
            "adds one model's score; remove one of them"
        )


def _validate_generative_judge(cfg: PPOConfig) -> None:
    """A generative reward model: an engine that exists, lengths and a TP size the model takes, ranks for it, a
    reward function to call it, and no second judge. ``enable_resource_pool`` serves only such a judge."""
    rm = cfg.reward_model
    if not serves_judge(rm):
        if rm.enable and rm.enable_resource_pool:
            raise ConfigError(
                "reward_model.enable_resource_pool=true puts a generative judge's engines on a pool of their own: "
                "set reward_model.rollout.name (vllm | hf) and a causal LM at reward_model.model.path, or remove it "
                "(a sequence classifier is scored on the actor's ranks)"
            )
        return
    rc, key = rm.rollout, "reward_model.rollout"
    assert rm.model.path is not None  # serves_judge
    if rc.name not in JUDGE_ENGINES:
        raise ConfigError(f"{key}.name must be one of {', '.join(JUDGE_ENGINES)}, got '{rc.name}'")
    rc.check(key, None if cfg.trainer.device == "auto" else cfg.trainer.device)
    for name in ("prompt_length", "response_length"):
        if getattr(rc, name) <= 0:
            raise ConfigError(f"{key}.{name} must be positive, got {getattr(rc, name)}")
    for name in ("n_gpus_per_node", "nnodes"):
        if getattr(rm, name) < 1:
            raise ConfigError(f"reward_model.{name} must be >= 1, got {getattr(rm, name)}")
    ranks = rm.n_gpus_per_node * rm.nnodes if rm.enable_resource_pool else cfg.world_size
    validate_rollout_tp(rc, ranks, key)
    validate_rollout_model(rc, rm.model.path, key)
    if cfg.reward.judge.enabled:
        raise ConfigError(
            f"reward.judge.base_url ({cfg.reward.judge.base_url}) and a generative reward model "
            f"({key}.name={rc.name}) are two judges: the reward function gets one; remove one of them"
        )
    if not cfg.custom_reward_function.path:
        raise ConfigError(
            f"a generative reward model ({key}.name={rc.name}) needs custom_reward_function.path: an async def "
            "compute_score(..., judge) that builds the judge's prompt and reads its verdict"
        )
    if not rm.enable_resource_pool and cfg.async_training.mode != "sync":
        raise ConfigError(
            f"async_training.mode={cfg.async_training.mode} scores rollouts while the actor trains, and a judge "
            "colocated with the actor sleeps while it trains: set reward_model.enable_resource_pool=true"
        )
    _service_manager(cfg, "reward.judge")


def _validate_judge(cfg: PPOConfig) -> None:
    """``reward.judge.*``: good settings, a reward function of the user's to call the judge, and a reward manager
    that scores with it."""
    from scaletrain.reward.judge import check_judge_settings

    if not _service_checked(cfg.reward.judge, check_judge_settings):
        return
    if not cfg.custom_reward_function.path:
        raise ConfigError(
            "reward.judge.base_url needs custom_reward_function.path: an async def compute_score(..., judge) that "
            "builds the judge's prompt and reads its verdict"
        )
    _service_manager(cfg, "reward.judge")


def _validate_sandbox_fusion(cfg: PPOConfig) -> None:
    """``reward.sandbox_fusion.*``: good settings and a reward manager that scores with the sandbox."""
    from scaletrain.reward.sandbox_fusion import check_sandbox_fusion_settings

    if _service_checked(cfg.reward.sandbox_fusion, check_sandbox_fusion_settings):
        _service_manager(cfg, "reward.sandbox_fusion")


def _service_manager(cfg: PPOConfig, section: str) -> None:
    """A remote reward service needs a reward manager that binds it: the scaletrain managers do (the multi manager
    binds the judge to the components that take it, and offers them no sandbox); a reward-loop or verl-interface
    manager takes no service."""
    from scaletrain.reward import MultiRewardManager, RewardManager
    from scaletrain.reward.managers.reward_loop import reward_manager_class

    manager = reward_manager_class(cfg.reward_model.reward_manager)
    multi = issubclass(manager, MultiRewardManager)
    if not issubclass(manager, RewardManager) or (multi and section == "reward.sandbox_fusion"):
        use = "naive, prime, batch, dapo" + (" or multi" if section == "reward.judge" else "")
        raise ConfigError(
            f"reward_model.reward_manager={cfg.reward_model.reward_manager} does not score with {section}: use {use}"
        )
