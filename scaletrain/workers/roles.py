"""Typed roles (layer 2's client side): what the trainers call on their worker groups, one small class per role.

Each method is one visible call into the role's worker group, naming the worker's own method::

    def update(self, batch: DataProto) -> dict[str, float]:
        return reduce_metrics(self.group.call(ActorRolloutRefWorker.update_actor, batch))

so "go to definition" goes from the trainer to here, and from here to the worker method (which calls its
engine), and the return types are the ones the trainer gets: the group's per-rank outputs are collected by the
method's @register dispatch mode and, for metrics, averaged over the ranks here. The worker groups underneath are
the verl-style controller (scaletrain/controller): dispatch modes, colocation, role-prefixed names across Ray.
"""

from __future__ import annotations

import asyncio
import threading

from backends.rollout.base import SamplingConfig, TokenOutput, TokenRequest
from scaletrain.controller import ROLLOUT_MESH, WorkerGroup
from scaletrain.controller.weight_transport import WeightBuckets, WeightChannel
from scaletrain.protocol import DataProto
from scaletrain.workers.actor_rollout_ref import ActorRolloutRefWorker
from scaletrain.workers.critic import CriticWorker
from scaletrain.workers.dispatch import reduce_metrics
from scaletrain.workers.generative_rm import GenerativeRewardModelWorker
from scaletrain.workers.reward_model import RewardModelWorker
from scaletrain.workers.sft import SFTWorker


