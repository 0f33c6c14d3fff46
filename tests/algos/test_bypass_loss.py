"""verl's ``bypass_mode`` policy loss (scaletrain/algos/policy_loss_bypass.py) against references: REINFORCE with
the importance weights pi_theta / pi_rollout (per token or per sequence, truncated, detached), PPO against the
rollout with the rejected tokens left out, and the refusal of a call without its settings."""

import math

import pytest
import torch

from scaletrain.algos import get_policy_loss
from tests.algos.test_policy_loss import assert_close, batch, ref_run, run


def settings(**kw):
    return {"policy_loss": {"rollout_correction": {"loss_type": "reinforce", **kw}}}


def test_reinforce_with_token_weights_truncated_and_detached():
    rollout, lp, adv, mask = batch(21, spread=0.8)
    threshold = 1.5

    def token_loss(o, logp, a, b, t):
        w = min(math.exp((logp - o).item()), threshold)  # a constant: no gradient through it
        return -a * w * logp

    loss, grad, metrics = run(
        "bypass_mode",
        rollout,
        lp,
        adv,
        mask,
        "token-mean",
        settings(rollout_is="token", rollout_is_threshold=threshold),
    )
    ref_loss, ref_grad = ref_run(token_loss, rollout, lp, adv, mask, "token-mean")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert 0 < metrics["rollout_corr/is_truncated_frac"] < 1


def test_reinforce_with_sequence_weights():
    rollout, lp, adv, mask = batch(22, spread=0.3)
    seq_w = [min(math.exp(((lp[b] - rollout[b]) * mask[b]).sum().item()), 2.0) for b in range(mask.shape[0])]

    def token_loss(o, logp, a, b, t):
        return -a * seq_w[b] * logp

    loss, grad, _ = run("bypass_mode", rollout, lp, adv, mask, "seq-mean-token-sum", settings(rollout_is="sequence"))
    ref_loss, ref_grad = ref_run(token_loss, rollout, lp, adv, mask, "seq-mean-token-sum")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


def test_ppo_clip_against_the_rollout_leaves_rejected_tokens_out():
    rollout, lp, adv, mask = batch(23, spread=0.6)
    config = {
        "clip_ratio": 0.2,
        "policy_loss": {
            "rollout_correction": {"loss_type": "ppo_clip", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.4"}
        },
    }
    loss, grad, metrics = run("bypass_mode", rollout, lp, adv, mask, "token-mean", config)
    ratio = torch.exp(lp.detach() - rollout)
    kept = mask * ((ratio >= 0.7) & (ratio <= 1.4)).float()
    assert 0 < kept.sum() < mask.sum()
    ref_loss, ref_grad, _ = run("vanilla", rollout, lp, adv, kept, "token-mean", {"clip_ratio": 0.2})
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["rollout_corr/is_masked_frac"] == pytest.approx(1 - float(kept.sum() / mask.sum()), abs=1e-6)


def test_without_its_settings_the_loss_says_where_they_come_from():
    rollout, lp, adv, mask = batch(24)
    with pytest.raises(ValueError, match="set algorithm.rollout_correction.bypass_mode=true"):
        get_policy_loss("bypass_mode")(rollout, lp, adv, mask, "token-mean", {"policy_loss": {}})
