"""Trained weights into the rollout engines (layer 4): in place when colocated, pushed when placement is split.

Colocated (``actor_rollout_ref.hybrid_engine=true``): each rank streams its actor's buckets into its own engine
(``ActorRolloutRefWorker.sync_rollout_weights``). Split: the actor ranks put the buckets in Ray's object store
(rank 0 puts; scaletrain/controller/weight_transport.py) and the rollout ranks read them into their engines; the
export runs while the engines may still be generating, only the load waits for them. ``version`` counts the
pushes; each one's bytes and time go into the step metrics (``perf/weight_sync_bytes`` / ``perf/weight_sync_s``,
either placement: a LoRA actor's adapter alone with ``rollout.lora_sync=adapter``, else the full weights; split
placement adds its export time and GiB/s as ``perf/weight_push_*``).
"""

from __future__ import annotations

import time

from scaletrain.workers.roles import ActorRolloutRefRole, RolloutRole


class WeightSync:
    def __init__(self, actor: ActorRolloutRefRole, rollout: RolloutRole | None) -> None:
        self.actor, self.rollout = actor, rollout  # rollout None: colocated
        self.version = 0

    def push(self) -> dict[str, float]:
        """The actor's current weights into every rollout engine; returns the push's metrics."""
        start = time.perf_counter()
        self.version += 1
        if self.rollout is None:
            nbytes = self.actor.sync_weights()
            return {
                "async/weight_version": float(self.version),
                "perf/weight_sync_bytes": float(nbytes),
                "perf/weight_sync_s": time.perf_counter() - start,
            }
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
