"""``async_training.mode=fully_async`` (layer 4): a rollouter thread streams scored batches to the trainer.

The rollouter draws the next ``data.train_batch_size`` prompts, generates and scores them on the rollout engines
(split placement) and puts the batch in a queue, batch after batch; the trainer takes them in order, one a step
(``actor.ppo_mini_batch_size`` groups, an optimizer step per PPO epoch) and pushes its weights every
``trigger_parameter_sync_step`` steps. Batch ``b`` (counted from the run's start or its resume) may start only
while ``b < (pushes + 1 + staleness_threshold) * trigger_parameter_sync_step``: the rollouter is never more than
that many batches ahead of the last push, so no batch is trained more than ceil(staleness_threshold) weight
versions after the one that generated it. With ``staleness_threshold=0`` and a push each step, this is the
synchronous trainer's schedule: the same prompts, seeds and weights, step for step.

Batch ``b`` is generated with the seeds and ids of step ``b`` (the step that will train it), so a resumed run,
which drops the queue and regenerates from the loader position after the last trained batch, draws the same
prompts. ``rollout.total_rollout_steps`` bounds the prompts generated in all.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any

from scaletrain.data import StatefulDataLoader
from scaletrain.trainer.config.ppo_config import AsyncTrainingConfig
from scaletrain.trainer.rollout.dynamic_sampling import Scored
from scaletrain.trainer.rollout.producer import RolloutProducer
from scaletrain.trainer.rollout.schedules import next_batch, staleness_metrics
from scaletrain.trainer.rollout.weight_sync import WeightSync
from scaletrain.trainer.step.metrics import timer

logger = logging.getLogger(__name__)


class FullyAsyncRollouts:
    def __init__(
        self,
        producer: RolloutProducer,
        loader: StatefulDataLoader,
        weight_sync: WeightSync,
        config: AsyncTrainingConfig,
        first_step: int,
        max_batches: int,
    ) -> None:
        """``first_step``: the step the first batch is for (batch b is generated for step first_step + b);
        ``max_batches``: the batches to generate from here (the steps left, bounded by total_rollout_steps)."""
        self.producer, self.loader, self.weight_sync = producer, loader, weight_sync
        self.sync_every = config.trigger_parameter_sync_step
        self.staleness = config.staleness_threshold
        self.max_batches = max_batches
        self.first_step = first_step
        self.cond = threading.Condition()
        self.ready: deque[tuple[Scored, dict[str, Any], dict[str, float]]] = deque()
        self.started = 0  # batches the rollouter began
        self.pushes = 0  # pushes since this source started
        self.steps_since_push = 0
        self.unpushed = False  # the actor changed since the last push
        self.stopping = False
        self.done = False
        self.error: BaseException | None = None
        self.rollout_idle_s = 0.0  # waiting for the trainer, since the last step took its batch
        self.consumed_state = loader.state_dict()
        self.thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------ rollouter
    def _may_start(self) -> bool:
        return self.started < math.floor((self.pushes + 1 + self.staleness) * self.sync_every + 1e-9)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    waited = time.perf_counter()
                    while not self.stopping and self.started < self.max_batches and not self._may_start():
                        self.cond.wait()
                    self.rollout_idle_s += time.perf_counter() - waited
                    if self.stopping or self.started >= self.max_batches:
                        break
                    step = self.first_step + self.started
                    self.started += 1
                batch = next_batch(self.loader)  # only this thread draws from the loader
                data_state = self.loader.state_dict()
                timings: dict[str, float] = {}
                scored = self.producer.scored(batch, step, 0, timings)
                with self.cond:
                    self.ready.append((scored, data_state, timings))
                    self.cond.notify_all()
        except BaseException as err:  # the trainer re-raises it at its next batch
            logger.exception("the rollouter failed")
            with self.cond:
                self.error = err
                self.cond.notify_all()
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    # -------------------------------------------------------------------------------------------- trainer
    def next(self, step: int, timings: dict[str, float]) -> Scored | None:
        """The next batch in generation order; None when the rollouter has generated all it may."""
        waited = time.perf_counter()
        with self.cond:
            while not self.ready and self.error is None and not self.done:
                self.cond.wait()
            if self.error is not None:
                raise RuntimeError(f"the rollouter failed: {self.error}") from self.error
            if not self.ready:
                return None
            scored, data_state, gen_timings = self.ready.popleft()
            queued = len(self.ready)
            rollout_idle, self.rollout_idle_s = self.rollout_idle_s, 0.0
        timings.update(gen_timings)
        self.consumed_state = data_state
        scored.metrics.update(
            {
                "async/trainer_idle_s": time.perf_counter() - waited,
                "async/queue_size": float(queued),
                "async/rollout_idle_s": rollout_idle,
                **staleness_metrics(scored, self.weight_sync.version),
            }
        )
        return scored

    def after_update(self, timings: dict[str, float], actor_updated: bool = True) -> dict[str, float]:
        """Every ``trigger_parameter_sync_step`` steps, the push; a step that left the actor unchanged (the
        critic's warm-up) counts toward the schedule without moving weights."""
        self.unpushed |= actor_updated
        self.steps_since_push += 1
        return self._push(timings) if self.steps_since_push >= self.sync_every else {}

    def _push(self, timings: dict[str, float]) -> dict[str, float]:
        metrics = {}
        if self.unpushed:
            with timer("sync_weights", timings):
                metrics = self.weight_sync.push()  # waits for the engines' call in flight
            self.unpushed = False
        with self.cond:
            self.pushes += 1
            self.steps_since_push = 0
            self.cond.notify_all()
        return metrics

    def before_validation(self, last: bool) -> dict[str, float]:
        """Validation measures the engines' weights, at most ``trigger_parameter_sync_step - 1`` steps behind the
        trainer (an extra push would let the rollouter run further ahead than the staleness bound allows); after
        the last step, when nothing more is generated, the newest weights are pushed first."""
        return self._push({}) if last and self.steps_since_push else {}

    def data_state(self) -> dict[str, Any]:
        return self.consumed_state

    def close(self) -> None:
        """Stops the rollouter after its call in flight (a Ray call cannot be abandoned midway)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
