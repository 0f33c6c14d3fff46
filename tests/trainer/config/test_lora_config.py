"""LoRA's trainer keys (scaletrain/trainer/config/lora_checks.py): verl's names accepted, the defaults, what reaches the
engines' ModelConfig, the weight-sync mode's fallback, and the refusals before Ray starts, naming the key."""

from __future__ import annotations

import pytest

from scaletrain.trainer.config.plan import plan_run, resolve_config
from scaletrain.trainer.config.ppo_config import load_ppo_config
from scaletrain.trainer.config.worker_configs import ppo_worker_configs
from scaletrain.trainer.main_ppo import verl_overrides
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.config.test_ppo_config import checked, composed

# the LoRA part of verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (model and data paths removed)
VERL_LORA = [
    "actor_rollout_ref.model.use_shm=True",
    "actor_rollout_ref.model.lora_rank=64",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.rollout.load_format=safetensors",
    "actor_rollout_ref.rollout.layered_summon=True",
    "actor_rollout_ref.actor.use_kl_loss=True",
]


def test_defaults_are_off():
    cfg = checked()
    model, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
    assert model.exclude_modules is None and model.lora_adapter_path is None and critic.lora_rank == 0
    assert cfg.actor_rollout_ref.rollout.lora_sync == "merged"  # no LoRA: the null fallback is the plain sync
    assert cfg.trainer.save_merged is False


def test_verl_lora_keys_reach_the_engines():
    cfg = checked(*verl_overrides(VERL_LORA + ["critic.model.lora_rank=8", "algorithm.adv_estimator=gae"]))
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (64, 32, "all-linear")
    assert cfg.actor_rollout_ref.rollout.lora_sync == "adapter"  # vllm, colocated: the adapter alone
    plan = plan_run(cfg, train_rows=2048, latest_checkpoint=None)
    (_, actor), critic, _ = ppo_worker_configs(cfg, plan)
    assert (actor.model.lora_rank, actor.model.lora_alpha, actor.model.target_modules) == (64, 32, "all-linear")
    assert critic is not None and (critic[1].model.lora_rank, critic[1].model.kind) == (8, "value")


def test_target_and_exclude_modules_take_lists():
    cfg = checked(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.model.exclude_modules=.*layers\\.0\\..*",
    )
    assert cfg.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"]
    assert cfg.actor_rollout_ref.model.exclude_modules == ".*layers\\.0\\..*"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout=hf"], "merged"),  # the hf engine takes full weights only
        (["actor_rollout_ref.hybrid_engine=false"], "adapter"),  # pushed through the object store
        (["actor_rollout_ref.rollout.load_format=dummy"], "merged"),
        (["actor_rollout_ref.rollout.lora_sync=merged"], "merged"),
        ([], "adapter"),
    ],
)
def test_lora_sync_fallback(overrides, expected):
    raw = composed("actor_rollout_ref.model.lora_rank=8", *overrides)
    assert resolve_config(load_ppo_config(raw)).actor_rollout_ref.rollout.lora_sync == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (  # megatron's LoRA adapts the policy (backends/megatron/lora.py), not a value model
            ["backend=megatron", "algorithm.adv_estimator=gae", "critic.model.lora_rank=4"],
            "critic.model.lora_rank=4: backend=megatron trains LoRA adapters on the policy only; set "
            "critic.model.lora_rank=0 or use backend=fsdp | deepspeed",
        ),
        (["actor_rollout_ref.rollout.lora_sync=both"], "actor_rollout_ref.rollout.lora_sync must be one of"),
        (["actor_rollout_ref.rollout.lora_sync=adapter"], "lora_sync=adapter: it needs actor_rollout_ref.model"),
        (
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.lora_sync=adapter", "rollout=hf"],
            "lora_sync=adapter: only the vllm rollout engine serves LoRA adapters",
        ),
        (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank must be an integer >= 0"),
        (
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"],
            "actor_rollout_ref.model.lora_alpha must be > 0",
        ),
        (
            ["actor_rollout_ref.model.lora_adapter_path=/no/adapter"],
            "actor_rollout_ref.model.lora_adapter_path needs actor_rollout_ref.model.lora_rank > 0",
        ),
        (
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_adapter_path=/no/adapter"],
            "actor_rollout_ref.model.lora_adapter_path: /no/adapter is not a PEFT adapter directory",
        ),
        (["actor_rollout_ref.model.lora_rank=eight"], "actor_rollout_ref.model.lora_rank: expected int"),
    ],
)
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked(*overrides)


def test_a_backend_states_what_it_supports_where_it_is_registered():
    """The checks read a backend's traits, not its name: a user's backend registered without LoRA or offload gets
    the refusals, naming it and the backends that do support them."""
    from backends.base import BackendTraits, TrainEngine, backend_traits, register_backend

    @register_backend("test_only_plain", traits=BackendTraits(offload=False, lora=False))
    class PlainEngine(TrainEngine):  # never built: the checks need only its registration
        pass

    assert backend_traits("megatron").lora and not backend_traits("megatron").lora_value
    assert backend_traits("fsdp").lora_value and backend_traits("deepspeed").offload
    checked("backend=megatron", "actor_rollout_ref.model.lora_rank=8")  # the policy's adapters: accepted
    with pytest.raises(ConfigError, match="lora_rank=8: LoRA is not supported by backend=test_only_plain; .*fsdp"):
        checked("backend.name=test_only_plain", "actor_rollout_ref.model.lora_rank=8")
    # the list names every backend that offloads (another test's registered backends too, in the same process)
    with pytest.raises(ConfigError, match="the test_only_plain backend does not offload \\(fsdp, deepspeed"):
        checked("backend.name=test_only_plain", "backend.param_offload=true")
