"""Reward health (scaletrain/trainer/step/reward_health.py): each ``reward_health/*`` signal on batches built to show
it, the alarm (a warning repeated while it lasts, or a stop naming the signal, its key and the steps) and its reset,
the config refusals, and a CLI run whose reward is gamed stopping before it trains on it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import RewardHealthConfig
from scaletrain.trainer.step.reward_health import RewardHealthError, RewardHealthWatch, reward_health_metrics


def scored(scores, lengths, uids=None, **columns) -> DataProto:
    """Rows with a sequence reward each (on its last response token) and a response of ``lengths`` tokens."""
    R = max(lengths)
    mask = (torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]).long()
    token_scores = torch.zeros(len(scores), R)
    token_scores[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float)
    non_tensors = {k: np.array(v, dtype=object) for k, v in columns.items()}
    if uids is not None:
        non_tensors["uid"] = np.array(uids, dtype=object)
    return DataProto.from_dict({"token_level_scores": token_scores, "response_mask": mask}, non_tensors=non_tensors)


def test_each_signal_on_a_batch_that_shows_it():
    cfg = RewardHealthConfig()
    # two groups of two: one flat (both 1.0), one mixed; a single-sample group does not count
    flat = scored([1.0, 1.0, 0.0, 1.0, 0.5], [2, 3, 2, 3, 1], uids=["a", "a", "b", "b", "c"])
    assert reward_health_metrics(flat, cfg)["reward_health/zero_variance_groups"] == 0.5
    # rewarded for format, the answer wrong: rows 0 and 2 (row 1 is right, row 3 unrewarded)
    gamed = scored([0.2, 1.0, 0.2, 0.0], [1, 1, 1, 1], format=[1.0, 1.0, 1.0, 0.0], correctness=[0.0, 1.0, 0.0, 0.0])
    assert reward_health_metrics(gamed, cfg)["reward_health/format_only"] == 0.5
    assert "reward_health/format_only" not in reward_health_metrics(scored([1.0], [1], format=[1.0]), cfg)
    longer_is_better = scored([0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4])
    assert reward_health_metrics(longer_is_better, cfg)["reward_health/length_corr"] == pytest.approx(1.0)
    assert reward_health_metrics(scored([1.0, 1.0], [1, 2]), cfg)["reward_health/length_corr"] == 0.0  # constant
    both = scored([0, 0, 0, 0], [1, 1, 1, 1], rm_score=[2.0, -1.0, 0.5, -3.0], rule_score=[1.0, 1.0, 0.0, 0.0])
    # verdicts (above the source's mean): judge [T, F, T, F], rule [T, T, F, F]: rows 1 and 2 differ
    assert reward_health_metrics(both, cfg)["reward_health/judge_rule_disagreement"] == 0.5


def test_a_sustained_signal_warns_every_patience_steps_and_a_recovery_resets_it(caplog):
    watch = RewardHealthWatch(RewardHealthConfig(max_zero_variance_groups=0.5, patience=2))
    flat, mixed = scored([1.0, 1.0], [1, 1], uids=["a", "a"]), scored([1.0, 0.0], [1, 1], uids=["a", "a"])
    with caplog.at_level(logging.WARNING, logger="scaletrain.trainer.step.reward_health"):
        assert watch.check(1, flat)["reward_health/alarms"] == 0.0
        assert watch.check(2, flat)["reward_health/alarms"] == 1.0
        watch.check(3, flat)
        watch.check(4, flat)
        watch.check(5, mixed)  # recovered: the run starts over
        watch.check(6, flat)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # at steps 2 and 4, none after the recovery
    assert "reward_health/zero_variance_groups beyond reward.health.max_zero_variance_groups=0.5" in warnings[0]
    assert "steps 1-2" in warnings[0] and "steps 1-4" in warnings[1] and "the reward signal is flat" in warnings[0]


def test_stop_raises_naming_the_signal_and_the_steps_and_null_never_alarms():
    watch = RewardHealthWatch(RewardHealthConfig(max_length_corr=0.9, patience=3, action="stop"))
    longer = scored([0.1, 0.2, 0.3], [1, 2, 3])
    watch.check(4, longer)
    watch.check(5, longer)
    with pytest.raises(RewardHealthError, match=r"length_corr beyond reward.health.max_length_corr=0.9 .*steps 4-6"):
        watch.check(6, longer)
    quiet = RewardHealthWatch(RewardHealthConfig(max_zero_variance_groups=None, patience=1, action="stop"))
    assert quiet.check(1, scored([1.0, 1.0], [1, 1], uids=["a", "a"]))["reward_health/zero_variance_groups"] == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.health.action=halt", r"reward.health.action: unknown 'halt'; one of warn, stop"),
        ("reward.health.patience=0", r"reward.health.patience must be at least 1"),
        ("reward.health.max_format_only=-0.1", r"reward.health.max_format_only must be >= 0 or null"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(task, tmp_path, override, message):
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    with pytest.raises(ConfigError, match=message):
        checked(*ppo_overrides(task, tmp_path / "run", 2, [override]))


GAMED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "format": 1.0, "acc": 0.0}  # every answer rewarded for its form, none right
"""


@pytest.mark.slow
def test_a_run_rewarding_format_over_answers_stops_before_training_on_it(ray_cluster, task, tmp_path):
    from tests.trainer.runs import metrics, run_in_process

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(GAMED_REWARD)
    overrides = [f"custom_reward_function.path={reward_file}", "reward.health.patience=2", "reward.health.action=stop"]
    overrides += ["reward.health.max_zero_variance_groups=null", "trainer.save_freq=-1", "trainer.test_freq=-1"]
    overrides.append("trainer.val_before_train=false")
    with pytest.raises(RewardHealthError, match=r"format_only beyond reward.health.max_format_only=0.5 .*steps 1-2"):
        run_in_process(task, tmp_path / "run", 3, overrides)
    logged = metrics(tmp_path / "run")
    assert sorted(logged) == [1], "step 2 must stop before it trains and logs"
    assert logged[1]["reward_health/format_only"] == 1.0 and logged[1]["reward_health/zero_variance_groups"] == 1.0
    assert logged[1]["reward_health/length_corr"] == 0.0 and logged[1]["reward_health/alarms"] == 0.0
