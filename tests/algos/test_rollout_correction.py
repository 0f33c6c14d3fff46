"""Rollout correction weights and mismatch metrics against loop references."""

import math

import pytest
import torch

from scaletrain.algos import compute_rollout_correction, get_policy_loss


def batch(seed, B=6, T=8):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for b, n in enumerate(torch.randint(1, T + 1, (B,), generator=gen).tolist()):
        mask[b, :n] = 1
    rollout = -torch.rand(B, T, generator=gen) * 2
    old = rollout + 0.6 * torch.randn(B, T, generator=gen)
    return old, rollout, mask


def valid_cells(mask):
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_token_level(mode):
    old, rollout, mask = batch(0)
    thr = 1.5
    weights, m = compute_rollout_correction(
        old, rollout, mask, rollout_is_threshold=thr, rollout_is_level="token", rollout_is_mode=mode
    )
    cells = valid_cells(mask)
    raw = {bt: math.exp(old[bt].item() - rollout[bt].item()) for bt in cells}
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if (b, t) not in raw:
                assert weights[b, t] == 0
            elif mode == "truncate":
                assert weights[b, t].item() == pytest.approx(min(raw[(b, t)], thr), rel=1e-5)
            else:
                inside = 1 / thr <= raw[(b, t)] <= thr
                assert weights[b, t].item() == pytest.approx(raw[(b, t)] if inside else 0.0, rel=1e-5)
    assert m["rollout_corr/is_ratio_mean"] == pytest.approx(sum(raw.values()) / len(raw), rel=1e-5)
    assert m["rollout_corr/is_ratio_max"] == pytest.approx(max(raw.values()), rel=1e-5)
    assert m["rollout_corr/is_ratio_min"] == pytest.approx(min(raw.values()), rel=1e-5)
    if mode == "truncate":
        frac = sum(v > thr for v in raw.values()) / len(raw)
        assert m["rollout_corr/is_truncated_frac"] == pytest.approx(frac) and 0 < frac < 1
    else:
        frac = sum(not (1 / thr <= v <= thr) for v in raw.values()) / len(raw)
        assert m["rollout_corr/is_masked_frac"] == pytest.approx(frac) and 0 < frac < 1
    final = [weights[bt].item() for bt in cells]
    assert m["rollout_corr/is_ess"] == pytest.approx(
        sum(final) ** 2 / (len(final) * sum(w * w for w in final)), rel=1e-5
    )
    assert not weights.requires_grad


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level(mode):
    old, rollout, mask = batch(1)
    old = rollout + 0.3 * (old - rollout)  # keep sequence products in a sensible range
    thr, lower = 2.0, 0.6
    weights, m = compute_rollout_correction(
        old,
        rollout,
        mask,
        rollout_is_threshold=thr,
        rollout_is_level="sequence",
        rollout_is_mode=mode,
        rollout_is_threshold_lower=lower,
    )
    seq = []
    for b in range(mask.shape[0]):
        s = math.exp(sum(old[b, t].item() - rollout[b, t].item() for t in range(mask.shape[1]) if mask[b, t]))
        seq.append(s)
        expected = min(s, thr) if mode == "truncate" else (s if lower <= s <= thr else 0.0)
        for t in range(mask.shape[1]):
            assert weights[b, t].item() == pytest.approx(expected if mask[b, t] else 0.0, rel=1e-5)
    assert m["rollout_corr/is_ratio_mean"] == pytest.approx(sum(seq) / len(seq), rel=1e-5)
    assert m["rollout_corr/is_ratio_max"] == pytest.approx(max(seq), rel=1e-5)
    key = "rollout_corr/is_truncated_frac" if mode == "truncate" else "rollout_corr/is_masked_frac"
    cut = [s > thr for s in seq] if mode == "truncate" else [not (lower <= s <= thr) for s in seq]
    assert m[key] == pytest.approx(sum(cut) / len(cut))


def test_mismatch_metrics():
    old, rollout, mask = batch(2)
    _, m = compute_rollout_correction(old, rollout, mask)
    cells = valid_cells(mask)
    k1 = sum(rollout[bt].item() - old[bt].item() for bt in cells) / len(cells)
    k3 = sum(
        math.exp(old[bt].item() - rollout[bt].item()) - 1 - (old[bt].item() - rollout[bt].item()) for bt in cells
    ) / len(cells)
    assert m["rollout_corr/kl_k1"] == pytest.approx(k1, abs=1e-6)
    assert m["rollout_corr/kl_k3"] == pytest.approx(k3, rel=1e-5)
    train, roll = [], []
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t]]
        train.append(math.exp(-sum(old[b, t].item() for t in ts) / len(ts)))
        roll.append(math.exp(-sum(rollout[b, t].item() for t in ts) / len(ts)))
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(train) / len(train), rel=1e-5)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(sum(roll) / len(roll), rel=1e-5)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(a / b for a, b in zip(train, roll)) / len(train), rel=1e-5)


def test_identical_policies_give_unit_weights_and_bad_arguments():
    old, _, mask = batch(3)
    weights, m = compute_rollout_correction(old, old.clone(), mask)
    torch.testing.assert_close(weights, mask)
    assert m["rollout_corr/kl_k1"] == 0 and m["rollout_corr/is_ess"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="batch"):
        compute_rollout_correction(old, old, mask, rollout_is_level="batch")
    with pytest.raises(ValueError, match="clip"):
        compute_rollout_correction(old, old, mask, rollout_is_mode="clip")


def test_weights_feed_a_policy_loss():
    old, rollout, mask = batch(4)
    weights, _ = compute_rollout_correction(old, rollout, mask, rollout_is_threshold=2.0)
    log_prob = old.clone().requires_grad_(True)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(9))
    loss, _ = get_policy_loss("vanilla")(old, log_prob, adv, mask, "token-mean", None, rollout_is_weights=weights)
    loss.backward()
    # on-policy ratio 1: gradient is -A * w / #tokens
    torch.testing.assert_close(log_prob.grad, -adv * weights / mask.sum())
