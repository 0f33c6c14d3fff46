"""ActorRolloutRefWorker: actor training, rollout generation and reference log-probs in one process (layer 2).

One instance per rank. It owns a TrainEngine for the actor (any registered backend), optionally a second one
for the frozen reference policy (none with a LoRA actor: its base model, adapters disabled, is the reference), and
a RolloutEngine (vllm or hf). After each actor update the trainer calls
``sync_rollout_weights``: the actor engine streams HF-named full tensors bucket by bucket and the rollout
engine loads each bucket into its own layout, so the whole model never sits twice in memory. Who holds the
device when is ``ColocatedRollout``'s job (colocated_rollout.py): rollout calls enter rollout mode, training
calls (log-probs, updates, checkpoints) enter training mode first, and the rollout engine's state machine
refuses any other order.

Call path from the trainer: ``self.actor.update(batch)`` (``ActorRolloutRefRole``, scaletrain/workers/roles.py) ->
this worker's ``update_actor`` on every rank -> ``train_step`` of the backend's engine.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace

import ray

from backends.base import TrainEngine, get_backend
from backends.checkpoint.meta import HF_META_DIR
from backends.config import ForwardOptions
from backends.dist import peak_memory_metrics
from backends.rollout.base import SamplingConfig, TokenOutput, TokenRequest
from scaletrain.controller import Dispatch, Worker, register
from scaletrain.controller.weight_transport import (
    ReceivedPush,
    WeightBuckets,
    WeightChannel,
    drain,
    open_store,
    put_buckets,
    send_buckets,
)
from scaletrain.protocol import DataProto
from scaletrain.utils.seeding import derive_seed
from scaletrain.workers.colocated_rollout import ColocatedRollout
from scaletrain.workers.config import ActorRolloutRefConfig, CheckpointContents, EngineSetup, log_prob_micro_batching
from scaletrain.workers.dispatch import ENGINE_METRIC, ENGINE_PROTO, ROLLOUT_PROTO, ROLLOUT_TOKENS, declare_engine_mesh
from scaletrain.workers.losses import ACTOR_INPUTS, actor_loss_fn, actor_outputs
from scaletrain.workers.rollout_setup import build_colocated_rollout

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref")
ROLLOUT_REQUESTS = "rollout_requests"  # the concurrency group of the per-request calls (generate_request)


def save_role_checkpoint(engine: TrainEngine, path: str, contents: CheckpointContents) -> None:
    """A role's checkpoint (collective): the engine's state, and with ``hf_model`` its HF export beside the meta in
    ``huggingface/`` (a LoRA engine's merged model, so the directory loads on its own)."""
    engine.save(path)
    if contents.saves_hf_model:
        hf_dir = os.path.join(path, HF_META_DIR)
        if engine.has_adapter:
            engine.save_hf(hf_dir, merged=True)  # pyright: ignore[reportCallIssue] - an adapter engine's signature
        else:
            engine.save_hf(hf_dir)


def rows_per_rank(prompts: int, n: int, dp_size: int, what: str) -> int:
    """Mini-batch rows one rank trains on: ``prompts`` x ``n`` rows split over ``dp_size`` ranks."""
    rows = prompts * n
    if rows % dp_size:
        raise ValueError(f"{what}: {prompts} prompts x n={n} = {rows} rows do not split over {dp_size} ranks")
    return rows // dp_size


class ActorRolloutRefWorker(Worker):
    def __init__(self, config: ActorRolloutRefConfig, setup: EngineSetup, role: str = "actor_rollout_ref") -> None:
        """``config``: the ``actor_rollout_ref.*`` section; ``setup``: the engine's model (the policy's, its path
        resolved), backend and settings the trainer derived for it; ``role``: which of actor, rollout, ref this
        worker hosts."""
        super().__init__()
        parts = role.split("_")
        if not parts or any(p not in ROLES for p in parts):
            raise ValueError(f"role '{role}' must join some of {ROLES} with '_', e.g. actor_rollout_ref")
        self.config, self.setup, self.role, self.parts = config, setup, role, set(parts)
        self.actor: TrainEngine | None = None
        self.ref: TrainEngine | None = None
        self.rollout: ColocatedRollout | None = None
        self.tokenizer = None
        self.weight_version = 0  # split placement: the pushes this rollout engine received
        self._serving = threading.Lock()  # concurrent generate_request calls wake the engine once

    # ------------------------------------------------------------------------------------------------- build
    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg, setup = self.config, self.setup
        backend = get_backend(setup.backend)
        if "actor" in self.parts:
            self.actor = backend(setup.model, cfg.actor.optim, cfg.actor_engine_config(setup))
            declare_engine_mesh(self, self.actor)
            self._mini_rows = rows_per_rank(
                cfg.actor.ppo_mini_batch_size, cfg.rollout.n, self.actor.dp_size, "actor.ppo_mini_batch_size"
            )
        if "ref" in self.parts:
            self._init_ref(backend)
        if "rollout" in self.parts:
            self._init_rollout()

    def _init_ref(self, backend) -> None:
        """The reference policy: with a LoRA actor, the actor itself with its adapters disabled (no second model);
        otherwise a frozen engine of its own (the base model's, when a ref-only worker has LoRA keys)."""
        cfg, policy = self.config, self.setup.model
        if self.actor is not None and self.actor.has_adapter:
            if self.rank == 0:
                logger.info("reference policy: the actor's base model with its LoRA adapters disabled (no ref engine)")
            return
        model = replace(policy, lora_rank=0, lora_adapter_path=None) if policy.lora_rank else policy
        self.ref = backend(model, None, cfg.ref_engine_config(self.setup))
        if self.rank == 0:
            logger.info("reference policy: a separate frozen engine of %s", model.path)
        if self.actor is None:
            declare_engine_mesh(self, self.ref)

    def _init_rollout(self) -> None:
        rc, policy = self.config.rollout, self.setup.model
        self.rollout, self.tokenizer = build_colocated_rollout(
            self,
            rc,
            "vllm_async" if rc.use_async_engine else rc.name,
            policy.checkpoint,
            self.actor,
            max_model_len=sum(rc.resolved_lengths()),
            trust_remote_code=policy.trust_remote_code,
            offload_trainer=rc.offload_train_during_rollout,
            adapter_rank=policy.lora_rank if rc.lora_sync == "adapter" else 0,
            checkpoint_engine=rc.checkpoint_engine,
        )
        # random weights (dummy) or a LoRA actor (its adapter, maybe loaded from lora_adapter_path): the actor's
        # weights go in first (a rollout-only worker gets them pushed by the trainer before it generates)
        if self.actor is not None and (rc.load_format == "dummy" or self.actor.has_adapter):
            self.rollout.push_weights()
        self.rollout.release()

    def _need(self, part: str):
        engine = {"actor": self.actor, "ref": self.ref, "rollout": self.rollout}[part]
        if engine is None:
            raise RuntimeError(f"worker role '{self.role}' has no {part}; call init_model first or add the role")
        return engine

    # ---------------------------------------------------------------------------------------------- rollout
    def _rank_sampling(self, sampling: SamplingConfig | None) -> SamplingConfig:
        """The call's sampling (None: the rollout config's training sampling); a seed becomes one stream per
        rollout DP rank (its TP ranks sample alike)."""
        sampling = sampling or self.config.rollout.train_sampling()
        if sampling.seed is None:
            return sampling
        dp_rank = self.rank // self.config.rollout.tensor_model_parallel_size
        return replace(sampling, seed=derive_seed(sampling.seed, dp_rank))

    def _training(self, part: str):
        """The ``part`` engine, after entering training mode (the rollout engine asleep when free_cache_engine)."""
        if self.rollout is not None:
            self.rollout.release()
        return self._need(part)

    @register(dispatch_mode=ROLLOUT_PROTO)
    def generate_sequences(self, prompts: DataProto, sampling: SamplingConfig | None = None) -> DataProto:
        """Responses to ``prompts``, ``sampling.n`` per prompt: the caller's sampling for this call (training,
        validation, a greedy pass), else the rollout config's training sampling."""
        return self._need("rollout").generate(prompts, self._rank_sampling(sampling))

    @register(dispatch_mode=ROLLOUT_TOKENS)
    def generate_tokens(self, requests: list[TokenRequest]) -> list[TokenOutput]:
        """Token-level generation for the agent loops: this rollout DP rank's requests (sampling per request).
        The engine stays awake between calls: a rollout phase's flushes do not sleep and wake it."""
        if not requests:
            return []
        return self._need("rollout").generate_tokens(requests)

    @register(dispatch_mode=Dispatch.DIRECT, concurrency_group=ROLLOUT_REQUESTS)
    def generate_request(self, request: TokenRequest) -> TokenOutput:
        """One agent-loop request on this rank's async engine (vLLM's AsyncLLM, ``rollout.async_engine``), beside
        every other request in flight: each call runs in a thread of the ``rollout_requests`` group and the engine
        batches them continuously. The driver starts no training call meanwhile (rollout phases, RolloutRole)."""
        with self._serving:
            engine = self._need("rollout").serve()
        return engine.submit(request).result()

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> int:
        """Actor weights -> rollout engine, streamed in buckets of ``rollout.weight_bucket_bytes``, into woken
        engine weights; the engine then wakes its KV cache (rollout mode). With ``rollout.lora_sync=adapter`` only
        the LoRA adapter goes. Returns the bytes handed to this rank's engine."""
        self._need("actor")
        return self._need("rollout").push_weights()

    @register(Dispatch.ONE_TO_ALL)
    def open_weight_channel(self, timeout_s: float) -> tuple[str, int] | None:
        """Split placement's collective push: rank 0, the export rank, hosts the push group's store; returns
        (its node's address, the store's port) there, None on the other ranks."""
        if self.rank != 0:
            return None
        host = ray.util.get_node_ip_address()
        return host, open_store(host, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def export_weights(self, version: int, channel: WeightChannel | None = None) -> WeightBuckets | int | None:
        """Split placement: the actor's weights (its LoRA adapter alone with ``rollout.lora_sync=adapter``), in
        buckets of ``rollout.weight_bucket_bytes``: every rank gathers, rank 0 sends. Over ``channel`` (the
        collective push) rank 0 broadcasts them to the rollout ranks and returns the bytes sent; without one it
        puts them in the object store and returns the references. The other ranks return None."""
        actor, bucket_bytes = self._training("actor"), self.config.rollout.weight_bucket_bytes
        if self.config.rollout.lora_sync == "adapter" and actor.has_adapter:
            buckets, adapter_config = actor.export_adapter(bucket_bytes), actor.adapter_config()
        else:
            buckets, adapter_config = actor.export_weights(bucket_bytes), None
        if self.rank != 0:
            drain(buckets)  # the gathers are collective
            return None
        if channel is not None:
            return send_buckets(channel, buckets, adapter_config)
        return put_buckets(buckets, version, adapter_config)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, weights: WeightBuckets | WeightChannel) -> int:
        """Split placement: another worker group's push into this rank's rollout engine (its own TP shards), from
        the object store or over the push group; returns the bytes read. A LoRA adapter's buckets are served on
        the engine's base weights."""
        rollout = self._need("rollout")
        push = ReceivedPush(weights, self.rank)
        try:
            if push.adapter_config is None:
                rollout.load_weights(push.buckets)
            else:
                rollout.load_adapter(push.buckets, push.adapter_config)
        finally:
            push.finish()  # a collective push is read to its end even after a failed load: no peer is left waiting
        self.weight_version = push.version
        return push.nbytes

    @register(Dispatch.ONE_TO_ALL)
    def rollout_status(self) -> dict:
        """The rollout engine's lifecycle state, the moves taken so far and the bytes this rank received in the
        last weight sync (for checks and debugging)."""
        rollout = self._need("rollout")
        return {
            "state": rollout.lifecycle.state.value,
            "history": list(rollout.lifecycle.history),
            "last_update_bytes": getattr(rollout.engine, "last_update_bytes", None),
            "weight_version": self.weight_version,
        }

    # ------------------------------------------------------------------------------------------- log-probs
    @register(dispatch_mode=ENGINE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        options = ForwardOptions(micro_batching=log_prob_micro_batching(self.config.rollout))
        extra = ("sum_pi_squared",) if self.config.actor.calculate_sum_pi_squared else ()
        out = self._training("actor").forward(data, outputs=("log_probs", "entropy", *extra), options=options)
        columns = {"old_log_probs": out.batch["log_probs"], "entropys": out.batch["entropy"]}
        return DataProto.from_dict({**columns, **{name: out.batch[name] for name in extra}})

    @register(dispatch_mode=ENGINE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob``: the ref engine's, or with a LoRA actor (no ref engine) the actor's base model's."""
        micro_batching = log_prob_micro_batching(self.config.ref)
        if self.ref is None and self.actor is not None and self.actor.has_adapter and "ref" in self.parts:
            options = ForwardOptions(micro_batching=micro_batching, base_model=True)
            out = self._training("actor").forward(data, outputs=("log_probs",), options=options)
            return DataProto.from_dict({"ref_log_prob": out.batch["log_probs"]})
        out = self._training("ref").forward(data, outputs=("log_probs",), options=ForwardOptions(micro_batching))
        return DataProto.from_dict({"ref_log_prob": out.batch["log_probs"]})

    # -------------------------------------------------------------------------------------------- training
    @register(dispatch_mode=ENGINE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        actor, cfg = self._training("actor"), self.config.actor
        keys = list(ACTOR_INPUTS)
        keys += [
            k
            for k in ("ref_log_prob", "rollout_log_probs", "token_level_rewards", "rollout_is_weights")
            if k in data.tensors.keys()
        ]
        if cfg.use_kl_loss and "ref_log_prob" not in data.tensors.keys():
            raise ValueError("actor.use_kl_loss needs 'ref_log_prob' in the batch (run compute_ref_log_prob)")
        batch = data.select(batch_keys=keys)
        seed = cfg.data_loader_seed if cfg.shuffle else None
        loss_fn, outputs = actor_loss_fn(cfg), actor_outputs(cfg)
        totals: dict[str, list[float]] = {}
        for mini in batch.make_iterator(self._mini_rows, epochs=cfg.ppo_epochs, seed=seed):
            for key, value in actor.train_step(mini, loss_fn, outputs=outputs).items():
                totals.setdefault(key, []).append(float(value))
        metrics = {k: sum(v) / len(v) for k, v in totals.items()}
        metrics = {(k if "/" in k else f"actor/{k}"): v for k, v in metrics.items()}
        return {**metrics, **peak_memory_metrics()}  # colocated: the rollout's peak is this process's too

    # ---------------------------------------------------------------------------------------- checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        save_role_checkpoint(self._training("actor"), os.path.join(path, "actor"), self.config.actor.checkpoint)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._training("actor").load(os.path.join(path, "actor"))
        if self.rollout is not None:
            self.sync_rollout_weights()

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, path: str, save_merged: bool = False) -> None:
        """The actor as an HF checkpoint at ``path``; a LoRA actor as its PEFT adapter directory there and, with
        ``save_merged``, also as the merged model at ``merged_dir(path)``."""
        actor = self._training("actor")
        actor.save_hf(path)
        paths = [path]
        if save_merged and actor.has_adapter:
            actor.save_hf(merged_dir(path), merged=True)
            paths.append(merged_dir(path))
        if self.rank == 0 and self.tokenizer is not None:
            for out in paths:
                self.tokenizer.save_pretrained(out)


def merged_dir(path: str) -> str:
    """Where ``save_hf(path, save_merged=True)`` writes a LoRA actor's merged model: ``<path>_merged``."""
    return os.path.normpath(path) + "_merged"
