"""Advantage estimators against slow loop references (verl's recursions written row by row, step by step)."""

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scaletrain.algos import AdvantageEstimator, get_adv_estimator, register_adv_est


def ragged_mask(B, T, gen, holes=False):
    mask = torch.zeros(B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    for b in range(B):
        mask[b, : lengths[b]] = 1
        if holes and lengths[b] > 2:  # tool-observation style gaps inside the response
            for t in range(1, int(lengths[b]) - 1):
                if torch.rand((), generator=gen) < 0.3:
                    mask[b, t] = 0
    return mask


def ref_whiten(x, mask):
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[0])) if mask[b][t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [
        [(x[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(len(x[0]))]
        for b in range(len(x))
    ]


def ref_gae(rewards, values, mask, gamma, lam):
    """verl's GAE recursion: masked steps carry the next value and the running advantage over unchanged."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value, running = 0.0, 0.0
        for t in reversed(range(T)):
            if not mask[b][t]:
                continue
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            next_value = values[b][t]
            adv[b][t] = running
    returns = [[(adv[b][t] + values[b][t]) if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return ref_whiten(adv, mask), returns


def ref_reinforce_pp(rewards, mask, gamma):
    """verl 0.9's REINFORCE++ return: masked positions (observations) are skipped, the running return carries
    across them unchanged."""
    B, T = len(rewards), len(rewards[0])
    returns = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if mask[b][t]:
                running = rewards[b][t] + gamma * running
                returns[b][t] = running
    return ref_whiten(returns, mask), returns


def groups_of(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def row_scores(rewards):
    return [sum(r) for r in rewards]


def broadcast(per_row, mask):
    return [[per_row[b] if mask[b][t] else 0.0 for t in range(len(mask[0]))] for b in range(len(mask))]


def ref_grpo(rewards, mask, index, norm=True, eps=1e-6):
    s = row_scores(rewards)
    out = [0.0] * len(s)
    for rows in groups_of(index).values():
        vals = [s[i] for i in rows]
        mean, std = (0.0, 1.0) if len(rows) == 1 else (sum(vals) / len(vals), statistics.stdev(vals))
        for i in rows:
            out[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    return broadcast(out, mask)


def ref_rloo(rewards, mask, index):
    s = row_scores(rewards)
    out = list(s)
    for rows in groups_of(index).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            if others:
                out[i] = s[i] - sum(others) / len(others)
    return broadcast(out, mask)


def ref_passk(rewards, mask, index, norm=True, eps=1e-6):
    s = row_scores(rewards)
    out = [0.0] * len(s)
    for rows in groups_of(index).values():
        vals = sorted((s[i] for i in rows), reverse=True)
        best_row = max(rows, key=lambda i: s[i])
        adv = vals[0] - vals[1]
        out[best_row] = adv / (statistics.stdev(vals) + eps) if norm else adv
    return broadcast(out, mask)


def ref_opo(rewards, mask, index):
    s = row_scores(rewards)
    lengths = [sum(m) for m in mask]
    out = list(s)
    for rows in groups_of(index).values():
        if len(rows) > 1:
            base = sum(lengths[i] * s[i] for i in rows) / sum(lengths[i] for i in rows)
            for i in rows:
                out[i] = s[i] - base
    return broadcast(out, mask)


def ref_gpg(rewards, mask, index, f_norm=1.0):
    s = row_scores(rewards)
    alpha = len(s) / max(1, sum(1 for v in s if v != 0))
    out = [0.0] * len(s)
    for rows in groups_of(index).values():
        mean = 0.0 if len(rows) == 1 else sum(s[i] for i in rows) / len(rows)
        for i in rows:
            out[i] = alpha * (s[i] - mean) / f_norm
    return broadcast(out, mask)


def ref_rpp_baseline(rewards, mask, index):
    s = row_scores(rewards)
    centred = [0.0] * len(s)
    for rows in groups_of(index).values():
        mean = 0.0 if len(rows) == 1 else sum(s[i] for i in rows) / len(rows)
        for i in rows:
            centred[i] = s[i] - mean
    return ref_whiten(broadcast(centred, mask), mask)


def ref_remax(rewards, mask, baselines):
    B, T = len(rewards), len(rewards[0])
    returns = [
        [sum(rewards[b][s] for s in range(t, T) if mask[b][s]) if mask[b][t] else 0.0 for t in range(T)]
        for b in range(B)
    ]
    adv = [[returns[b][t] - baselines[b] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, returns


def close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-4)


def outcome_batch(seed, n_groups=4, n=4, T=6, singleton=False, binary=False):
    gen = torch.Generator().manual_seed(seed)
    B = n_groups * n + (1 if singleton else 0)
    mask = ragged_mask(B, T, gen)
    rewards = torch.zeros(B, T)
    last = mask.sum(-1).long() - 1
    score = torch.randint(0, 2, (B,), generator=gen).float() if binary else torch.randn(B, generator=gen)
    rewards[torch.arange(B), last] = score
    uids = np.array(
        [f"p{g}" for g in range(n_groups) for _ in range(n)] + (["solo"] if singleton else []), dtype=object
    )
    perm = torch.randperm(B, generator=gen)  # groups need not be contiguous
    return rewards[perm], mask[perm], uids[perm.numpy()]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop(holes, gamma, lam):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 12
    mask = ragged_mask(B, T, gen, holes=holes)
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    adv, ret = get_adv_estimator("gae")(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_long_sequence_is_stable():
    gen = torch.Generator().manual_seed(1)
    T = 2048
    mask = torch.ones(2, T)
    mask[1, 1500:] = 0
    rewards, values = torch.randn(2, T, generator=gen) * 0.1, torch.randn(2, T, generator=gen)
    for gamma, lam in [(1.0, 1.0), (0.999, 0.95)]:
        adv, ret = get_adv_estimator("gae")(rewards, values, mask, gamma, lam)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        close(adv, ref_adv, atol=2e-4)
        close(ret, ref_ret, atol=2e-4)


def test_gae_config_object_dict_and_kwarg_override():
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask(4, 8, gen)
    rewards, values = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    fn = get_adv_estimator(AdvantageEstimator.GAE)
    from_obj = fn(rewards, values, mask, config=SimpleNamespace(gamma=0.9, lam=0.8))
    from_dict = fn(rewards, values, mask, config={"gamma": 0.9, "lam": 0.8})
    overridden = fn(rewards, values, mask, config={"gamma": 0.5, "lam": 0.8}, gamma=0.9)
    ref_adv, _ = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    for adv, _ in (from_obj, from_dict, overridden):
        close(adv, ref_adv)
    with pytest.raises(TypeError, match="response_mask"):  # verl's order: (rewards, values, response_mask)
        fn(rewards, mask)


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_loop(holes):
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(6, 10, gen, holes=holes)
    rewards = torch.randn(6, 10, generator=gen)
    adv, ret = get_adv_estimator("reinforce_plus_plus")(rewards, mask, config={"gamma": 0.95})
    ref_adv, ref_ret = ref_reinforce_pp(rewards.tolist(), mask.tolist(), 0.95)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_remax_matches_loop():
    gen = torch.Generator().manual_seed(4)
    mask = ragged_mask(5, 7, gen, holes=True)
    rewards, baselines = torch.randn(5, 7, generator=gen), torch.randn(5, generator=gen)
    adv, ret = get_adv_estimator("remax")(rewards, baselines, mask)
    ref_adv, ref_ret = ref_remax(rewards.tolist(), mask.tolist(), baselines.tolist())
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop_with_singleton_group(norm):
    rewards, mask, uids = outcome_batch(5, singleton=True)
    adv, ret = get_adv_estimator("grpo")(rewards, mask, index=uids, config={"norm_adv_by_std_in_grpo": norm})
    expected = ref_grpo(rewards.tolist(), mask.tolist(), list(uids), norm=norm)
    close(adv, expected)
    close(ret, expected)
    solo = list(uids).index("solo")  # singleton: mean 0, std 1 -> raw score (over 1 + eps)
    expect_solo = rewards[solo].sum() / (1 + 1e-6) if norm else rewards[solo].sum()
    assert adv[solo][mask[solo].bool()].allclose(expect_solo.expand(int(mask[solo].sum())))


def test_grpo_kwarg_overrides_config_and_index_types():
    rewards, mask, uids = outcome_batch(6)
    fn = get_adv_estimator("grpo")
    dr_grpo, _ = fn(rewards, mask, index=uids, config={"norm_adv_by_std_in_grpo": True}, norm_adv_by_std_in_grpo=False)
    close(dr_grpo, ref_grpo(rewards.tolist(), mask.tolist(), list(uids), norm=False))
    as_ints = torch.tensor([int(u[1:]) for u in uids])
    by_tensor, _ = fn(rewards, mask, index=as_ints)
    by_list, _ = fn(rewards, mask, index=[str(u) for u in uids])
    close(by_tensor, ref_grpo(rewards.tolist(), mask.tolist(), list(uids)))
    torch.testing.assert_close(by_tensor, by_list)


def test_grpo_passk_matches_loop():
    rewards, mask, uids = outcome_batch(7)
    for norm in (True, False):
        adv, _ = get_adv_estimator("grpo_passk")(rewards, mask, index=uids, norm_adv_by_std_in_grpo=norm)
        close(adv, ref_passk(rewards.tolist(), mask.tolist(), list(uids), norm=norm))
    # ties for the best score: zero advantage for everyone
    tied_rewards = torch.zeros_like(rewards)
    tied_rewards[:, 0] = 1.0
    adv, _ = get_adv_estimator("grpo_passk")(tied_rewards, mask, index=uids)
    assert adv.abs().max() == 0
    rewards1, mask1, uids1 = outcome_batch(9, singleton=True)
    with pytest.raises(ValueError, match="at least 2"):
        get_adv_estimator("grpo_passk")(rewards1, mask1, index=uids1)


@pytest.mark.parametrize("name,ref", [("rloo", ref_rloo), ("opo", ref_opo), ("gpg", ref_gpg)])
def test_group_estimators_match_loop(name, ref):
    rewards, mask, uids = outcome_batch(10, singleton=True, binary=(name == "gpg"))
    adv, ret = get_adv_estimator(name)(rewards, mask, index=uids)
    expected = ref(rewards.tolist(), mask.tolist(), list(uids))
    close(adv, expected)
    close(ret, expected)


def test_gpg_f_norm_and_reinforce_pp_baseline():
    rewards, mask, uids = outcome_batch(11, binary=True)
    adv, _ = get_adv_estimator("gpg")(rewards, mask, index=uids, config={"f_norm": 2.0})
    close(adv, ref_gpg(rewards.tolist(), mask.tolist(), list(uids), f_norm=2.0))
    rewards, mask, uids = outcome_batch(12, singleton=True)
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(rewards, mask, index=uids)
    close(adv, ref_rpp_baseline(rewards.tolist(), mask.tolist(), list(uids)))


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError) as err:
        get_adv_estimator("no_such_estimator")
    for name in AdvantageEstimator:
        assert name.value in str(err.value)


def test_custom_estimator_registration():
    @register_adv_est("test_only_constant", override=True)
    def constant(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        return response_mask * 2.0, response_mask * 3.0

    adv, ret = get_adv_estimator("test_only_constant")(torch.zeros(2, 3), torch.ones(2, 3))
    assert adv.eq(2).all() and ret.eq(3).all()
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("test_only_constant")(lambda *a, **k: None)


def test_all_singleton_groups_warn(caplog):
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    with caplog.at_level("WARNING", logger="scaletrain.algos.group_advantage"):
        adv, _ = get_adv_estimator("grpo")(rewards, torch.ones(2, 2), index=np.array(["a", "b"]))
    assert "single response" in caplog.text
    close(adv, [[1 / (1 + 1e-6)] * 2, [2 / (1 + 1e-6)] * 2])
