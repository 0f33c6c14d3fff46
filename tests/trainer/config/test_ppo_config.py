"""The PPO config: YAML composition, strict typed building and cross-key validation, all before Ray."""

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from scaletrain.trainer.config.checks import check_config
from scaletrain.trainer.config.plan import resolve_config
from scaletrain.trainer.config.ppo_config import load_ppo_config
from scaletrain.utils.typed_config import ConfigError


def composed(*overrides):
    with initialize_config_module(config_module="scaletrain.configs", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=list(overrides))
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return data


def checked(*overrides):
    """The composed config as the trainer sees it: built, resolved and checked (raises ConfigError)."""
    return check_config(resolve_config(load_ppo_config(composed(*overrides))))


def test_yaml_defaults_build_and_validate():
    cfg = checked()
    assert cfg.backend.name == "fsdp" and cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length
    hf = checked("rollout=hf", "actor_rollout_ref.rollout.n=4")
    assert hf.actor_rollout_ref.rollout.name == "hf" and hf.actor_rollout_ref.rollout.n == 4
    assert load_ppo_config(composed("actor_rollout_ref.actor.optim.lr=3e-5")).actor_rollout_ref.actor.optim.lr == 3e-5


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.train_batch_size=12"], "ppo_mini_batch_size (256) must divide data.train_batch_size (12)"),
        (["algorithm.adv_estimator=nope"], "algorithm.adv_estimator: unknown advantage estimator 'nope'"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=nope"], "policy_loss.loss_mode: unknown policy loss 'nope'"),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name: unknown rollout engine 'sglang'"),
        (["reward_model.reward_manager=nope"], "reward_model.reward_manager: unknown reward manager 'nope'"),
        (["trainer.logger=[console,nope]"], "trainer.logger: unknown logger 'nope'"),
        (["backend.name=nope"], "backend.name: unknown backend 'nope'"),
        (["actor_rollout_ref.rollout.n=1"], "set actor_rollout_ref.rollout.n >= 2"),
        (["algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
        (
            ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]", "algorithm.gdpo_reward_weights=[1,2]"],
            "algorithm.gdpo_reward_weights has 2 weights for 1 gdpo_reward_keys",
        ),
        (
            ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.bypass_mode=true"],
            "optimal_token_baseline reads the actor's sum of squared probabilities",
        ),
        (["data.train_files=/no/such.parquet"], "data.train_files: file not found: /no/such.parquet"),
        (["actor_rollout_ref.model.path=/no/model"], "actor_rollout_ref.model.path: not found: /no/model"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_mode=resume_path needs trainer.resume_from_path"),
        (["actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"], "enable one"),
        (["actor_rollout_ref.actor.ppo_epochs=two"], "actor_rollout_ref.actor.ppo_epochs: expected int, got str"),
        (["+data.nope=1"], "unknown config key 'data.nope'"),
        (["trainer.critic_warmup=2"], "trainer.critic_warmup=2 warms up a critic, but this run has none"),
        (["trainer.critic_warmup=-1", "algorithm.adv_estimator=gae"], "trainer.critic_warmup must be >= 0"),
        (["trainer.save_freq_minutes=0"], "trainer.save_freq_minutes must be > 0 (or null"),
        (
            ["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"],
            "actor_rollout_ref.actor.checkpoint.save_contents leaves out ['optimizer', 'extra']",
        ),
        (["critic.checkpoint.load_contents=[model,optimizer,extra,lora]"], "critic.checkpoint.load_contents: unknown"),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size (3) must divide the 2 ranks",
        ),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout=hf"],
            "only the vllm rollout engine shards over ranks (actor_rollout_ref.rollout.name=hf)",
        ),
        (
            ["actor_rollout_ref.actor.strategy=megatron"],
            "actor_rollout_ref.actor.strategy=megatron selects backend megatron, but backend.name is fsdp",
        ),
        (  # each backend reads its own offload keys: the other's set true would be dropped silently
            ["actor_rollout_ref.actor.megatron.param_offload=true"],
            "actor_rollout_ref.actor.megatron.param_offload=true applies to backend=megatron; on fsdp set "
            "actor_rollout_ref.actor.fsdp_config.param_offload",
        ),
        (
            ["backend=deepspeed", "critic.megatron.optimizer_offload=true"],
            "critic.megatron.optimizer_offload=true applies to backend=megatron; on deepspeed set "
            "critic.model.fsdp_config.optimizer_offload",
        ),
        (
            ["actor_rollout_ref.actor.megatron.grad_offload=true"],
            "actor_rollout_ref.actor.megatron.grad_offload=true applies to backend=megatron; fsdp has no gradient",
        ),
        (
            ["backend=megatron", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
            "actor_rollout_ref.actor.fsdp_config.param_offload=true: fsdp_config applies to backend=fsdp|deepspeed; "
            "on megatron set actor_rollout_ref.actor.megatron.param_offload",
        ),
        (
            ["backend=megatron", "reward_model.model.fsdp_config.param_offload=true"],
            "reward_model.model.fsdp_config.param_offload=true: fsdp_config applies to backend=fsdp|deepspeed; "
            "on megatron set backend.param_offload",
        ),
        (
            ["backend=megatron", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"],
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 differs from the actor's (1)",
        ),
        (["data.return_raw_chat=false", "actor_rollout_ref.rollout.mode=async"], "data.return_raw_chat=false"),
        (["critic.optim.lr_scheduler=linear"], "critic.optim.lr_scheduler: unknown 'linear'"),
        (["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=2"], "lr_warmup_steps_ratio must be in [0, 1]"),
        (
            ["+reward_model.reward_kwargs.overlong_buffer=4"],
            "reward_model.reward_kwargs: ['overlong_buffer'] are not arguments of reward manager 'naive'",
        ),
        (["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization must be in (0, 1]"),
        (
            ["actor_rollout_ref.rollout.enable_sleep_mode=false"],
            "rollout.free_cache_engine=true releases memory through sleep mode",
        ),
        (["actor_rollout_ref.rollout.load_format=gguf"], "rollout.load_format must be one of auto, safetensors, pt"),
        (
            ["actor_rollout_ref.rollout.enable_chunked_prefill=true", "trainer.device=cpu"],
            "rollout.enable_chunked_prefill=true is not supported on CPU",
        ),
        (["+actor_rollout_ref.rollout.engine_kwargs.sglang={}"], "rollout.engine_kwargs: unknown engine(s) ['sglang']"),
        (
            ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=remax"],
            "algorithm.filter_groups.enable drops groups whose samples all agree: set actor_rollout_ref.rollout.n >= 2",
        ),
        (
            [
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=seq_final_reward",
                "algorithm.use_kl_in_reward=true",
            ],
            "algorithm.filter_groups.metric=seq_final_reward: groups are filtered",
        ),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=''"],
            "algorithm.filter_groups.metric must name a per-sample value",
        ),
        (
            ["algorithm.filter_groups.max_num_gen_batches=two"],
            "algorithm.filter_groups.max_num_gen_batches: expected int, got str",
        ),
        (["algorithm.filter_overlong_responses=maybe"], "algorithm.filter_overlong_responses: expected bool"),
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 splits the packed sequence: set "
            "actor_rollout_ref.model.use_remove_padding=true",
        ),
        (
            ["backend=megatron", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
            "the megatron backend does not split sequences (Ulysses runs on fsdp, deepspeed); megatron's is "
            "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        ),
        (
            [
                "actor_rollout_ref.model.use_remove_padding=true",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3",
            ],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=3 must divide the 2 ranks",
        ),
        (
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
            ],
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 differs from the actor's (2)",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2"],
            "critic.ulysses_sequence_parallel_size=2 splits the packed sequence: set "
            "critic.model.use_remove_padding=true",
        ),
        (["critic.ulysses_sequence_parallel_size=0", "algorithm.adv_estimator=gae"], "must be an integer >= 1, got 0"),
        # the weight transport: a named backend needs its hop in this run
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"], "checkpoint_engine.backend must be one of"),
        (
            ["actor_rollout_ref.rollout.checkpoint_engine.backend=cuda_ipc", "trainer.device=cpu"],
            "checkpoint_engine.backend=cuda_ipc needs CUDA devices",
        ),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"], "which this run does not have"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=shm"], "feeds an engine running in another process"),
        (
            ["+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.shm.path=/x"],
            "checkpoint_engine.engine_kwargs.shm: unknown ['path']",
        ),
        (
            ["+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nccl.same_node=nvlink"],
            "checkpoint_engine.engine_kwargs.nccl.same_node must be one of shm, broadcast, got 'nvlink'",
        ),
    ],
)
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        checked(*overrides)
    assert message in str(info.value)


