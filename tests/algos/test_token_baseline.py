"""The optimal-token-baseline estimators (scaletrain/algos/token_baseline.py) on batches worked by hand, the sum of
squared probabilities they read (scaletrain/algos/entropy.py), and the trainer's advantage step handing them
old_log_probs, sum_pi_squared and the rollout IS weights. (A bypass-mode config, which skips the log-prob pass, is
refused: tests/trainer/config/test_ppo_config.py.)"""

import math

import numpy as np
import pytest
import torch

from scaletrain.algos import get_adv_estimator
from scaletrain.algos.entropy import sum_pi_squared_from_logits
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import AlgorithmConfig
from scaletrain.trainer.step.advantage import compute_advantage

OTB, TIR = "optimal_token_baseline", "tir_optimal_token_baseline"
HALF = math.log(0.5)  # pi_t = 0.5: each step's path variance 1 - 2 pi_t + sum pi^2 is sum pi^2 alone


def estimate(name, rewards, mask, index, sum_pi2, **kwargs):
    rewards, mask = torch.tensor(rewards), torch.tensor(mask, dtype=torch.float32)
    old = torch.full_like(rewards, HALF)
    fn = get_adv_estimator(name)
    return fn(rewards, mask, np.array(index), old, torch.tensor(sum_pi2, dtype=torch.float32), **kwargs)


@pytest.mark.parametrize("name", [OTB, TIR])
def test_each_position_gets_the_path_variance_weighted_mean_return(name):
    # W_0 = [1, 2] (sum pi^2 = 1 per step), W_1 = [3, 6]; G_0 = [1, 1], G_1 = [0, 0]
    # B = [(1*1 + 0*3) / (1 + 3), (1*2 + 0*6) / (2 + 6)] = [0.25, 0.25]
    adv, ret = estimate(name, [[0.0, 1.0], [0.0, 0.0]], [[1, 1], [1, 1]], ["a", "a"], [[1.0, 1.0], [3.0, 3.0]])
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75], [-0.25, -0.25]]))
    # rollout IS weights scale each step by rho^2: rho = 2 on the second row makes W_1 = [12, 24], B = 1/13
    weights = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    adv, _ = estimate(
        name,
        [[0.0, 1.0], [0.0, 0.0]],
        [[1, 1], [1, 1]],
        ["a", "a"],
        [[1.0, 1.0], [3.0, 3.0]],
        rollout_is_weights=weights,
    )
    torch.testing.assert_close(adv, torch.tensor([[12 / 13, 12 / 13], [-1 / 13, -1 / 13]]))


@pytest.mark.parametrize("name", [OTB, TIR])
def test_a_lone_response_keeps_its_return_and_a_lone_tail_has_no_baseline(name):
    adv, ret = estimate(name, [[0.0, 2.0]], [[1, 1]], ["solo"], [[0.3, 0.3]])
    torch.testing.assert_close(adv, ret)
    # equal path variance: the baseline is the mean return where both responses run (position 0); past the
    # shorter one, the longer one would be its own baseline (advantage 0) unless handle_zero_tail zeroes it
    rewards, mask, sum_pi2 = [[0.0, 0.0, 3.0], [1.0, 0.0, 0.0]], [[1, 1, 1], [1, 0, 0]], [[1.0] * 3] * 2
    adv, _ = estimate(name, rewards, mask, ["g", "g"], sum_pi2)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 3.0, 3.0], [-1.0, 0.0, 0.0]]))
    adv, _ = estimate(name, rewards, mask, ["g", "g"], sum_pi2, handle_zero_tail=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_the_multi_turn_variant_aligns_turns_by_trained_tokens():
    # row 0: a tool observation (masked) at position 1; row 1 right-padded; sum pi^2 = 1 per trained step
    rewards, mask, sum_pi2 = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], [[1, 0, 1], [1, 1, 0]], [[1.0] * 3] * 2
    # by position: position 2 holds only row 0's second token, which is then its own baseline
    adv, ret = estimate(OTB, rewards, mask, ["g", "g"], sum_pi2)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]))
    # by trained-token count: row 0's second token meets row 1's second, W = [1, 2] both, B = [0.5, 0.5]
    adv, _ = estimate(TIR, rewards, mask, ["g", "g"], sum_pi2)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]))


def test_right_padded_batches_give_both_variants_the_same_advantages():
    gen = torch.Generator().manual_seed(0)
    B, L = 12, 9
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(B, L, generator=gen) * (torch.rand(B, L, generator=gen) > 0.7)
    old = -torch.rand(B, L, generator=gen) * 3
    sum_pi2 = torch.rand(B, L, generator=gen) * 0.5
    index = np.array([i % 4 for i in range(B)])
    weights = torch.rand(B, L, generator=gen) * 2
    a = get_adv_estimator(OTB)(rewards, mask, index, old, sum_pi2, rollout_is_weights=weights)
    b = get_adv_estimator(TIR)(rewards, mask, index, old, sum_pi2, rollout_is_weights=weights)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert float((a[0] * (1 - mask)).abs().sum()) == 0.0 and float(a[0].abs().sum()) > 0


@pytest.mark.parametrize("shape, chunk", [((8, 17), 3), ((3, 5, 32), 1024), ((1, 1024), 1)])
def test_sum_pi_squared_matches_the_squared_softmax(shape, chunk):
    torch.manual_seed(0)
    logits = torch.randn(*shape) * 5.0
    out = sum_pi_squared_from_logits(logits, chunk)
    torch.testing.assert_close(out, torch.softmax(logits, -1).pow(2).sum(-1), atol=1e-6, rtol=1e-5)
    assert out.shape == shape[:-1] and out.dtype == torch.float32 and not out.requires_grad
    extreme = torch.tensor([[1000.0, 1001.0, 999.0], [-1000.0, -999.0, -998.0]], dtype=torch.float64)
    exact = torch.softmax(extreme, -1).pow(2).sum(-1)
    torch.testing.assert_close(sum_pi_squared_from_logits(extreme), exact, atol=1e-12, rtol=1e-12)


def otb_batch(with_weights: bool) -> DataProto:
    gen = torch.Generator().manual_seed(1)
    tensors = {
        "token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5], [0.0, 0.0]]),
        "response_mask": torch.ones(4, 2),
        "old_log_probs": -torch.rand(4, 2, generator=gen),
        "sum_pi_squared": torch.rand(4, 2, generator=gen),
    }
    if with_weights:
        tensors["rollout_is_weights"] = torch.rand(4, 2, generator=gen) + 0.5
    return DataProto.from_dict(tensors, non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})


@pytest.mark.parametrize("with_weights", [False, True])
def test_the_advantage_step_hands_the_estimator_its_inputs(with_weights):
    batch = otb_batch(with_weights)
    compute_advantage(batch, AlgorithmConfig(adv_estimator=OTB))
    t = batch.tensors
    inputs = (t["token_level_rewards"], t["response_mask"], np.array(["a", "a", "b", "b"]), t["old_log_probs"])
    weights = t["rollout_is_weights"] if with_weights else None
    expected = get_adv_estimator(OTB)(*inputs, t["sum_pi_squared"], rollout_is_weights=weights)
    torch.testing.assert_close(t["advantages"], expected[0])
    unweighted = get_adv_estimator(OTB)(*inputs, t["sum_pi_squared"])
    assert torch.equal(t["advantages"], unweighted[0]) != with_weights  # the weights reached it, or there were none
