"""``verl.workers.config.actor``: the actor section a policy loss receives as ``config``.

``PolicyLossConfig`` is scaletrain's. ``ActorConfig`` is scaletrain's with the one key verl's actor section carries
that scaletrain's does not: ``rollout_n`` (verl's actor sizes its mini-batches in rows with it; scaletrain's
trainer reads n from the rollout section). ``global_batch_info`` is scaletrain's, for verl-written losses.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.workers.config import ActorConfig as _ActorConfig
from scaletrain.workers.config import PolicyLossConfig


@dataclass
class ActorConfig(_ActorConfig):
    rollout_n: int = 1  # the rollout's n, as verl's actor section holds it; read by code written for verl only


__all__ = ["ActorConfig", "PolicyLossConfig"]
