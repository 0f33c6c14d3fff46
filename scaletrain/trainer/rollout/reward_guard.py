"""RewardGuard: stops a run whose reward function keeps failing (layer 4).

A scorer that raises or times out gives 0 for the sample (reward/manager base), which keeps one bad sample from
killing a run, but a scorer that fails on most samples step after step trains the policy on zeros. The guard
watches each step's share of failed samples (errors + timeouts, from the manager's metrics) and raises
``RewardFailureError`` once more than ``reward_model.max_error_rate`` of the samples failed in
``reward_model.max_error_steps`` consecutive steps, naming the scorer and its last traceback. It raises before the
step trains, so the checkpoints written so far are the run's last good state.
"""

from __future__ import annotations

from collections.abc import Callable


class RewardFailureError(RuntimeError):
    """The reward function failed on too many samples for too many steps in a row."""


class RewardGuard:
    def __init__(
        self, max_error_rate: float, max_error_steps: int, scorer: str, last_error: Callable[[], str | None]
    ) -> None:
        self.max_error_rate, self.max_error_steps = max_error_rate, max_error_steps
        self.scorer, self.last_error = scorer, last_error
        self.step: int | None = None
        self.failed = self.total = 0
        self.bad_rates: list[float] = []  # failure shares of the consecutive bad steps before ``step``

    def observe(self, step: int, metrics: dict[str, float], samples: int) -> None:
        """Count one scored batch of ``step`` (a step may score several: dynamic sampling); raises
        RewardFailureError when this step makes ``max_error_steps`` bad steps in a row."""
        if "reward/errors" not in metrics:  # not a rule manager's metrics (the reward model's score alone)
            return
        if step != self.step:
            if self.step is not None:
                done = self._rate()
                self.bad_rates = self.bad_rates + [done] if done > self.max_error_rate else []
            self.step, self.failed, self.total = step, 0, 0
        self.failed += int(metrics["reward/errors"] + metrics.get("reward/timeouts", 0))
        self.total += samples
        rate = self._rate()
        if rate > self.max_error_rate and len(self.bad_rates) + 1 >= self.max_error_steps:
            rates = ", ".join(f"{100 * r:.0f}%" for r in [*self.bad_rates, rate][-self.max_error_steps :])
            raise RewardFailureError(
                f"the reward function {self.scorer} failed on more than {100 * self.max_error_rate:g}% of the samples "
                f"for {self.max_error_steps} steps in a row (up to step {step}: {rates}); stopping before training "
                "on those rewards (reward_model.max_error_rate / max_error_steps). The checkpoints written so far are "
                f"kept. Its last error:\n{self.last_error() or '(none recorded)'}"
            )

    def _rate(self) -> float:
        """The share of this step's samples that failed so far."""
        return self.failed / self.total if self.total else 0.0
