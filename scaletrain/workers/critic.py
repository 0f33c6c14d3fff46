"""CriticWorker: the value model, its forward pass and its PPO update (layer 2).

Owns one TrainEngine built from a ``kind="value"`` model (a token-classification head with one output, so each
position yields a value). ``compute_values`` gives (B, R) values aligned with the response tokens;
``update_critic`` trains on returns with the clipped value loss.
"""

from __future__ import annotations

import os
from dataclasses import replace

from backends.base import TrainEngine, get_backend
from scaletrain.controller import Dispatch, Worker, register
from scaletrain.protocol import DataProto
from scaletrain.utils.typed_config import resolved
from scaletrain.workers.actor_rollout_ref import rows_per_rank, save_role_checkpoint
from scaletrain.workers.config import CriticConfig, EngineSetup
from scaletrain.workers.dispatch import ENGINE_METRIC, ENGINE_PROTO, declare_engine_mesh
from scaletrain.workers.losses import CRITIC_INPUTS, critic_loss_fn


class CriticWorker(Worker):
    def __init__(self, config: CriticConfig, setup: EngineSetup) -> None:
        """``config``: the ``critic.*`` section (resolved: no null mini-batch or epochs); ``setup``: the engine's
        model, backend and settings the trainer derived for it."""
        super().__init__()
        self.config = config
        self.setup = setup
        self.engine: TrainEngine | None = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg, setup = self.config, self.setup
        model = setup.model if setup.model.kind == "value" else replace(setup.model, kind="value")
        self.engine = get_backend(setup.backend)(model, cfg.optim, cfg.engine_config(setup))
        declare_engine_mesh(self, self.engine)
        mini_batch = resolved(cfg.ppo_mini_batch_size, "critic.ppo_mini_batch_size")
        self._mini_rows = rows_per_rank(mini_batch, setup.rollout_n, self.engine.dp_size, "critic.ppo_mini_batch_size")

    @register(dispatch_mode=ENGINE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        out = self._need_engine().forward(data, outputs=("values",))
        return DataProto.from_dict({"values": out.tensors["values"]})

    @register(dispatch_mode=ENGINE_METRIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        cfg = self.config
        batch = data.select(batch_keys=list(CRITIC_INPUTS))
        seed = cfg.data_loader_seed if cfg.shuffle else None
        loss_fn = critic_loss_fn(cfg)
        totals: dict[str, list[float]] = {}
        engine = self._need_engine()
        epochs = resolved(cfg.ppo_epochs, "critic.ppo_epochs")
        for mini in batch.make_iterator(self._mini_rows, epochs=epochs, seed=seed):
            for key, value in engine.train_step(mini, loss_fn, outputs=("values",)).items():
                totals.setdefault(key, []).append(float(value))
        return {(k if "/" in k else f"critic/{k}"): sum(v) / len(v) for k, v in totals.items()}

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        save_role_checkpoint(self._need_engine(), os.path.join(path, "critic"), self.config.checkpoint)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._need_engine().load(os.path.join(path, "critic"))

    def _need_engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError("CriticWorker: call init_model first")
        return self.engine
