"""The memory plan before launch (scaletrain/trainer/memory_plan.py): a config that cannot fit fails before Ray with
the numbers and the settings that would fit; warn and off; the plan's phases follow the config."""

from __future__ import annotations

import logging

import pytest

from backends import memory as mem
from scaletrain.controller.push_lanes import RING
from scaletrain.trainer.config.plan import resolve_config
from scaletrain.trainer.config.ppo_config import load_ppo_config
from scaletrain.trainer.embedded_default import apply_embedded_overlay
from scaletrain.trainer.main_ppo import explicit_keys, run
from scaletrain.trainer.memory_plan import check_memory, memory_plan
from scaletrain.utils.hydra_compose import compose_config
from scaletrain.utils.typed_config import ConfigError

GIB = float(mem.GIB)


def resolved(*overrides: str):
    """The config ``main_ppo`` would run with these overrides (the embedded default's where unset)."""
    raw, _ = apply_embedded_overlay(compose_config("ppo_trainer", list(overrides)), explicit_keys(overrides))
    return resolve_config(load_ppo_config(raw))


def test_a_config_that_cannot_fit_fails_before_ray_naming_what_would_fit(tmp_path):
    """A user's run on a device too small for it: the command fails before its run directory (or Ray) exists, with
    the phase, both numbers and the one setting that fits; the plan says gradient checkpointing fits and it does."""
    saved = memory_plan(resolved(), budget=1 << 40).peak
    recomputed = memory_plan(resolved("actor_rollout_ref.model.enable_gradient_checkpointing=true"), 1 << 40).peak
    assert recomputed < saved
    budget_gib = (saved + recomputed) / 2 / GIB
    run_dir = tmp_path / "run"
    args = [
        f"trainer.device_memory_gib={budget_gib}",
        "trainer.memory_check=error",
        f"trainer.default_local_dir={run_dir}",
    ]
    with pytest.raises(ConfigError) as err:
        run(args)
    message = str(err.value)
    assert "actor update phase needs" in message and mem.gib(saved) in message, message
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=true" in message, message
    assert "generate" in message and "KV cache" in message  # the plan itself, every phase
    assert not run_dir.exists()  # claimed only after the check, and Ray starts after that
    fixed = resolved(*args, "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    assert check_memory(fixed).fits


def test_warn_logs_and_goes_on_off_skips(caplog):
    tight = ("trainer.device_memory_gib=0.001",)
    with caplog.at_level(logging.WARNING, logger="scaletrain.trainer.memory_plan"):
        plan = check_memory(resolved(*tight))
    assert plan is not None and not plan.fits
    assert "over the" in caplog.text and "memory plan, per cpu device" in caplog.text
    assert check_memory(resolved(*tight, "trainer.memory_check=off")) is None


def test_bad_memory_keys_are_refused_naming_them():
    from scaletrain.trainer.config.checks import check_config

    with pytest.raises(ConfigError, match="trainer.memory_check must be warn | error | off"):
        check_config(resolved("trainer.memory_check=strict"))
    with pytest.raises(ConfigError, match="trainer.device_memory_gib must be > 0"):
        check_config(resolved("trainer.device_memory_gib=0"))


def test_phases_follow_the_layout_and_offload():
    base = memory_plan(resolved(), budget=1 << 40)
    assert set(base.phases) == {"generate", "log-probs", "actor update", "weight sync"}
    # a sync: the trainer's states, the engine's woken weights, the export's three buckets in flight (loading,
    # ready, being gathered: workers/colocated_rollout.py), at most the whole model
    sync = memory_plan(resolved("actor_rollout_ref.rollout.weight_bucket_bytes=65536"), 1 << 40).phases["weight sync"]
    assert sync["weight sync buckets"] == 3 * 65536 and "rollout weights" in sync and "actor optimizer" in sync
    assert base.phases["weight sync"]["weight sync buckets"] <= base.phases["generate"]["rollout weights"]
    with_critic = memory_plan(resolved("algorithm.adv_estimator=gae"), budget=1 << 40)
    assert "critic update" in with_critic.phases
    assert "critic optimizer" in with_critic.phases["actor update"]  # colocated: the critic's states stay
    offloaded = memory_plan(resolved("backend.optimizer_offload=true"), budget=1 << 40)
    assert "actor optimizer" not in offloaded.phases["actor update"]
    assert offloaded.host["actor optimizer"] == base.phases["actor update"]["actor optimizer"]
    four = memory_plan(resolved("trainer.n_gpus_per_node=4"), budget=1 << 40)
    assert four.phases["actor update"]["actor parameters"] < base.phases["actor update"]["actor parameters"]
    moved = memory_plan(resolved("actor_rollout_ref.rollout.offload_train_during_rollout=true"), budget=1 << 40)
    assert "actor parameters" not in moved.phases["generate"] and "actor parameters (generate)" in moved.host


def test_megatrons_plan_takes_the_layout_its_engine_resolves():
    """The role's megatron keys and backend.extra.megatron's fallbacks both reach the plan, as they reach the engine
    (scaletrain/workers/model_sections.py MegatronConfig.resolved)."""
    plan = {
        name: memory_plan(resolved("backend=megatron", *keys), budget=1 << 40).phases["actor update"]
        for name, keys in {
            "tp1": [],
            "role": ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
            "extra": ["backend.extra.megatron.tensor_model_parallel_size=2"],
        }.items()
    }
    assert plan["role"]["actor parameters"] == plan["extra"]["actor parameters"] < plan["tp1"]["actor parameters"]


def test_megatrons_offload_keys_move_its_lines_as_its_engine_moves_them():
    """Each role's megatron offload keys reach the plan as they reach its engine (workers/model_sections.py
    with_offload): parameters and optimizer state on the host, the gradient buffer freed between updates and back
    for the step; backend.param_offload is the default of the megatron keys left null."""
    gae = ("backend=megatron", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    base = memory_plan(resolved(*gae), budget=1 << 40)
    keys = [f"actor_rollout_ref.actor.megatron.{name}_offload=true" for name in ("param", "optimizer", "grad")]
    plan = memory_plan(resolved(*gae, *keys, "actor_rollout_ref.ref.megatron.param_offload=true"), budget=1 << 40)
    update, resident = plan.phases["actor update"], plan.phases["log-probs"]
    assert plan.host["actor parameters"] == base.phases["actor update"]["actor parameters"]
    assert plan.host["actor optimizer"] == base.phases["actor update"]["actor optimizer"]
    assert plan.host["ref parameters"] == base.phases["actor update"]["ref parameters"]
    assert "actor gradients" not in resident and "actor gradients" not in plan.host
    assert update["gradients"] == base.phases["log-probs"]["actor gradients"]  # the step's own
    assert resident["critic gradients"] == base.phases["log-probs"]["critic gradients"]  # the critic's keys: off
    fallback = memory_plan(resolved(*gae, "backend.param_offload=true"), budget=1 << 40)
    assert {"actor parameters", "ref parameters", "critic parameters"} <= set(fallback.host)


def test_megatrons_lora_adapters_are_whole_on_every_tensor_parallel_rank():
    """LoRA on megatron keeps A and B whole on each TP rank (backends/megatron/lora.py): TP=2 halves the frozen
    weights' line but not the adapters' optimizer state and gradients."""
    lora = ("backend=megatron", "actor_rollout_ref.model.lora_rank=8", "trainer.n_gpus_per_node=2")
    one = memory_plan(resolved(*lora), budget=1 << 40).phases["actor update"]
    two = memory_plan(resolved(*lora, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"), 1 << 40)
    two_tp = two.phases["actor update"]
    assert two_tp["actor parameters"] < one["actor parameters"]
    assert two_tp["actor optimizer"] == one["actor optimizer"] > 0


def test_the_weight_syncs_dev_shm_line_follows_its_transport():
    """The agent loops' engine-core process takes each sync through /dev/shm: two bucket slots per rollout rank of
    the node (shm, auto's choice), the whole model (naive); a run whose engines load in-process has no such line."""
    agents = ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.weight_bucket_bytes=65536")
    ranks = resolved(*agents).trainer.n_gpus_per_node
    slots = memory_plan(resolved(*agents), 1 << 40).shared["weight sync in /dev/shm"]
    naive_cfg = resolved(*agents, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive")
    whole = memory_plan(naive_cfg, 1 << 40).shared["weight sync in /dev/shm"]
    assert slots == 2 * 65536 * ranks and whole > 10 * slots
    assert "weight sync in /dev/shm" not in memory_plan(resolved(), 1 << 40).shared


def test_split_placements_push_counts_its_slot_ring_on_the_export_ranks_node():
    """Split placement's collective push on CPU: the rollout ranks of the export rank's node read three bucket
    slots in /dev/shm (controller/push_lanes.py); the broadcast lane and the object store keep none there."""
    split = ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.weight_bucket_bytes=65536")
    assert memory_plan(resolved(*split), 1 << 40).shared["weight push slots in /dev/shm"] == RING * 65536
    for other in ("checkpoint_engine.backend=naive", "checkpoint_engine.engine_kwargs.nccl.same_node=broadcast"):
        cfg = resolved(*split, f"{'+' if 'same_node' in other else ''}actor_rollout_ref.rollout.{other}")
        assert "weight push slots in /dev/shm" not in memory_plan(cfg, 1 << 40).shared, other
    assert "weight push slots in /dev/shm" not in memory_plan(resolved(), 1 << 40).shared


def test_a_model_the_plan_cannot_read_warns_and_the_run_goes_on_or_fails_under_error(tmp_path, caplog):
    """A checkpoint whose config transformers cannot build: the plan gives way under warn (a training run must not
    fail for its check), and under error says why."""
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with caplog.at_level(logging.WARNING, logger="scaletrain.trainer.memory_plan"):
        assert check_memory(resolved(f"actor_rollout_ref.model.path={tmp_path}")) is None
    assert "no memory plan for this config" in caplog.text
    with pytest.raises(ConfigError, match="the memory plan could not be computed"):
        check_memory(resolved(f"actor_rollout_ref.model.path={tmp_path}", "trainer.memory_check=error"))


def test_a_cluster_the_run_starts_has_an_object_store_the_weight_pushes_fit_in():
    """Split placement pushing through the object store (checkpoint_engine naive): the cluster the run starts gets
    1 GiB plus two versions of the synced weights (one read while the next is put), and the plan shows that store;
    colocated runs, the collective push (auto on CPU), a cluster joined by address or by this process's connection,
    and a user's size keep theirs."""
    from scaletrain.trainer.memory_plan import STORE_FLOOR, actor_shape, sized_object_store

    split = ("actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1")
    split += ("actor_rollout_ref.rollout.n_gpus_per_node=1", "data.train_batch_size=2")
    naive = resolved(*split, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive")
    sized = sized_object_store(naive)
    weights = actor_shape(naive).params * 4  # float32 on CPU
    assert sized.ray_kwargs.ray_init.object_store_memory == STORE_FLOOR + 2 * weights
    assert memory_plan(sized, 1 << 40).shared["Ray object store"] == STORE_FLOOR + 2 * weights
    for kept_floor in (resolved(), resolved(*split)):  # colocated; split with the collective push
        assert sized_object_store(kept_floor).ray_kwargs.ray_init.object_store_memory == STORE_FLOOR
    for override in ("ray_kwargs.ray_init.object_store_memory=123456789", "ray_kwargs.ray_init.address=auto"):
        user = resolved(*split, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", override)
        assert sized_object_store(user).ray_kwargs.ray_init == user.ray_kwargs.ray_init, override
    # a process already connected to Ray runs on that cluster (in-process runs): nothing to size, nothing ignored
    assert sized_object_store(naive, connected=True).ray_kwargs.ray_init.object_store_memory is None
    assert naive.ray_kwargs.ray_init.object_store_memory is None  # the config itself is left as it was
