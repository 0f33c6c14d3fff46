"""The single controller (layer 4): ``RayPPOTrainer.fit()`` drives the worker groups step by step.

Per step: the schedule's next scored batch (rollout/schedules.py: generated and scored by the rollout producer,
rollout/producer.py, now or in a background thread by ``async_training.mode``) -> old log-prob -> ref log-prob ->
values -> advantages -> critic update -> actor update -> weight sync when the schedule says so (in place, or a push
to split placement's rollout pool: rollout/weight_sync.py) -> validation -> metrics -> checkpoint. The trainer
knows nothing about FSDP / DeepSpeed / Megatron: it calls the typed roles of workers/roles.py (``self.actor``,
``self.critic``), each method one call into a role's worker group.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from backends.rollout.layout import eos_token_ids
from scaletrain.algos import build_kl_controller
from scaletrain.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls
from scaletrain.data import StatefulDataLoader
from scaletrain.reward.remote_rm import RemoteRewardModel
from scaletrain.trainer.config.plan import RunPlan
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.config.worker_configs import ppo_worker_configs
from scaletrain.trainer.rollout.fully_async import FullyAsyncRollouts
from scaletrain.trainer.rollout.judge_engines import judge_worker, spawn_judge_pool, start_judge_server
from scaletrain.trainer.rollout.producer import RolloutProducer, build_agent_manager
from scaletrain.trainer.rollout.reward_guard import RewardGuard
from scaletrain.trainer.rollout.reward_loop import RewardLoop, build_rule_reward
from scaletrain.trainer.rollout.rm_reward import RemoteScores, RewardWithRM
from scaletrain.trainer.rollout.schedules import OneStepOffRollouts, SyncRollouts
from scaletrain.trainer.rollout.split_placement import needs_first_push, spawn_rollout_pool
from scaletrain.trainer.rollout.weight_sync import WeightSync
from scaletrain.trainer.run.checkpoint import CheckpointManager, tree_bytes
from scaletrain.trainer.run.generations import ScoredSamples, dump_batch, dump_jsonl, pick_samples
from scaletrain.trainer.run.preemption import PreemptionWatch
from scaletrain.trainer.run.tracking import Tracking
from scaletrain.trainer.step.advantage import apply_kl_penalty, compute_advantage
from scaletrain.trainer.step.balance import actor_dp_size, balance_batch
from scaletrain.trainer.step.metrics import (
    count_params,
    data_metrics,
    device_peak_flops,
    throughput_metrics,
    timer,
    timing_metrics,
)
from scaletrain.trainer.step.overlong import mask_overlong_responses
from scaletrain.trainer.step.reward_health import RewardHealthWatch
from scaletrain.trainer.step.rollout_correction import old_log_probs
from scaletrain.trainer.step.val_metrics import validation_metrics
from scaletrain.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from scaletrain.workers.roles import ActorRolloutRefRole, CriticRole, GenerativeRewardModelRole, RewardModelRole

logger = logging.getLogger(__name__)


class RayPPOTrainer:
    def __init__(self, cfg: PPOConfig, plan: RunPlan, tokenizer, train_dataset, val_dataset, processor=None) -> None:
        """``cfg`` resolved and ``plan`` computed by scaletrain/trainer/config/plan.py; ``processor``: a
        vision-language model's (the agent loops render images with it), None for a text model."""
        self.cfg, self.plan, self.tokenizer, self.processor = cfg, plan, tokenizer, processor
        self.loader = StatefulDataLoader(
            train_dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        self.val_dataset = val_dataset
        self.total_steps, self.use_ref = plan.total_steps, plan.use_ref
        self.kl_ctrl = build_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            kl_coef=cfg.algorithm.kl_ctrl.kl_coef,
            target_kl=cfg.algorithm.kl_ctrl.target_kl,
            horizon=cfg.algorithm.kl_ctrl.horizon,
        )
        rm = cfg.reward_model
        # a generative judge's endpoint, whose address the reward function gets as the judge's (judge_engines.py)
        self.judge_server = start_judge_server(cfg) if plan.generative_judge else None
        judge_url = self.judge_server.url if self.judge_server else None
        self.judge: GenerativeRewardModelRole | None = None  # its engines, once started
        # the rule reward: scored on the driver, or by reward.num_workers Ray actors (rollout/reward_loop.py)
        self.reward_fn = (
            RewardLoop(cfg, tokenizer, judge_url)
            if cfg.reward.num_workers
            else build_rule_reward(cfg, tokenizer, judge_url)
        )
        self.reward_health = RewardHealthWatch(cfg.reward.health)
        self.reward_guard = RewardGuard(
            rm.max_error_rate, rm.max_error_steps, self.reward_fn.scorer_repr, lambda: self.reward_fn.last_error
        )
        self.checkpoints = CheckpointManager(plan.run_dir, cfg.trainer.max_ckpt_to_keep)
        self.last_save_time = time.monotonic()  # trainer.save_freq_minutes counts from here, then from each save
        self.save_metrics: dict[str, float] = {}  # the last save's seconds and bytes, for the next step's line
        self.global_step = 0
        self.device = cfg.trainer.device
        self.initial_val_metrics: dict[str, float] = {}  # validation before the first step
        self.preempted: dict | None = None  # set when a signal ended fit() early: {signal, step}
        self.last_metrics: dict[str, float] = {}  # the last trained step's
        self.pool: RayResourcePool | None = None
        self.worker_groups: list[RayWorkerGroup] = []  # every group init_workers started, freed by close()
        self.rollouts: SyncRollouts | FullyAsyncRollouts | None = None  # where fit()'s batches come from
        # (rollout/schedules.py)
        self.n_devices = cfg.world_size + (0 if cfg.actor_rollout_ref.hybrid_engine else plan.rollout_world_size)
        self.eos_ids = (
            eos_token_ids(tokenizer, cfg.actor_rollout_ref.model.path)  # what ends a response
            if cfg.algorithm.filter_overlong_responses
            else []
        )

    # ------------------------------------------------------------------------------------------------ workers
    def init_workers(self) -> None:
        """One process per device holding the training roles (colocated), spawned as one worker group per role;
        the rollout engines on those processes too (``hybrid_engine``), or on their own pool (split placement)."""
        cfg, tc = self.cfg, self.cfg.trainer
        split = not cfg.actor_rollout_ref.hybrid_engine
        actor_cfg, critic_cfg, rm_cfg = ppo_worker_configs(cfg, self.plan)
        role = "actor" + ("" if split else "_rollout") + ("_ref" if self.use_ref else "")
        roles = {"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, *actor_cfg, role)}
        if critic_cfg is not None:
            roles["critic"] = RayClassWithInitArgs(CriticWorker, *critic_cfg)
        if rm_cfg is not None:  # the reward model: one more colocated role on the same processes
            roles["rm"] = RayClassWithInitArgs(RewardModelWorker, *rm_cfg)
        if self.judge_server is not None and not cfg.reward_model.enable_resource_pool:
            roles["rm"] = judge_worker(cfg)  # a generative judge's engines, colocated
        self.pool = RayResourcePool([tc.n_gpus_per_node] * tc.nnodes, use_gpu=self.device == "cuda")
        self.worker_groups.append(
            colocated := RayWorkerGroup(
                self.pool,
                create_colocated_worker_cls(roles),
                name_prefix="colocated",
                call_timeout_s=tc.worker_call_timeout_s,
                stack_dump_dir=os.path.join(self.plan.run_dir, "stacks"),  # where a stuck call's stacks go
            )
        )
        groups = colocated.spawn(prefix_set=list(roles), call_timeouts=tc.worker_call_timeout_s_by_role)
        self.actor = ActorRolloutRefRole(groups["actor_rollout"])
        self.critic = CriticRole(groups["critic"]) if "critic" in groups else None
        if self.critic is not None:
            self.critic.init_model()
        self.actor.init_model()
        split_rollout = spawn_rollout_pool(cfg, self.plan, actor_cfg, self.worker_groups) if split else None
        self.rollout = split_rollout or self.actor  # what generates: the split pool, or the actor's own engines
        rc = cfg.actor_rollout_ref.rollout
        self.weight_sync = WeightSync(self.actor, split_rollout, rc.checkpoint_engine, self.device)
        if split and needs_first_push(cfg):
            self.weight_sync.send()  # version 0: the actor's weights before any update
        train_reward_fn = self._start_reward_model(groups)  # the rollouts' reward: with the RM's score if any
        rm_scores = rm_cfg is not None or cfg.reward.remote_rm.enabled
        rule_counts = not rm_scores or bool(cfg.custom_reward_function.path)
        agents = None  # the batched generate; the agent loops for multi_turn.enable / rollout.mode=async
        if cfg.actor_rollout_ref.rollout.use_agent_loop:
            agents = build_agent_manager(cfg, self.rollout, self.tokenizer, self.processor)
        # the agent loops' trajectories scored as each finishes: by the reward loop, when the rule reward counts
        stream = self.reward_fn.open_stream if isinstance(self.reward_fn, RewardLoop) and rule_counts else None
        self.producer = RolloutProducer(
            cfg, self.rollout, self.weight_sync, self.reward_fn, train_reward_fn, self.reward_guard, agents, stream
        )
        self.actor_params = count_params(actor_cfg[1].model.checkpoint)
        self.peak_flops = device_peak_flops(self.device)

    def _start_reward_model(self, groups: dict):
        """The reward model's engines started: a generative judge's behind the judge server (the rollouts' reward
        is the reward function calling it), or a sequence classifier's, whose score the rollouts' reward adds
        (returned), as it adds a remote reward model's (``reward.remote_rm``)."""
        cfg = self.cfg
        if self.judge_server is not None:
            if cfg.reward_model.enable_resource_pool:
                self.judge = spawn_judge_pool(cfg, self.plan, self.worker_groups)
            else:
                self.judge = GenerativeRewardModelRole(groups["rm"])
                self.judge.init_model()
            self.judge_server.attach(self.judge)
        rule_fn = self.reward_fn if cfg.custom_reward_function.path else None  # None: the RM's score alone
        weights = (cfg.reward.rule_weight, cfg.reward.reward_model_weight)
        if cfg.reward.remote_rm.enabled:  # a reward model served over HTTP
            return RewardWithRM(RemoteScores(RemoteRewardModel(cfg.reward.remote_rm), self.tokenizer), rule_fn, weights)
        if "rm" not in groups or self.judge is not None:
            return self.reward_fn
        reward_model = RewardModelRole(groups["rm"])
        reward_model.init_model()
        return RewardWithRM(reward_model, rule_fn, weights)

    # ---------------------------------------------------------------------------------------------------- fit
    def fit(self, tracking: Tracking, watch: PreemptionWatch | None = None) -> dict[str, float]:
        """Train for ``total_steps``; returns the last validation metrics. Each step's batch comes from the
        rollout source of ``async_training.mode`` (rollout/schedules.py). SIGTERM / SIGUSR1 end it after the
        current step with a checkpoint (``self.preempted`` then says where; preemption.py); ``watch``: the run's,
        noting signals since start-up (one that came already: no step, nothing to save), else fit()'s own."""
        if watch is None:
            with PreemptionWatch() as own:
                return self.fit(tracking, own)
        cfg = self.cfg
        if watch.requested:  # during start-up: the latest checkpoint (if any) is where a rerun starts
            self.preempted = {"signal": watch.signal_name, "step": (self.plan.resume_step or 1) - 1}
            return {}
        self._resume()
        val_metrics: dict[str, float] = {}
        if cfg.trainer.val_before_train and self.global_step == 0 and not watch.requested:
            val_metrics = self.initial_val_metrics = self.validate(tracking)
            tracking.log(val_metrics, step=0)
        if self.global_step >= self.total_steps:
            logger.info("step %d of %d reached already: nothing to train", self.global_step, self.total_steps)
            return self.validate()
        self.rollouts = self._rollout_source()
        try:
            while self.global_step < self.total_steps and not watch.requested:
                metrics = self.train_step()
                if metrics is None:  # fully_async: the rollouter generated all it was allowed to
                    break
                last = self.global_step >= self.total_steps
                if self._due(cfg.trainer.test_freq, last):
                    metrics.update(self.rollouts.before_validation(last))
                    val_metrics = self.validate(tracking)
                    metrics.update(val_metrics)
                # the step's metrics before its checkpoint: a kill between the two then loses no line (a
                # resume from the previous checkpoint drops the lines of the steps it re-runs, tracking.py); so a
                # save's own figures go into the next step's line
                metrics.update(self.save_metrics)
                self.save_metrics = {}
                tracking.log(metrics, step=self.global_step)
                if self._due(cfg.trainer.save_freq, last) or watch.requested or self._save_overdue():
                    self.save_checkpoint()
                self.last_metrics = metrics
        finally:
            self.rollouts.close()
        if watch.requested and self.global_step < self.total_steps:
            self.preempted = {"signal": watch.signal_name, "step": self.global_step}
        return val_metrics

    def _rollout_source(self):
        """The schedule of ``async_training.mode`` over the producer, the loader and the weight sync."""
        at, loader = self.cfg.async_training, self.loader
        if at.mode == "one_step_off":
            return OneStepOffRollouts(self.producer, loader, self.weight_sync, self.total_steps)
        if at.mode == "fully_async":
            left = min(self.total_steps, self.plan.rollout_batches) - self.global_step
            return FullyAsyncRollouts(self.producer, loader, self.weight_sync, at, self.global_step + 1, left)
        return SyncRollouts(self.producer, loader, self.weight_sync)

    def _started_rollouts(self) -> SyncRollouts | FullyAsyncRollouts:
        if self.rollouts is None:
            raise RuntimeError("PPOTrainer.train_step runs inside fit(), which starts the rollout source")
        return self.rollouts

    def _due(self, freq: int, last: bool) -> bool:
        return last or (freq > 0 and self.global_step % freq == 0)

    def _save_overdue(self) -> bool:
        minutes = self.cfg.trainer.save_freq_minutes
        return minutes is not None and time.monotonic() - self.last_save_time >= minutes * 60

    def train_step(self) -> dict[str, float] | None:
        """One step: the rollout source's next batch, then old / ref log-probs, values, advantages, the critic and
        actor updates, and the weights to the rollout engines (when the source says so). None: no batch left."""
        cfg, timings, rollouts = self.cfg, {}, self._started_rollouts()
        with timer("step", timings):
            scored = rollouts.next(self.global_step + 1, timings)
            if scored is None:
                return None
            self.global_step += 1
            batch, reward, metrics = scored.batch, scored.reward, dict(scored.metrics)
            metrics.update(self.reward_health.check(self.global_step, batch))  # may stop before training on it
            if self.judge is not None and not cfg.reward_model.enable_resource_pool:
                with timer("judge_sleep", timings):  # the colocated judge's engines asleep while the actor trains
                    self.judge.release()
            if cfg.trainer.rollout_data_dir:
                with timer("dump_rollouts", timings):
                    dump_batch(cfg.trainer.rollout_data_dir, self.global_step, batch, reward, self.tokenizer)
            if cfg.trainer.balance_batch:  # each DP rank gets a similar number of tokens
                metrics.update(balance_batch(batch, actor_dp_size(cfg)))
            batch = old_log_probs(self.actor, batch, cfg.algorithm.rollout_correction, metrics, timings)
            if cfg.algorithm.filter_overlong_responses:
                metrics.update(mask_overlong_responses(batch, self.eos_ids))
            if self.use_ref:
                with timer("ref", timings):
                    batch = batch.union(self.actor.compute_ref_log_prob(batch))
            if self.critic is not None:
                with timer("values", timings):
                    batch = batch.union(self.critic.compute_values(batch))

            with timer("adv", timings):
                if cfg.algorithm.use_kl_in_reward:
                    metrics.update(apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty))
                else:
                    batch.tensors["token_level_rewards"] = batch.tensors["token_level_scores"]
                compute_advantage(batch, cfg.algorithm)

            if self.critic is not None:
                with timer("update_critic", timings):
                    metrics.update(self.critic.update(batch))
            actor_updated = self.global_step > cfg.trainer.critic_warmup  # during the warm-up only the critic learns
            if actor_updated:
                with timer("update_actor", timings):
                    metrics.update(self.actor.update(batch))
            metrics.update(rollouts.after_update(timings, actor_updated))  # the weights to the engines, when due

        metrics.update(data_metrics(batch))
        metrics.update(timing_metrics(timings))
        metrics.update(throughput_metrics(batch, timings, self.n_devices, self.actor_params, self.peak_flops))
        metrics["training/epoch"] = float(rollouts.data_state()["epoch"])  # the trained batch's (the
        # rollout thread may be drawing from the loader meanwhile)
        return metrics

    # ----------------------------------------------------------------------------------------------- validate
    def validate(self, tracking: Tracking | None = None) -> dict[str, float]:
        """Generation with ``val_kwargs`` on the validation set: ``val/<source>/acc`` (mean score per source) and the
        mean@N / best@k / worst@k / maj@k figures (``val-core/...``, ``val-aux/...``, see val_metrics.py); dumps
        the samples (``trainer.validation_data_dir``) and shows a few in the loggers (``log_val_generations``)."""
        if self.val_dataset is None:
            return {}
        tc = self.cfg.trainer
        size = self.cfg.data.val_batch_size or len(self.val_dataset)
        decode = bool(tc.validation_data_dir or tc.log_val_generations)
        samples, lengths = ScoredSamples(), []
        for start in range(0, len(self.val_dataset), size):
            batch = self.val_dataset.get_batch(list(range(start, min(start + size, len(self.val_dataset)))))
            batch.non_tensor_batch["uid"] = np.array([f"val-{start + i}" for i in range(len(batch))], dtype=object)
            batch, scores = self.producer.validation_batch(batch, tag=f"val{start}")
            samples.add(batch, scores, self.tokenizer if decode else None)
            lengths += batch.tensors["response_mask"].sum(-1).float().tolist()
        scores: dict[str, list[float]] = {}
        for source, score in zip(samples.data_sources, samples.scores):
            scores.setdefault(source, []).append(score)
        metrics = {f"val/{source}/acc": float(np.mean(v)) for source, v in scores.items()}
        metrics["val/response_length/mean"] = float(np.mean(lengths)) if lengths else 0.0
        metrics.update(validation_metrics(samples.data_sources, samples.uids, samples.columns()))
        if decode:
            records = samples.records(self.global_step)
            if tc.validation_data_dir:
                dump_jsonl(tc.validation_data_dir, self.global_step, records)
            if tc.log_val_generations and tracking is not None:
                tracking.log_generations(pick_samples(records, tc.log_val_generations), self.global_step)
        return metrics

    # ---------------------------------------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> str:
        def save_workers(path: str) -> None:
            self.actor.save_checkpoint(path)
            if self.critic is not None:
                self.critic.save_checkpoint(path)

        data = self.rollouts.data_state() if self.rollouts else self.loader.state_dict()  # after the last trained batch
        state = {"dataloader": data, "kl_coef": self.kl_ctrl.value, "weight_version": self.weight_sync.version}
        start = time.monotonic()
        path = self.checkpoints.save(self.global_step, save_workers, state)
        self.last_save_time = time.monotonic()
        self.save_metrics = {
            "checkpoint/save_s": self.last_save_time - start,
            "checkpoint/save_bytes": tree_bytes(path),
        }
        return path

    def _resume(self) -> None:
        path = self.plan.resume_path  # trainer.resume_mode's checkpoint, found once (plan.py)
        if path is None:
            logger.info("no checkpoint under %s: starting from scratch", self.checkpoints.root)
            return
        state = self.checkpoints.load_state(path)
        self.actor.load_checkpoint(path)
        if self.critic is not None:
            self.critic.load_checkpoint(path)
        self.loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = state["kl_coef"]
        self.global_step = int(state["global_step"])
        self.weight_sync.version = int(state.get("weight_version", self.global_step))
        if self.weight_sync.rollout is not None:  # split placement: the resumed weights go to the rollout pool
            self.weight_sync.push()
        logger.info("resumed from %s at step %d", path, self.global_step)

    def save_hf(self, path: str) -> str:
        self.actor.save_hf(path, self.cfg.trainer.save_merged)  # LoRA: the adapter (+ the merged model: <path>_merged)
        return path

    def close(self) -> None:
        """Frees all the run holds, on a cluster that may outlive it (a joined or shared one): the scoring
        processes, the worker actors and their placement groups."""
        self.reward_fn.close()
        if self.judge_server is not None:
            self.judge_server.close()
        for group in self.worker_groups:
            group.shutdown()
            assert group.resource_pool is not None  # a started group's (only role views have none)
            group.resource_pool.release()
        if self.pool is not None:  # placed, but its group did not start
            self.pool.release()
