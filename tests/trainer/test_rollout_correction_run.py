"""The trainer (in-process runs of the CLI's) with algorithm.rollout_correction: rollout_corr/* logged every step, the
IS weights reach the loss, and bypass mode trains against the rollout's log-probs without the old-log-prob forward
(with PPO's clip, or verl's REINFORCE weighted in the loss); the optimal-token-baseline estimator gets the actor's
sum of squared probabilities from the old-log-prob pass and the IS weights.

A top-k rollout (top_k=3) samples from a renormalised distribution, so its log-probs differ from the trainer's
full-softmax ones by a known sign (pi_rollout >= pi_train on every sampled token). Three one-step runs with the same
seed (plain, token-level IS, bypass mode) share the rollout; only the old log-probs and the loss differ. The whole
batch is one mini-batch, so the single update's ``actor/ppo_kl`` is measured at the rollout's weights: ~0 against
recomputed old log-probs, the rollout mismatch (``rollout_corr/kl_k1``) against the rollout's own. The reward is a
hash of the response text, so samples of one prompt differ and GRPO's advantages are not all 0.
"""

import pytest
import torch

from scaletrain.algos import ADV_ESTIMATORS, get_adv_estimator
from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""


def common_overrides(tmp_path) -> list[str]:
    """One step on a top-k rollout, scored by the hash reward, the whole batch one mini-batch, nothing saved."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    return [
        "actor_rollout_ref.rollout.top_k=3",
        "trainer.val_before_train=false",
        "data.val_files=null",
        "trainer.save_freq=-1",
        "trainer.plot_at_end=false",
        "trainer.save_hf_at_end=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"custom_reward_function.path={reward_file}",
    ]


def run(task, run_dir, overrides):
    run_in_process(task, run_dir, 1, overrides)  # the resume test's run, one step
    return metrics(run_dir)[1]


def test_rollout_correction_metrics_and_weights_in_a_run(ray_cluster, task, tmp_path):
    common = common_overrides(tmp_path)
    plain = run(task, tmp_path / "plain", common)
    tis = run(task, tmp_path / "tis", [*common, "algorithm.rollout_correction.rollout_is=token"])
    # the mismatch is measured whether or not it is corrected, and both runs saw the same rollout
    for key in (
        "kl_k1",
        "kl_k3",
        "log_prob_abs_diff_mean",
        "log_prob_abs_diff_max",
        "log_prob_abs_diff_above_threshold_frac",
    ):
        assert plain[f"rollout_corr/{key}"] == pytest.approx(tis[f"rollout_corr/{key}"], rel=1e-6), key
    assert plain["critic/score/mean"] == tis["critic/score/mean"] and plain["critic/advantages/max"] > 0
    assert plain["rollout_corr/kl_k1"] > 0 and plain["rollout_corr/log_prob_abs_diff_above_threshold_frac"] > 0
    assert not any(k.startswith("rollout_corr/is_") for k in plain)
    # pi_train / pi_rollout <= 1 on every token under top-k sampling, so the weights are below 1 and change the loss
    assert 0 < tis["rollout_corr/is_ratio_min"] <= tis["rollout_corr/is_ratio_mean"] < 1
    assert tis["rollout_corr/is_ratio_max"] <= 1 + 1e-5
    assert tis["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], rel=1e-3, abs=1e-6)
    # bypass mode: no old-log-prob forward, no mismatch left to measure, PPO's ratio taken against the rollout
    bypass = run(task, tmp_path / "bypass", [*common, "algorithm.rollout_correction.bypass_mode=true"])
    assert "timing_s/old_log_prob" in plain and "timing_s/old_log_prob" not in bypass
    assert not any(k.startswith("rollout_corr/") for k in bypass)
    assert bypass["critic/score/mean"] == plain["critic/score/mean"]
    assert abs(plain["actor/ppo_kl"]) < 1e-4 < bypass["actor/ppo_kl"]
    assert bypass["actor/ppo_kl"] == pytest.approx(plain["rollout_corr/kl_k1"], rel=0.05)
    # verl's bypass with REINFORCE: the loss weighs each token by pi_theta / pi_rollout, measured in the loss
    reinforce = [
        f"algorithm.rollout_correction.{k}" for k in ("bypass_mode=true", "loss_type=reinforce", "rollout_is=token")
    ]
    corrected = run(task, tmp_path / "reinforce", [*common, *reinforce])
    assert "timing_s/old_log_prob" not in corrected and corrected["critic/score/mean"] == plain["critic/score/mean"]
    assert 0 < corrected["rollout_corr/is_ratio_mean"] < 1  # top-k: pi_theta <= pi_rollout on the sampled tokens
    assert corrected["actor/pg_loss"] != pytest.approx(bypass["actor/pg_loss"], rel=1e-3, abs=1e-6)


def test_the_optimal_token_baseline_reads_the_actors_sum_of_squared_probabilities(
    ray_cluster, task, tmp_path, monkeypatch
):
    """The estimator, wrapped to keep what the trainer hands it, in a one-step run with token-level IS."""
    seen = []
    estimator = get_adv_estimator("optimal_token_baseline")

    def kept(**kwargs):
        seen.append(kwargs)
        return estimator(**kwargs)

    monkeypatch.setitem(ADV_ESTIMATORS, "optimal_token_baseline", kept)
    otb = ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.rollout_is=token"]
    step = run(task, tmp_path / "otb", [*common_overrides(tmp_path), *otb])
    assert len(seen) == 1 and step["critic/advantages/max"] > 0
    got = seen[0]
    mask = got["response_mask"].bool()
    pi2, pi = got["sum_pi_squared"], got["old_log_probs"].exp()
    # a probability distribution's sum of squares: in (0, 1], at least the sampled token's pi^2 (the vocabulary
    # includes it), 0 at padding; 1 - 2 pi + sum pi^2 = |e_token - pi|^2 >= 0
    assert bool((pi2[mask] > 0).all()) and bool((pi2[mask] <= 1 + 1e-5).all()) and float(pi2[~mask].abs().sum()) == 0
    assert bool((pi2[mask] >= pi[mask] ** 2 - 1e-5).all())
    assert bool(((1 - 2 * pi + pi2)[mask] >= -1e-5).all())
    assert float(pi2[mask].std()) > 0  # not a constant
    weights = got["rollout_is_weights"]
    assert weights is not None and weights.shape == mask.shape and 0 < float(weights[mask].mean()) < 1
    assert "index" in got and len(set(got["index"].tolist())) < mask.shape[0]  # prompt groups
    assert not torch.equal(estimator(**{**got, "rollout_is_weights": None})[0], estimator(**got)[0])
