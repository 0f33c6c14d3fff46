"""Trained weights into the rollout engines (layer 4): in place when colocated, pushed when placement is split.

Colocated (``actor_rollout_ref.hybrid_engine=true``): each rank streams its actor's buckets into its own engine
(``ActorRolloutRefWorker.sync_rollout_weights``). Split: the actor ranks gather the buckets and the export rank
sends them to every rollout rank, over a collective group of its own (``checkpoint_engine.backend`` nccl, auto's
choice on CPU: the export and the loads run at once, scaletrain/controller/weight_transport.py) or through Ray's
object store (naive, and auto on CUDA until the NCCL push has run on a GPU: the export runs while the engines may
still be generating, only the load waits for them). ``version`` counts the pushes; each one's bytes and time go
into the step metrics (``perf/weight_sync_bytes`` / ``perf/weight_sync_s``, either placement: a LoRA actor's
adapter alone with ``rollout.lora_sync=adapter``, else the full weights; split placement adds its export time and
GiB/s as ``perf/weight_push_*``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from backends.rollout.base import CheckpointEngineSettings
from scaletrain.controller import WorkerDiedError
from scaletrain.controller.weight_transport import WeightChannel
from scaletrain.workers.roles import ActorRolloutRefRole, RolloutRole

DEFAULT_TIMEOUT_S = 600.0  # the push group's collective timeout (checkpoint_engine.engine_kwargs.nccl.timeout_s)


class WeightSync:
    def __init__(
        self,
        actor: ActorRolloutRefRole,
        rollout: RolloutRole | None,
        settings: CheckpointEngineSettings | None = None,
        device: str = "cpu",
    ) -> None:
        """``rollout`` None: colocated. ``settings``: the rollout's ``checkpoint_engine``; ``device``: the
        trainer's (cpu | cuda)."""
        self.actor, self.rollout = actor, rollout
        self.settings, self.device = settings or CheckpointEngineSettings(), device
        self.transport = self.settings.pool_transport(device) if rollout is not None else "colocated"
        self.channel: WeightChannel | None = None  # the collective push group, opened by the first push
        self.version = 0

    def push(self) -> dict[str, float]:
        """The actor's current weights into every rollout engine as the next version; returns the push's metrics."""
        self.version += 1
        return self.send()

    def send(self) -> dict[str, float]:
        """The actor's current weights into every rollout engine as ``version`` (the first push of a split pool
        sends version 0); returns the push's metrics."""
        start = time.perf_counter()
        if self.rollout is None:
            nbytes = self.actor.sync_weights()
            return {
                "async/weight_version": float(self.version),
                "perf/weight_sync_bytes": float(nbytes),
                "perf/weight_sync_s": time.perf_counter() - start,
            }
        if self.transport == "nccl":
            nbytes, exported = self._push_collective(start)
        else:
            weights = self.actor.export_weights(self.version)
            exported = time.perf_counter()
            nbytes = self.rollout.receive_weights(weights)
        seconds = time.perf_counter() - start
        return {
            "async/weight_version": float(self.version),
            "perf/weight_sync_bytes": float(nbytes),
            "perf/weight_sync_s": seconds,
            "perf/weight_push_bytes": float(nbytes),
            "perf/weight_push_s": seconds,
            "perf/weight_push_export_s": exported - start,
            "perf/weight_push_gib_per_s": nbytes / seconds / (1 << 30),
        }

    def _push_collective(self, start: float) -> tuple[int, float]:
        """(bytes each rollout rank received, when the export ended): the export rank's broadcasts and the rollout
        ranks' loads run at once, the driver waiting on both."""
        assert self.rollout is not None
        channel = replace(self._channel(), version=self.version)
        pool = ThreadPoolExecutor(1, thread_name_prefix="weight-push")
        ended = [start]

        def export() -> None:
            self.actor.send_weights(channel)
            ended[0] = time.perf_counter()

        sender = pool.submit(export)
        try:
            nbytes = self.rollout.receive_weights(channel)
        except WorkerDiedError:  # a rollout rank died: that is the error (the export then fails on it)
            pool.shutdown(wait=False)
            raise
        except BaseException as received:
            pool.shutdown(wait=False)
            try:
                export_error = sender.exception(timeout=30.0)
            except TimeoutError:
                export_error = None
            if export_error is not None:  # the export failed first: the receivers only saw its abort
                raise export_error from received
            raise
        sender.result()
        pool.shutdown()
        return nbytes, ended[0]

    def _channel(self) -> WeightChannel:
        if self.channel is None:
            assert self.rollout is not None
            timeout_s = float(self.settings.nccl_kwarg("timeout_s", DEFAULT_TIMEOUT_S))
            host, port = self.actor.open_weight_channel(timeout_s)
            world_size, same_node = 1 + self.rollout.group.world_size, self.settings.push_same_node()
            self.channel = WeightChannel(host, port, world_size, self.device, timeout_s, same_node=same_node)
        return self.channel
