"""The porting guide's examples (docs/porting.md): a custom advantage estimator and a custom policy loss written
for verl, unedited but for their import lines, registered through ``scaletrain.compat.verl`` and run by
scaletrain's own trainer step and actor loss."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from scaletrain.algos import ADV_ESTIMATORS, POLICY_LOSSES
from scaletrain.compat.verl.trainer.ppo.core_algos import agg_loss, register_adv_est, register_policy_loss
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import AlgorithmConfig
from scaletrain.trainer.step.advantage import compute_advantage
from scaletrain.workers.config import ActorConfig, PolicyLossConfig
from scaletrain.workers.losses import actor_loss_fn

# --- a verl user's file, unedited but for its import line above (verl's: from verl.trainer.ppo.core_algos import
# agg_loss, register_adv_est, register_policy_loss) ---


@register_adv_est("porting_example_max_baseline")
def compute_max_baseline_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """Score minus the best score of the other responses to the same prompt (verl's argument order)."""
    scores = token_level_rewards.sum(dim=-1)
    by_prompt = defaultdict(list)
    for i in range(scores.shape[0]):
        by_prompt[index[i]].append(i)
    adv = torch.zeros_like(scores)
    for rows in by_prompt.values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            adv[i] = scores[i] - (max(others) if others else 0.0)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_policy_loss("porting_example_plain_pg")
def compute_policy_loss_plain(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """REINFORCE with importance ratio; no clip (a loss in verl 0.9's shape: no **kwargs)."""
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses = -advantages * ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    return pg_loss, {"actor/mean_ratio": (ratio * response_mask).sum().item() / response_mask.sum().item()}


# --- end of the user's file ---


@pytest.fixture(scope="module", autouse=True)
def _unregister():
    yield
    del ADV_ESTIMATORS["porting_example_max_baseline"]
    del POLICY_LOSSES["porting_example_plain_pg"]


def test_a_verl_estimator_runs_in_scaletrains_trainer_step():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    uid = np.array(["a", "a", "b", "b"], dtype=object)
    batch = DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask}, {"uid": uid})
    compute_advantage(batch, AlgorithmConfig(adv_estimator="porting_example_max_baseline"))
    expected = torch.tensor([1.0, -1.0, -1.5, 1.5])[:, None] * mask
    torch.testing.assert_close(batch.batch["advantages"], expected)


def test_a_verl_policy_loss_runs_in_scaletrains_actor_loss():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen) - 0.1
    new = old + 0.2 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    mb = DataProto.from_dict(
        {
            "old_log_probs": old,
            "advantages": adv,
            "response_mask": mask,
            "token_level_rewards": torch.zeros(3, 5),  # scaletrain hands it to losses that take it; this one doesn't
        }
    )
    config = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="porting_example_plain_pg"))
    loss, metrics = actor_loss_fn(config)({"log_probs": new}, mb)
    expected = (-(adv * torch.exp(new - old)) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    assert metrics["actor/mean_ratio"] > 0