def test_a_weight_transport_with_its_hop_in_the_run_is_taken():
    async_run = checked(
        "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.checkpoint_engine.backend=shm"
    )
    assert async_run.actor_rollout_ref.rollout.checkpoint_engine.engine_process_transport() == "shm"
    split = checked("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")
    assert split.actor_rollout_ref.rollout.checkpoint_engine.pool_transport("cuda") == "nccl"
    auto = checked().actor_rollout_ref.rollout.checkpoint_engine
    assert (auto.pool_transport("cpu"), auto.pool_transport("cuda"), auto.engine_process_transport()) == (
        "nccl",
        "naive",
        "shm",
    )


def test_megatron_layout_keys_reach_the_engine_config():

    from backends.config import EngineConfig, ModelConfig
    from scaletrain.workers.config import ActorRolloutRefConfig, CriticConfig, EngineSetup

    cfg = checked(
        "backend=megatron",
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.sequence_parallel=true",
        "critic.megatron.tensor_model_parallel_size=2",
    )
    arr, base = cfg.actor_rollout_ref, EngineConfig(extra=cfg.backend.extra)
    megatron = EngineSetup(ModelConfig(path="m"), "megatron", base)
    actor = ActorRolloutRefConfig(actor=arr.actor).engine_config(megatron)
    assert actor.extra["megatron"] == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "sequence_parallel": False,
        "use_distributed_optimizer": False,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
    }
    critic = CriticConfig(megatron=cfg.critic.megatron).engine_config(megatron)
    assert critic.extra["megatron"]["sequence_parallel"] is True
    assert critic.extra["megatron"]["pipeline_model_parallel_size"] == 2  # resolved from the actor's
    assert base.extra["megatron"]["sequence_parallel"] is False  # the shared engine config is not mutated
    fsdp = ActorRolloutRefConfig(actor=arr.actor).engine_config(EngineSetup(ModelConfig(path="m"), "fsdp", base))
    assert fsdp.extra == base.extra
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.megatron: world size 2 is not divisible"):
        checked("backend=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4")
    with pytest.raises(ConfigError, match="critic.megatron"):
        checked(
            "backend=megatron",
            "algorithm.adv_estimator=gae",
            "critic.megatron.pipeline_model_parallel_size=3",
        )
    # colocated roles share megatron's per-process parallel state: one layout, resolved into backend.extra
    with pytest.raises(ConfigError, match="need the same layout"):
        checked(
            "backend=megatron",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=1",
        )
    gae = checked(  # the critic's unset keys follow the actor's layout
        "backend=megatron",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    )
    assert gae.backend.extra["megatron"]["tensor_model_parallel_size"] == 2


