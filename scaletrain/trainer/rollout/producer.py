"""Rollout production (layer 4): prompts in, scored batches out, for the step schedules and for validation.

``RolloutProducer`` owns what turns a batch of prompts into a batch to train on:

- **sampling**, chosen once per generate call as one typed ``SamplingConfig`` (training: the rollout section's;
  validation: with ``val_kwargs`` over it; ReMax's greedy pass: n = 1, temperature 0), which the worker group's
  batched generate and the agent loops both take as it is;
- **generation**: the rollout role (the actor's own engines, or split placement's pool) or the agent loops;
- **reward**: the rule reward (with the reward model's score when there is one) and the guard that stops a run
  whose scorer keeps failing; ReMax's greedy baseline (remax.py); DAPO's dynamic sampling (dynamic_sampling.py).

It knows nothing of the trainer: the schedules (schedules.py, fully_async.py) call it from their rollout thread,
validation from the trainer's; the reward functions and the agent loops' batcher take one caller at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from backends.rollout.base import SamplingConfig
from backends.vision import vision_keys
from scaletrain.algos.advantage import estimator_traits
from scaletrain.protocol import DataProto, object_column
from scaletrain.trainer.rollout.dynamic_sampling import Scored, collect_groups
from scaletrain.trainer.rollout.remax import greedy_baseline
from scaletrain.trainer.rollout.reward_guard import RewardGuard
from scaletrain.trainer.rollout.weight_sync import WeightSync
from scaletrain.trainer.step.metrics import timer
from scaletrain.utils.seeding import derive_seed

if TYPE_CHECKING:
    from scaletrain.trainer.config.ppo_config import PPOConfig
    from scaletrain.workers.roles import ActorRolloutRefRole, RolloutRole

GEN_KEYS = ["input_ids", "attention_mask", "position_ids"]  # what the engines read of a prompt batch


def pop_gen_batch(batch: DataProto) -> DataProto:
    """What the rollout engine reads of ``batch``'s prompts, taken out of it (the engine's output brings each
    field back, repeated per response)."""
    # and a vision-language model's images, when the data has them
    return batch.pop(batch_keys=GEN_KEYS, non_tensor_batch_keys=vision_keys(batch.non_tensor_batch))


def build_agent_manager(cfg: PPOConfig, rollout: ActorRolloutRefRole | RolloutRole, tokenizer, processor=None):
    """The agent loops (``multi_turn.enable`` / ``rollout.mode=async``) over ``rollout``'s engines: each request
    at once to a rollout worker's async engine, or through the driver-side batcher; ``processor``: a
    vision-language model's (the loops render images), else None."""
    from scaletrain.agent.manager import AgentLoopManager
    from scaletrain.agent.server import AsyncEngineBackend, AsyncServerManager, WorkerGroupBackend

    rc, at = cfg.actor_rollout_ref.rollout, cfg.async_training
    prompt_length, response_length = rc.resolved_lengths()
    segment = (at.partial_rollout_segment_tokens or max(1, response_length // 4)) if at.partial_rollout else None
    backend = (AsyncEngineBackend if rc.use_async_engine else WorkerGroupBackend)(rollout)
    server = AsyncServerManager(backend, rc.multi_turn.max_batch_wait_ms, segment)
    return AgentLoopManager(
        rc.multi_turn,
        server,
        tokenizer,
        prompt_length=prompt_length,
        response_length=response_length,
        processor=processor,
    )


class RolloutProducer:
    def __init__(
        self,
        cfg: PPOConfig,
        rollout: ActorRolloutRefRole | RolloutRole,
        weight_sync: WeightSync,
        reward_fn,
        train_reward_fn,
        reward_guard: RewardGuard,
        agent_manager=None,
        open_reward_stream: Callable[[DataProto, int], Callable[[int, DataProto], None] | None] | None = None,
    ) -> None:
        """``reward_fn``: the rule reward (validation's); ``train_reward_fn``: the rollouts' (with the reward
        model's score when there is one); ``agent_manager``: build_agent_manager's, or None (batched generate);
        ``open_reward_stream``: the reward loop's (reward_loop.py: the agent loops' trajectories scored as each
        finishes), or None."""
        self.cfg, self.sampling_cfg = cfg, cfg.actor_rollout_ref.rollout
        self.rollout, self.weight_sync, self.agent_manager = rollout, weight_sync, agent_manager
        self.reward_fn, self.train_reward_fn, self.reward_guard = reward_fn, train_reward_fn, reward_guard
        self.open_reward_stream = open_reward_stream if agent_manager is not None else None
        self.reward_lock = threading.Lock()  # the rollout thread and validation both score
        self.agent_lock = threading.Lock()  # one batcher (AsyncServerManager) serves one event loop at a time

    def generate(
        self,
        batch: DataProto,
        gen_batch: DataProto,
        sampling: SamplingConfig,
        tag: str,
        on_trajectory: Callable[[int, DataProto], None] | None = None,
    ) -> tuple[DataProto, dict[str, float]]:
        """``sampling.n`` responses per prompt of ``gen_batch`` (the ids; ``batch``: the prompts' other fields, which
        the agent loops read): one batched generate, or the agent loops (``on_trajectory``: called with each
        finished one); returns (rows, rollout metrics)."""
        if self.agent_manager is None:
            return self.rollout.generate(gen_batch, sampling), {}
        # the rows' fields and their images (pop_gen_batch took those into gen_batch)
        rows = DataProto.from_dict(non_tensors={**batch.non_tensor_batch, **gen_batch.non_tensor_batch})
        params = {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "seed")}  # n: per call
        with self.agent_lock:  # one event loop at a time drives the batcher (the rollout thread, validation)
            out = self.agent_manager.generate_sequences(
                rows, params, n=sampling.n, tag=tag, on_trajectory=on_trajectory
            )
        return out, out.meta_info.pop("metrics", {})

    def scored(self, batch: DataProto, step: int, gen_index: int, timings: dict[str, float]) -> Scored:
        """The samples of ``batch``'s prompts (plus ReMax's greedy baseline), scored, for training step ``step``.
        ``gen_index`` > 0: a later generation batch of the same step (dynamic sampling), with its own uids and
        seed."""
        cfg = self.cfg
        suffix = f"-{gen_index}" if gen_index else ""
        batch.non_tensor_batch["uid"] = np.array([f"{step}{suffix}-{i}" for i in range(len(batch))], dtype=object)
        gen_batch = pop_gen_batch(batch)
        sampling = self.sampling_cfg.train_sampling(seed=derive_seed(cfg.trainer.seed, step, gen_index))
        stream = self.open_reward_stream(batch, sampling.n) if self.open_reward_stream is not None else None
        with timer("gen", timings):
            gen_out, metrics = self.generate(batch, gen_batch, sampling, f"step{step}{suffix}", stream)
        version = gen_out.meta_info.pop("weight_version", self.weight_sync.version)
        baseline = None
        if estimator_traits(cfg.algorithm.adv_estimator).greedy_baseline:
            with timer("gen_max", timings):
                baseline, baseline_metrics = greedy_baseline(
                    self.generate, self.train_reward_fn, batch, gen_batch, sampling, tag=f"step{step}{suffix}"
                )
                metrics.update(baseline_metrics)
        batch = batch.repeat(sampling.n, interleave=True).union(gen_out)
        if "rollout_version" not in batch.non_tensor_batch:  # the agent loops report it per trajectory
            batch.non_tensor_batch["rollout_version"] = np.full(len(batch), version, dtype=np.int64)
        # the log-prob passes scale the logits by it; greedy rollouts (0) by 1: the raw logits, as the engines' own
        # rollout log-probs of a greedy token (dividing by 0 made every log-prob NaN)
        batch.meta_info["temperature"] = sampling.temperature or 1.0
        if baseline is not None:
            batch.tensors["reward_baselines"] = baseline.repeat_interleave(sampling.n)
        with timer("reward", timings), self.reward_lock:
            reward = self.train_reward_fn(batch, return_dict=True)
            batch.tensors["token_level_scores"] = reward["reward_tensor"]
        self.reward_guard.observe(step, reward["metrics"], len(batch))  # a scorer failing step after step stops
        return Scored(batch, reward, {**metrics, **reward["metrics"]})

    def collect(self, batch: DataProto, step: int, timings: dict[str, float], draw: Callable[[], DataProto]) -> Scored:
        """``batch`` generated and scored for ``step``; with DAPO's dynamic sampling (``algorithm.filter_groups``),
        further batches from ``draw()`` (the loader: resumable) until enough groups vary."""
        cfg = self.cfg
        if not cfg.algorithm.filter_groups.enable:
            scored = self.scored(batch, step, 0, timings)
        else:
            scored, sampling_metrics = collect_groups(
                batch,
                lambda more, i: self.scored(more, step, i, timings),
                draw,
                cfg.algorithm.filter_groups,
                cfg.data.train_batch_size,
            )
            scored.metrics.update(sampling_metrics)
        add_reward_columns(scored.batch, scored.reward.get("reward_extra_info") or {})  # once the batch is whole
        return scored

    def validation_batch(self, batch: DataProto, tag: str) -> tuple[DataProto, dict]:
        """``batch``'s held-out prompts generated with the validation sampling (seed 0) and scored with the rule
        reward: (the prompts repeated per response with the responses, the reward's dict)."""
        gen_batch = pop_gen_batch(batch)
        out, _ = self.generate(batch, gen_batch, self.sampling_cfg.validation_sampling(seed=0), tag=tag)
        batch = batch.repeat(len(out) // len(batch), interleave=True).union(out)
        with self.reward_lock:  # the rollout thread may be scoring too
            scores = self.reward_fn(batch, return_dict=True)
        return batch, scores


def add_reward_columns(batch: DataProto, extra_info: dict[str, list]) -> None:
    """The reward's per-row extra info (the keys of the dicts compute_score returned) as non-tensor columns of
    ``batch``, as verl's trainer adds them (GDPO reads its reward components there). A key the batch already has
    (``uid``, ``data_source``, ...) keeps the batch's column."""
    for key, values in extra_info.items():
        if key not in batch.non_tensor_batch and len(values) == len(batch):
            batch.non_tensor_batch[key] = object_column(values)
