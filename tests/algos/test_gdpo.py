"""GDPO (scaletrain/algos/group_advantage.py): each reward component normalised within its group on its own, summed
with its weight, whitened over the batch, against a loop reference; the trainer's advantage step hands it the
reward components as verl's does (the batch's columns); a config without the components is refused."""

import numpy as np
import pytest
import torch

from scaletrain.algos import get_adv_estimator
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import AlgorithmConfig
from scaletrain.trainer.rollout.producer import add_reward_columns
from scaletrain.trainer.step.advantage import compute_advantage
from tests.algos.test_advantage import close, outcome_batch, ref_grpo, ref_whiten


def ref_gdpo(components, mask, uids, weights):
    """components: per-row score lists; GRPO of each (as the score on the row's last token), weighted sum, whiten."""
    total = [[0.0] * len(mask[0]) for _ in mask]
    for comp, w in zip(components, weights):
        rewards = [[0.0] * len(mask[0]) for _ in mask]
        for b, row in enumerate(mask):
            rewards[b][max(t for t, m in enumerate(row) if m)] = comp[b]
        adv = ref_grpo(rewards, mask, uids)
        total = [[total[b][t] + w * adv[b][t] for t in range(len(mask[0]))] for b in range(len(mask))]
    return ref_whiten(total, mask)


def test_gdpo_normalises_each_component_in_its_group_then_whitens():
    rewards, mask, uids = outcome_batch(12, singleton=True)
    gen = torch.Generator().manual_seed(3)
    acc = torch.randint(0, 2, (len(uids),), generator=gen).float().tolist()
    fmt = (torch.rand(len(uids), generator=gen) * 0.2).tolist()  # a weak signal GRPO's sum would drown
    columns = {"acc": np.array(acc, dtype=object), "format": np.array(fmt, dtype=object)}
    config = {"gdpo_reward_keys": ["acc", "format"], "gdpo_reward_weights": [1.0, 0.5]}
    fn = get_adv_estimator("gdpo")
    adv, ret = fn(rewards, mask, index=uids, config=config, non_tensor_batch=columns, batch={"unused": None})
    expected = ref_gdpo([acc, fmt], mask.tolist(), list(uids), [1.0, 0.5])
    close(adv, expected)
    close(ret, expected)
    alone, _ = fn(rewards, mask, index=uids)  # no components given: the row's score is the one component
    close(alone, ref_gdpo([rewards.sum(-1).tolist()], mask.tolist(), list(uids), [1.0]))
    with pytest.raises(ValueError, match=r"gdpo reward keys \['length'\] are not in the batch"):
        fn(rewards, mask, index=uids, config={"gdpo_reward_keys": ["length"]}, non_tensor_batch=columns, batch={})


def test_the_trainer_step_hands_gdpo_the_reward_components_as_batch_columns():
    rewards, mask, uids = outcome_batch(13)
    acc = [float(i % 2) for i in range(len(uids))]
    batch = DataProto.from_dict(
        {"token_level_rewards": rewards, "response_mask": mask}, {"uid": np.array(uids, dtype=object)}
    )
    add_reward_columns(batch, {"acc": acc, "uid": ["clobber"] * len(uids), "short": [1.0]})  # as producer.collect
    assert list(batch.non_tensor_batch["uid"]) == list(uids) and "short" not in batch.non_tensor_batch
    compute_advantage(batch, AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["acc"]))
    close(batch.tensors["advantages"], ref_gdpo([acc], mask.tolist(), list(uids), [1.0]))
