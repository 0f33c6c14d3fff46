"""Reward health (layer 4): signals that the reward a run optimises has stopped teaching, logged every step as
``reward_health/*``, and the alarm when one lasts (``reward.health.*``, RewardHealthConfig).

Signals (each logged only when the batch can show it):

- ``zero_variance_groups``: the share of groups (a prompt's samples, by ``uid``, of 2 or more) whose samples all got
  the same reward. Group-relative advantages (GRPO, RLOO, ...) are 0 there: a flat reward teaches nothing.
- ``format_only``: the share of samples rewarded (score > 0) for their format while their answer is wrong, where
  the scorer reports both components in its extra info (``format_component``, the first of
  ``answer_components``): a policy learning the format and not the task.
- ``length_corr``: the Pearson correlation of the reward and the response length (0 when either is constant): a
  reward that follows length is gamed by padding or cutting.
- ``judge_rule_disagreement``: with a reward model and a rule reward both running (``rm_score`` and
  ``rule_score`` in the extra info), the share of samples on which their verdicts differ, each verdict being
  "above that source's batch mean".

A signal beyond its threshold (its absolute value, for the correlation) in ``patience`` consecutive steps is an
alarm: ``action=warn`` logs a warning naming the signal, its threshold key and the steps (again every ``patience``
steps it lasts); ``action=stop`` raises RewardHealthError before the step trains, so the checkpoints written so
far are the run's last state before it. ``reward_health/alarms`` counts the signals in alarm each step.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import RewardHealthConfig
from scaletrain.trainer.step.metrics import reward_groups
from scaletrain.utils.typed_config import ConfigError

logger = logging.getLogger(__name__)

PREFIX = "reward_health/"
SIGNALS = {  # signal -> (its threshold's key under reward.health, what a sustained alarm means)
    "zero_variance_groups": (
        "max_zero_variance_groups",
        "the reward signal is flat: every sample of those groups got the same reward, so their advantages are 0",
    ),
    "format_only": ("max_format_only", "samples are rewarded for their format while their answer is wrong"),
    "length_corr": ("max_length_corr", "the reward follows the response length"),
    "judge_rule_disagreement": ("max_judge_rule_disagreement", "the reward model and the rule reward disagree"),
}
ACTIONS = ("warn", "stop")


def thresholds(cfg: RewardHealthConfig) -> dict[str, float | None]:
    """Each signal's threshold (None: never an alarm)."""
    return {
        "zero_variance_groups": cfg.max_zero_variance_groups,
        "format_only": cfg.max_format_only,
        "length_corr": cfg.max_length_corr,
        "judge_rule_disagreement": cfg.max_judge_rule_disagreement,
    }


class RewardHealthError(RuntimeError):
    """A reward-health signal stayed beyond its threshold for ``reward.health.patience`` steps (action=stop)."""


def validate_reward_health(cfg: RewardHealthConfig) -> None:
    """``reward.health.*`` before Ray: ConfigError naming the key of a bad value."""
    if cfg.action not in ACTIONS:
        raise ConfigError(f"reward.health.action: unknown '{cfg.action}'; one of {', '.join(ACTIONS)}")
    if cfg.patience < 1:
        raise ConfigError(f"reward.health.patience must be at least 1, got {cfg.patience}")
    for signal, limit in thresholds(cfg).items():
        key = SIGNALS[signal][0]
        if limit is not None and limit < 0:
            raise ConfigError(f"reward.health.{key} must be >= 0 or null, got {limit}")
    if not cfg.answer_components:
        raise ConfigError("reward.health.answer_components must name at least one extra-info key")


def reward_health_metrics(batch: DataProto, cfg: RewardHealthConfig) -> dict[str, float]:
    """The ``reward_health/*`` signals of a scored batch (module docstring)."""
    scores = batch.tensors["token_level_scores"].sum(-1).float()
    lengths = batch.tensors["response_mask"].sum(-1).float()
    metrics: dict[str, float] = {}
    groups = [g for g in reward_groups(batch).values() if len(g) > 1]
    if groups:
        metrics["zero_variance_groups"] = sum(len({round(s, 6) for s in g}) == 1 for g in groups) / len(groups)
    columns = batch.non_tensor_batch
    answer = next((k for k in cfg.answer_components if k in columns), None)
    if cfg.format_component in columns and answer is not None:
        formatted = _floats(columns[cfg.format_component]) > 0
        right = _floats(columns[answer]) > 0
        metrics["format_only"] = float(((scores.numpy() > 0) & formatted & ~right).mean())
    metrics["length_corr"] = _correlation(scores, lengths)
    if "rm_score" in columns and "rule_score" in columns:
        judge, rule = _floats(columns["rm_score"]), _floats(columns["rule_score"])
        metrics["judge_rule_disagreement"] = float(((judge > judge.mean()) != (rule > rule.mean())).mean())
    return {PREFIX + name: value for name, value in metrics.items()}


def _floats(column: np.ndarray) -> np.ndarray:
    return np.asarray([float(v) if v is not None else 0.0 for v in column], dtype=np.float64)


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    if len(a) < 2 or float(a.std()) == 0.0 or float(b.std()) == 0.0:
        return 0.0
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


class RewardHealthWatch:
    """Tracks each signal's run of steps beyond its threshold and raises the alarm (module docstring)."""

    def __init__(self, cfg: RewardHealthConfig) -> None:
        self.cfg = cfg
        self.beyond: dict[str, list[tuple[int, float]]] = {}  # signal -> its current run of (step, value)

    def check(self, step: int, batch: DataProto) -> dict[str, float]:
        """The step's ``reward_health/*`` metrics, ``alarms`` included; warns or raises RewardHealthError."""
        metrics = reward_health_metrics(batch, self.cfg)
        alarms = []
        for signal, limit in thresholds(self.cfg).items():
            value = metrics.get(PREFIX + signal)
            if limit is None or value is None or abs(value) <= limit:
                self.beyond.pop(signal, None)
                continue
            run = self.beyond.setdefault(signal, [])
            run.append((step, value))
            if len(run) >= self.cfg.patience:
                alarms.append(signal)
                if self.cfg.action == "stop":
                    raise RewardHealthError(
                        f"{self._message(signal, run)}. reward.health.action=stop: stopping before training on "
                        "these rewards; the checkpoints written so far are kept"
                    )
                if len(run) % self.cfg.patience == 0:
                    logger.warning("%s", self._message(signal, run))
        metrics[PREFIX + "alarms"] = float(len(alarms))
        return metrics

    def _message(self, signal: str, run: list[tuple[int, float]]) -> str:
        key, meaning = SIGNALS[signal]
        values = ", ".join(f"{v:.2f}" for _, v in run[-self.cfg.patience :])
        return (
            f"reward health: {PREFIX}{signal} beyond reward.health.{key}={thresholds(self.cfg)[signal]} for "
            f"{len(run)} steps in a row (steps {run[0][0]}-{run[-1][0]}; the last {min(len(run), self.cfg.patience)}: "
            f"{values}): {meaning}"
        )