def test_each_roles_offload_keys_reach_its_engine_config():
    """The engine each role builds gets its own offload keys: on megatron its megatron section's (null: the backend
    section's), on fsdp its fsdp_config's; the reward model on megatron the backend section's."""
    from scaletrain.trainer.config.plan import plan_run
    from scaletrain.trainer.config.worker_configs import ppo_worker_configs

    def engines(*overrides):
        cfg = checked("algorithm.adv_estimator=gae", *overrides)
        (arr, setup), critic, _ = ppo_worker_configs(cfg, plan_run(cfg, 64, None))
        assert critic is not None
        return arr.actor_engine_config(setup), arr.ref_engine_config(setup), critic[1].engine

    def offload(engine):
        return engine.param_offload, engine.optimizer_offload, engine.grad_offload

    actor, ref, critic = engines(
        "backend=megatron",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true",
        "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.ref.megatron.param_offload=true",
        "critic.megatron.param_offload=false",
        "backend.param_offload=true",
    )
    assert (offload(actor), offload(ref), offload(critic)) == ((True, True, True), (True, False, False), (False,) * 3)
    actor, ref, critic = engines("actor_rollout_ref.actor.fsdp_config.param_offload=true")
    assert (offload(actor), offload(ref), offload(critic)) == ((True, False, False), (False,) * 3, (False,) * 3)


def test_model_path_must_be_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "model_type": "bert"}')
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.path: .* is not a causal language model"):
        checked(f"actor_rollout_ref.model.path={tmp_path}")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.path: .* \(no config.json\)"):
        checked(f"actor_rollout_ref.model.path={tmp_path.parent}")


def test_megatron_refuses_a_model_it_cannot_map_before_ray(tmp_path):
    from tests.backends.tiny import save_tiny_qwen2

    path = save_tiny_qwen2(str(tmp_path / "model"), with_tokenizer=False, hidden_act="gelu")
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref.actor.megatron: .*cannot map this qwen2 model: "
        r"hidden_act 'gelu'",
    ):
        checked("backend=megatron", f"actor_rollout_ref.model.path={path}")


