"""Role workers (layer 2): actor/rollout/ref, critic and reward model, each a controller Worker.

Backend-agnostic: each builds the TrainEngine its config names (``register_backend``) and the rollout engine
(``register_rollout``), declares where its engine wants data (dispatch.py), and assembles losses from
``scaletrain.algos`` (losses.py).
"""

from scaletrain.workers.actor_rollout_ref import ActorRolloutRefWorker
from scaletrain.workers.config import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    EngineSetup,
    PolicyLossConfig,
    RefConfig,
    RolloutWorkerConfig,
)
from scaletrain.workers.critic import CriticWorker
from scaletrain.workers.dispatch import reduce_metrics
from scaletrain.workers.reward_model import RewardModelWorker
from scaletrain.workers.rm_config import RewardModelConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "ActorRolloutRefWorker",
    "CriticConfig",
    "CriticWorker",
    "EngineSetup",
    "PolicyLossConfig",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelWorker",
    "RolloutWorkerConfig",
    "reduce_metrics",
]
