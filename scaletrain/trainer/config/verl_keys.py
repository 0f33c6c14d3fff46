"""verl's key names and what each becomes here (layer 4): the tables verl_compat.py applies to a command line.

Every key of verl's dense-model example scripts (``examples/grpo_trainer``, ``examples/ppo_trainer``) is either a
key of this config, renamed here, accepted and dropped with its reason logged (verl's job done anyway), or refused
naming what to use (docs/porting.md lists them; tests/trainer/config/test_verl_compat.py checks each).
"""

from __future__ import annotations

import dataclasses

from scaletrain.trainer.config.role_checks import STRATEGIES

FALSE = ("false", "False")


@dataclasses.dataclass(frozen=True)
class Unsupported:
    instead: str  # what to use instead
    accepted: tuple = ()  # values that mean "off" in verl (or what scaletrain does anyway): accepted and dropped


_CONTEXT_PARALLEL = Unsupported(
    "context parallelism is not implemented: megatron-core's local attention runs only context_parallel_size=1 (its "
    "context-parallel attention is Transformer Engine's, CUDA only); use megatron.sequence_parallel=true, or "
    "ulysses_sequence_parallel_size on fsdp / deepspeed",
    ("1",),
)


_ROLE_KEYS = {  # keys verl has under both actor_rollout_ref.actor and actor_rollout_ref.ref
    "use_torch_compile": Unsupported("compiling the log-prob function is not implemented (remove the key)", FALSE),
    "fsdp_config.offload_policy": Unsupported(
        "FSDP2's CPU offload policy is not implemented: use fsdp_config.param_offload=true and "
        "fsdp_config.optimizer_offload=true",
        FALSE,
    ),
    "fsdp_config.reshard_after_forward": Unsupported(
        "parameters are always resharded after the forward (FSDP2's default; remove the key)", ("true", "True")
    ),
    "fsdp_config.fsdp_size": Unsupported(
        "hybrid sharding (groups smaller than all ranks) is not implemented: remove the key to shard over all ranks",
        ("-1",),
    ),
    "fsdp_config.entropy_checkpointing": Unsupported(
        "entropy checkpointing is not implemented; entropy is computed chunk by chunk (remove the key)", FALSE
    ),
    "megatron.context_parallel_size": _CONTEXT_PARALLEL,
    "megatron.use_megatron_fsdp": Unsupported(
        "Megatron-FSDP is not implemented: use megatron.use_distributed_optimizer=true, or backend=fsdp", FALSE
    ),
    "megatron.override_transformer_config.gradient_accumulation_fusion": Unsupported(
        "the gradient-accumulation fusion kernel is never used (remove the key)", FALSE
    ),
    "megatron.override_transformer_config": Unsupported(
        "megatron's TransformerConfig is built from the HF checkpoint (backends/megatron/model.py); the layout keys "
        "are megatron.{tensor,pipeline}_model_parallel_size, sequence_parallel, use_distributed_optimizer"
    ),
}

UNSUPPORTED = {
    **{f"actor_rollout_ref.{role}.{key}": rule for role in ("actor", "ref") for key, rule in _ROLE_KEYS.items()},
    "trainer.use_legacy_worker_impl": Unsupported("remove it: scaletrain has one worker implementation", ("auto",)),
    "critic.megatron.context_parallel_size": _CONTEXT_PARALLEL,
    "actor_rollout_ref.model.use_fused_kernels": Unsupported(
        "fused log-prob kernels are not implemented; log-probs are computed in chunks (remove the key)", FALSE
    ),
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": Unsupported(
        "fused log-prob kernels are not implemented (remove the key)"
    ),
    "actor_rollout_ref.rollout.ignore_eos": Unsupported("generation always stops at EOS (remove the key)", FALSE),
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": Unsupported(
        "tools are BaseTool classes listed in actor_rollout_ref.rollout.multi_turn.tools_config_file"
    ),
    "algorithm.use_pf_ppo": Unsupported("policy-filtration PPO is not implemented (remove the key)", FALSE),
    "algorithm.pf_ppo": Unsupported("policy-filtration PPO is not implemented (remove the key)"),
    # verl's newer top-level reward section
    "reward.reward_manager.source": Unsupported(
        "reward managers are registered by name (@register_reward_manager); set reward_model.reward_manager",
        ("register",),
    ),
    "reward.reward_manager.module": Unsupported(
        "register the manager class with @register_reward_manager(name) in an imported module and set "
        "reward_model.reward_manager=name"
    ),
}


