"""The mixture-of-experts keys (``*.model.router_aux_loss_coef`` / ``router_z_loss_coef``): defaults, the engines'
settings they become, and the checks before Ray (a careless value is refused naming the key)."""

import pytest

from scaletrain.utils.typed_config import ConfigError
from tests.trainer.config.test_ppo_config import checked


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3-MoE and a dense tiny Qwen3 (config.json is what the checks read)."""
    from scaletrain.data.embedded import save_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {a: save_tiny_model(root / a, architecture=a) for a in ("qwen3_moe", "qwen3")}


def test_off_by_default_and_passed_to_the_engines(models):
    from scaletrain.trainer.config.worker_configs import model_config

    cfg = checked()
    assert (cfg.actor_rollout_ref.model.router_aux_loss_coef, cfg.actor_rollout_ref.model.router_z_loss_coef) == (0, 0)
    cfg = checked(
        f"actor_rollout_ref.model.path={models['qwen3_moe']}",
        "actor_rollout_ref.model.router_aux_loss_coef=0.01",
        "actor_rollout_ref.model.router_z_loss_coef=0.001",
        "data.max_prompt_length=16",  # the tiny model's 64 positions
        "data.max_response_length=16",
    )
    engine_model = model_config(cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.model.path)
    assert (engine_model.router_aux_loss_coef, engine_model.router_z_loss_coef) == (0.01, 0.001)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.model.router_aux_loss_coef=-0.1"], "router_aux_loss_coef must be a number >= 0, got -0.1"),
        (["actor_rollout_ref.model.router_z_loss_coef=true"], "router_z_loss_coef: expected float, got a boolean True"),
        (
            ["actor_rollout_ref.model.router_aux_loss_coef=0.01", "backend=megatron"],
            "router_aux_loss_coef=0.01: router losses are applied by the fsdp and deepspeed backends",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.model.router_z_loss_coef=0.1", "critic.model.path=DENSE"],
            "critic.model.router_z_loss_coef=0.1 but DENSE is not a mixture-of-experts model",
        ),
        (
            ["actor_rollout_ref.model.path=DENSE", "actor_rollout_ref.model.router_aux_loss_coef=0.01"],
            "router_aux_loss_coef=0.01 but DENSE is not a mixture-of-experts model: set it to 0",
        ),
    ],
)
def test_careless_values_are_refused_naming_the_key(models, overrides, message):
    overrides = [o.replace("DENSE", models["qwen3"]) for o in overrides]
    with pytest.raises(ConfigError) as info:
        checked(*overrides)
    assert message.replace("DENSE", models["qwen3"]) in str(info.value)


def test_megatron_takes_qwen3_and_refuses_a_mixture_of_experts_before_ray(models):
    lengths = ["data.max_prompt_length=16", "data.max_response_length=16"]
    checked("backend=megatron", f"actor_rollout_ref.model.path={models['qwen3']}", *lengths)
    with pytest.raises(
        ConfigError, match="maps model types \\['qwen2', 'qwen3', 'llama'\\].*not model_type 'qwen3_moe'"
    ):
        checked("backend=megatron", f"actor_rollout_ref.model.path={models['qwen3_moe']}", *lengths)
