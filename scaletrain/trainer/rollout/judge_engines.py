"""A generative judge in the run (layer 4): where its engines go and the endpoint in front of them.

With ``reward_model.enable=true`` and ``reward_model.rollout.name`` set, ``reward_model.model.path`` is a causal LM
served as a judge by engines of the run's own: a colocated role on the actor's ranks (asleep while training), or,
with ``reward_model.enable_resource_pool``, ``n_gpus_per_node`` x ``nnodes`` ranks of their own. The driver's
judge server (judge_server.py) is started before the reward function is built, since its address is the judge's
``base_url``; it serves once the engines are attached.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from scaletrain.controller import RayClassWithInitArgs
from scaletrain.trainer.rollout.judge_server import JudgeServer
from scaletrain.trainer.rollout.split_placement import spawn_own_pool
from scaletrain.workers.generative_rm import GenerativeRewardModelWorker
from scaletrain.workers.roles import GenerativeRewardModelRole

if TYPE_CHECKING:
    from scaletrain.trainer.config.plan import RunPlan
    from scaletrain.trainer.config.ppo_config import PPOConfig


def judge_worker(cfg: PPOConfig) -> RayClassWithInitArgs:
    """The judge engines' worker, with its arguments."""
    rm = cfg.reward_model
    return RayClassWithInitArgs(GenerativeRewardModelWorker, rm, rm.model.trust_remote_code)


def start_judge_server(cfg: PPOConfig) -> JudgeServer:
    """The judge's endpoint in the driver: on 127.0.0.1, or the driver node's address when the run spans nodes
    (reward workers may score elsewhere)."""
    from transformers import AutoTokenizer

    rm = cfg.reward_model
    assert rm.model.path is not None  # checked before Ray (scaletrain/trainer/rollout/reward_checks.py)
    tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
    host = "127.0.0.1"
    if cfg.trainer.nnodes > 1 or (rm.enable_resource_pool and rm.nnodes > 1):
        import ray

        host = ray.util.get_node_ip_address()
    return JudgeServer(tokenizer, os.path.basename(os.path.normpath(rm.model.path)), rm.rollout, host)


def spawn_judge_pool(cfg: PPOConfig, plan: RunPlan, started: list) -> GenerativeRewardModelRole:
    """``reward_model.enable_resource_pool``: the judge engines on a pool of their own, built; the group goes into
    ``started`` (the trainer frees it at the end) as soon as it exists."""
    rm = cfg.reward_model
    judge = GenerativeRewardModelRole(
        spawn_own_pool(cfg, plan, (rm.n_gpus_per_node, rm.nnodes), judge_worker(cfg), "rm", started)
    )
    judge.init_model()
    return judge