# verl keys accepted and dropped: what they do in verl, scaletrain does anyway (or needs not); a key or a prefix
IGNORED = {
    "actor_rollout_ref.model.use_shm": "the model is read from its path directly (verl copies it to /dev/shm first)",
    "actor_rollout_ref.rollout.layered_summon": "the LoRA weight sync gathers and merges one tensor at a time anyway",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "entropy is computed chunk by chunk anyway",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": "entropy is computed chunk by chunk anyway",
    **{
        f"actor_rollout_ref.{role}.megatron.{key}": "the HF <-> megatron weight mapping is built in "
        "(backends/megatron/hf_mapping.py)"
        for role in ("actor", "ref")
        for key in ("use_mbridge", "vanilla_mbridge")
    },
    "reward_model.use_reward_loop": "rewards are scored by this project's reward loop either way (reward.num_workers "
    "sets its workers, reward_model.rollout.name a generative judge's engine)",
    **{
        f"reward.reward_model.rollout.{key}": "a judge request carries its own sampling (the chat parameters its "
        "reward function sends)"
        for key in ("temperature", "top_p", "top_k", "do_sample", "n")
    },
}


# verl's name -> this project's (same meaning); verl's lr_warmup_steps=-1 ("use the ratio") is our 0
RENAMED = {
    # verl's newer place for the Ulysses size (its FSDP engine config) -> the role's key
    **{
        f"actor_rollout_ref.{role}.fsdp_config.ulysses_sequence_parallel_size": (
            f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size"
        )
        for role in ("actor", "ref")
    },
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor_rollout_ref.actor.optim.warmup_steps",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.grad_clip",
    "critic.grad_clip": "critic.optim.grad_clip",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "actor_rollout_ref.rollout.multi_turn.tools_config_file",
    # verl's megatron MoE scripts set megatron's router-loss coefficients in the TransformerConfig overrides;
    # here they are the model's keys (the HF engines apply them too)
    **{
        f"{role}.megatron.override_transformer_config.moe_{verl}": f"{model}.router_{ours}"
        for role, model in (("actor_rollout_ref.actor", "actor_rollout_ref.model"), ("critic", "critic.model"))
        for verl, ours in (("aux_loss_coeff", "aux_loss_coef"), ("z_loss_coeff", "z_loss_coef"))
    },
    "reward_model.num_workers": "reward.num_workers",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
}

# renamed with a change of unit: verl's name -> (this project's, factor)
RESCALED = {
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": (
        "actor_rollout_ref.rollout.weight_bucket_bytes",
        1 << 20,
    ),
}


# verl's older top-level ``ray_init`` section (and this project's former name) -> verl's current ``ray_kwargs``;
# verl's newer ``reward`` and engine-style ``critic.fsdp`` sections -> this project's
RENAMED_PREFIXES = {
    "ray_init.timeline_json_file": "ray_kwargs.timeline_json_file",
    "ray_init.": "ray_kwargs.ray_init.",
    "reward.custom_reward_function.": "custom_reward_function.",
    "sandbox_fusion.": "reward.sandbox_fusion.",  # verl's legacy top-level section
    "reward_model.sandbox_fusion.": "reward.sandbox_fusion.",  # verl's older place for it
    "reward.reward_model.rollout.": "reward_model.rollout.",  # a generative judge's engine
    "critic.fsdp.": "critic.model.fsdp_config.",
}

# keys that pick the training backend (verl: a role's strategy, the model_engine config group) -> {value: backend};
# the ones this config has no field for are dropped once read
BACKEND_SELECTORS = {
    "actor_rollout_ref.actor.strategy": STRATEGIES,
    "critic.strategy": STRATEGIES,
    "actor_rollout_ref.ref.strategy": STRATEGIES,
    "model_engine": {"dp": "fsdp", "fsdp": "fsdp", "megatron": "megatron"},
}
# verl's Hydra config names: --config-name=<name> -> the backend it selects (None: the default config)
VERL_CONFIG_NAMES = {"ppo_trainer": None, "ppo_megatron_trainer": "megatron"}
VERL_CONFIG_PATH = "config"  # verl's own config folder (verl/trainer/config), the one --config-path names