class ActorRolloutRefRole:
    """The policy: rollout generation, old / reference log-probs, the actor update and the weight sync."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init_model(self) -> None:
        self.group.call(ActorRolloutRefWorker.init_model)

    def generate(self, prompts: DataProto, sampling: SamplingConfig | None = None) -> DataProto:
        """Responses to ``prompts``, ``sampling.n`` per prompt (None: the rollout config's training sampling)."""
        return self.group.call(ActorRolloutRefWorker.generate_sequences, prompts, sampling)

    def generate_tokens(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]:
        """Token-level generation for the agent loops: one request list per rollout DP rank in, one output list out."""
        return self.group.call(ActorRolloutRefWorker.generate_tokens, per_rank)

    async def generate_request(self, dp_rank: int, request: TokenRequest) -> TokenOutput:
        """One agent-loop request on rollout engine ``dp_rank``'s async engine, at once (``rollout.async_engine``)."""
        worker = engine_worker(self.group, dp_rank)
        return await self.group.submit(worker, ActorRolloutRefWorker.generate_request, request)

    def rollout_dp_size(self) -> int:
        """How many rollout engines (DP ranks) ``generate_tokens`` takes a request list for."""
        return self.group.mesh_dp_size(ROLLOUT_MESH)

    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` of the current policy."""
        return self.group.call(ActorRolloutRefWorker.compute_log_prob, batch)

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """``ref_log_prob`` of the frozen reference policy."""
        return self.group.call(ActorRolloutRefWorker.compute_ref_log_prob, batch)

    def update(self, batch: DataProto) -> dict[str, float]:
        """The PPO epochs over ``batch``'s mini-batches; metrics averaged over the ranks."""
        return reduce_metrics(self.group.call(ActorRolloutRefWorker.update_actor, batch))

    def sync_weights(self) -> int:
        """The actor's weights (or its LoRA adapter: ``rollout.lora_sync=adapter``) into the rollout engines;
        returns the bytes rank 0 handed to its engine."""
        return self.group.call(ActorRolloutRefWorker.sync_rollout_weights)[0]

    def export_weights(self, version: int) -> WeightBuckets:
        """Split placement: the actor's weights as object-store buckets (rank 0's references)."""
        weights = self.group.call(ActorRolloutRefWorker.export_weights, version)[0]
        assert isinstance(weights, WeightBuckets)
        return weights

    def send_weights(self, channel: WeightChannel) -> int:
        """Split placement: the actor's weights over ``channel``, the collective push group; the bytes sent."""
        return self.group.call(ActorRolloutRefWorker.export_weights, channel.version, channel)[0]

    def open_weight_channel(self, timeout_s: float) -> tuple[str, int]:
        """The collective push group's meeting point, hosted by the export rank: (address, port)."""
        return self.group.call(ActorRolloutRefWorker.open_weight_channel, timeout_s)[0]

    def save_checkpoint(self, path: str) -> None:
        self.group.call(ActorRolloutRefWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call(ActorRolloutRefWorker.load_checkpoint, path)

    def save_hf(self, path: str, save_merged: bool = False) -> None:
        """The HF export (a LoRA actor: its PEFT adapter; with ``save_merged`` also the merged model next to it)."""
        self.group.call(ActorRolloutRefWorker.save_hf, path, save_merged)


def engine_worker(group: WorkerGroup, dp_rank: int) -> int:
    """The worker rank whose output stands for rollout engine ``dp_rank`` (its TP rank 0)."""
    places = group.mesh_places(ROLLOUT_MESH)
    return next(i for i, p in enumerate(places) if p.dp_rank == dp_rank and p.is_collect)


class RolloutRole:
    """Split placement: the rollout engines on their own pool (rollout-only ActorRolloutRefWorkers). Group calls
    take turns: every rank of a generation call runs the same weights although the rollouter and the trainer call
    from different threads, and a waiting weight push goes before the next generation call (a partial rollout's
    next segment included). Single requests to the async engines (``generate_request``) run together, but never
    beside a group call: a push waits for those in flight and holds new ones back. ``version`` counts the pushes
    received; each output says which version made it (``meta_info["weight_version"]``,
    ``TokenOutput.weight_version``)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.turn = threading.Condition()
        self.busy = False
        self.pushes_waiting = 0
        self.requests_in_flight = 0
        self.version = 0

    def _call(self, method, *args, new_version: int | None = None):
        """(the group call's result, the weight version it ran with); ``new_version``: a push, which goes first."""
        push = new_version is not None
        with self.turn:
            self.pushes_waiting += push
            while self.busy or self.requests_in_flight or (self.pushes_waiting and not push):
                self.turn.wait()
            self.busy = True
        try:
            out = self.group.call(method, *args)
            if push:
                self.version = new_version
            return out, self.version
        finally:
            with self.turn:
                self.busy = False
                self.pushes_waiting -= push
                self.turn.notify_all()

    def init_model(self) -> None:
        self.group.call(ActorRolloutRefWorker.init_model)

    def generate(self, prompts: DataProto, sampling: SamplingConfig | None = None) -> DataProto:
        out, version = self._call(ActorRolloutRefWorker.generate_sequences, prompts, sampling)
        out.meta_info["weight_version"] = version
        return out

    def generate_tokens(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]:
        outputs, version = self._call(ActorRolloutRefWorker.generate_tokens, per_rank)
        for rank_outputs in outputs:
            for out in rank_outputs:
                out.weight_version = version
        return outputs

    async def generate_request(self, dp_rank: int, request: TokenRequest) -> TokenOutput:
        """One request on engine ``dp_rank``'s async engine, once no group call runs and no push waits (polled:
        this runs on the agent loops' event loop, which must not block)."""
        while True:
            with self.turn:
                if not (self.busy or self.pushes_waiting):
                    self.requests_in_flight += 1
                    version = self.version
                    break
            await asyncio.sleep(0.002)
        try:
            worker = engine_worker(self.group, dp_rank)
            out = await self.group.submit(worker, ActorRolloutRefWorker.generate_request, request)
        finally:
            with self.turn:
                self.requests_in_flight -= 1
                self.turn.notify_all()
        out.weight_version = version
        return out

    def rollout_dp_size(self) -> int:
        return self.group.mesh_dp_size(ROLLOUT_MESH)

    def receive_weights(self, weights: WeightBuckets | WeightChannel) -> int:
        """The pushed weights into every engine, before the next generation call; returns the bytes each read."""
        per_rank, _ = self._call(ActorRolloutRefWorker.receive_weights, weights, new_version=weights.version)
        return per_rank[0]


class CriticRole:
    """The value model: values of a batch and its update."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init_model(self) -> None:
        self.group.call(CriticWorker.init_model)

    def compute_values(self, batch: DataProto) -> DataProto:
        return self.group.call(CriticWorker.compute_values, batch)

    def update(self, batch: DataProto) -> dict[str, float]:
        """The value-loss epochs over ``batch``'s mini-batches; metrics averaged over the ranks."""
        return reduce_metrics(self.group.call(CriticWorker.update_critic, batch))

    def save_checkpoint(self, path: str) -> None:
        self.group.call(CriticWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.call(CriticWorker.load_checkpoint, path)


class RewardModelRole:
    """The reward model: one score per response."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init_model(self) -> None:
        self.group.call(RewardModelWorker.init_model)

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        """``rm_scores`` (B, R): each row's score at its last valid response token."""
        return self.group.call(RewardModelWorker.compute_rm_score, batch)


class GenerativeRewardModelRole:
    """A generative judge's engines: token-level replies to the judge server's requests, asleep while training."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init_model(self) -> None:
        self.group.call(GenerativeRewardModelWorker.init_model)

    def rollout_dp_size(self) -> int:
        """How many judge engines ``generate_tokens`` takes a request list for."""
        return self.group.mesh_dp_size(ROLLOUT_MESH)

    def generate_tokens(self, per_rank: list[list[TokenRequest]]) -> list[list[TokenOutput]]:
        """One request list per judge engine in, one output list out."""
        return self.group.call(GenerativeRewardModelWorker.generate_tokens, per_rank)

    def release(self) -> None:
        """The engines asleep (colocated) while the actor trains; the next request wakes them."""
        self.group.call(GenerativeRewardModelWorker.release)

    def engine_states(self) -> list[str]:
        return self.group.call(GenerativeRewardModelWorker.engine_state)


class SFTRole:
    """The SFT model: a training step, the validation NLL and greedy generation."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init_model(self) -> None:
        self.group.call(SFTWorker.init_model)

    def train_batch(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on ``batch``; metrics averaged over the ranks."""
        return reduce_metrics(self.group.call(SFTWorker.train_batch, batch))

    def eval_loss(self, batch: DataProto) -> DataProto:
        """``nll_sum`` and ``num_tokens`` per row."""
        return self.group.call(SFTWorker.eval_loss, batch)

    def generate(self, prompts: DataProto) -> DataProto:
        """One greedy response per prompt from the current weights."""
        return self.group.call(SFTWorker.generate, prompts)

    def save_hf(self, path: str) -> None:
        self.group.call(SFTWorker.save_hf, path)
