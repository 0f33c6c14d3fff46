"""Split placement's rollout pool (layer 4): rollout-only workers on their own resources.

With ``actor_rollout_ref.hybrid_engine=false`` the training roles keep the trainer's pool and the rollout engines
get ``rollout.nnodes`` x ``rollout.n_gpus_per_node`` ranks of their own: one ActorRolloutRefWorker per rank with
the role ``rollout`` (its engine only), driven through ``RolloutRole`` (scaletrain/workers/roles.py); weights
reach it by a push (weight_sync.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scaletrain.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from scaletrain.workers import ActorRolloutRefWorker
from scaletrain.workers.roles import RolloutRole

if TYPE_CHECKING:
    from scaletrain.trainer.config.plan import RunPlan
    from scaletrain.trainer.config.ppo_config import PPOConfig
    from scaletrain.workers.config import ActorRolloutRefConfig, EngineSetup


def spawn_rollout_pool(
    cfg: PPOConfig, plan: RunPlan, actor_cfg: tuple[ActorRolloutRefConfig, EngineSetup], started: list
) -> RolloutRole:
    """The rollout pool's workers, their engines built. The group goes into ``started`` (the trainer frees it at
    the end) as soon as it exists."""
    rc = cfg.actor_rollout_ref.rollout
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, *actor_cfg, "rollout")
    group = spawn_own_pool(cfg, plan, (rc.n_gpus_per_node, rc.nnodes), worker, "rollout", started)
    rollout = RolloutRole(group)
    rollout.init_model()
    return rollout


def needs_first_push(cfg: PPOConfig) -> bool:
    """Whether the rollout pool must get the actor's weights before it generates (as version 0): with
    ``rollout.load_format=dummy``, or a LoRA actor (whose adapter may start from ``lora_adapter_path``)."""
    return cfg.actor_rollout_ref.rollout.load_format == "dummy" or cfg.actor_rollout_ref.model.lora_rank > 0


def spawn_own_pool(
    cfg: PPOConfig, plan: RunPlan, layout: tuple[int, int], worker: RayClassWithInitArgs, role: str, started: list
) -> RayWorkerGroup:
    """A worker group of ``role`` on a pool of its own (``layout``: ranks per node, nodes), put in ``started`` (the
    trainer frees it at the end) as soon as it exists; the pool freed if the group cannot start."""
    tc = cfg.trainer
    per_node, nnodes = layout
    pool = RayResourcePool([per_node] * nnodes, use_gpu=tc.device == "cuda", name_prefix=role)
    try:
        group = RayWorkerGroup(
            pool,
            worker,
            name_prefix=role,
            call_timeout_s=tc.worker_call_timeout_s_by_role.get(role, tc.worker_call_timeout_s),
            stack_dump_dir=os.path.join(plan.run_dir, "stacks"),  # where a stuck call's stacks go
        )
    except BaseException:
        pool.release()
        raise
    started.append(group)
    return group