def test_rollout_checks_against_the_model_before_ray(tmp_path):
    from tests.backends.tiny import save_tiny_qwen2

    path = save_tiny_qwen2(str(tmp_path / "model"), with_tokenizer=False, max_position_embeddings=64)
    base = [f"actor_rollout_ref.model.path={path}"]
    with pytest.raises(ConfigError, match=r"prompt_length \+ response_length = 1536 .* max_position_embeddings \(64\)"):
        checked(*base, "data.max_prompt_length=512", "data.max_response_length=1024")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 does not split the model's 3 attention heads"):
        save_tiny_qwen2(
            str(tmp_path / "odd"), with_tokenizer=False, num_attention_heads=3, num_key_value_heads=1, hidden_size=96
        )
        checked(
            f"actor_rollout_ref.model.path={tmp_path / 'odd'}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "data.max_prompt_length=8",
            "data.max_response_length=8",
        )


def test_the_estimator_registry_owns_what_the_trainer_needs_to_know():
    """A user's estimator registered with its traits gets a critic (values) and the n >= 2 check (groups) like the
    built-in gae and grpo, with no list in the trainer to extend."""
    from scaletrain.algos import register_adv_est
    from scaletrain.algos.advantage import estimator_traits

    @register_adv_est("test_only_value_estimator", override=True, needs_values=True)
    def value_estimator(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    @register_adv_est("test_only_group_estimator", override=True, group_based=True)
    def group_estimator(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    assert estimator_traits("gae").needs_values and estimator_traits("grpo").group_based
    assert estimator_traits("remax").greedy_baseline and not estimator_traits("grpo").needs_values
    assert checked("algorithm.adv_estimator=test_only_value_estimator").use_critic
    assert not checked("algorithm.adv_estimator=grpo").use_critic
    with pytest.raises(ConfigError, match="test_only_group_estimator compares samples of one prompt"):
        checked("algorithm.adv_estimator=test_only_group_estimator", "actor_rollout_ref.rollout.n=1")


def two_ranks_only(extra, world_size, hf_config):
    """A backend's own engine check, for the test below."""
    if world_size != 2:
        raise ValueError(f"this backend runs on 2 ranks, not {world_size}")
    return ("layout", 2)


def test_a_backends_own_check_runs_through_its_registry_entry():
    """The config check calls the check a backend's registry entry names (megatron's layout check is one), and
    prefixes its error with the role's keys: no backend's name is written in the trainer."""
    from backends.base import BackendTraits, TrainEngine, register_backend

    check = "tests.trainer.config.test_ppo_config:two_ranks_only"

    @register_backend("test_only_checked", traits=BackendTraits(check=check))
    class CheckedEngine(TrainEngine):  # never built: the check needs only its registration
        pass

    checked("backend.name=test_only_checked")
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.megatron: this backend runs on 2 ranks, not 4"):
        checked("backend.name=test_only_checked", "trainer.n_gpus_per_node=4")


def test_ulysses_sizes_reach_the_engine_configs():
    """Each role's Ulysses size reaches its engine (the ref's is the actor's); the mini-batch rows split over the data-
    parallel ranks, world / SP."""
    from backends.config import EngineConfig, ModelConfig
    from scaletrain.workers.config import ActorRolloutRefConfig, CriticConfig, EngineSetup

    cfg = checked(
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",  # 2 rows per mini-batch: over 2 DP ranks, not over the 4 ranks
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "algorithm.adv_estimator=gae",
        "critic.model.use_remove_padding=true",
        "critic.ulysses_sequence_parallel_size=4",
    )
    setup = EngineSetup(ModelConfig(path="m"), "fsdp", EngineConfig())
    arr = cfg.actor_rollout_ref
    assert ActorRolloutRefConfig(actor=arr.actor).engine_config(setup).ulysses_sequence_parallel_size == 2
    assert CriticConfig(ulysses_sequence_parallel_size=4).engine_config(setup).ulysses_sequence_parallel_size == 4
    with pytest.raises(ConfigError, match="rows do not split over 4 data-parallel ranks"):
        checked(
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
        )


def test_remove_padding_on_megatron_is_said_not_silently_dropped(caplog):
    """megatron runs padded micro-batches: use_remove_padding=true (verl's megatron scripts set it) is accepted and
    said once at the start, naming the key; fsdp packs, nothing is said."""
    import logging

    caplog.set_level(logging.WARNING, logger="scaletrain")
    checked(
        "backend=megatron", "critic.model.use_remove_padding=true", "actor_rollout_ref.model.use_remove_padding=true"
    )
    said = [r.getMessage() for r in caplog.records if "runs padded micro-batches" in r.getMessage()]
    assert [m.split("=")[0] for m in said] == [
        "actor_rollout_ref.model.use_remove_padding",
        "critic.model.use_remove_padding",
    ]
    assert all("the megatron backend" in m for m in said), said
    caplog.clear()
    checked("backend=fsdp", "actor_rollout_ref.model.use_remove_padding=true")
    assert not [r for r in caplog.records if "runs padded micro-batches" in r.getMessage()]
