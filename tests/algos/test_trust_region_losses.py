"""DPPO's divergence-masked losses and GMPO's geometric-mean loss (scaletrain/algos/policy_loss_trust_region.py)
against per-token / per-sequence loop references: values, gradients w.r.t. log_prob, clip metrics."""

import math

import pytest
import torch

from tests.algos.test_policy_loss import MODES, assert_close, batch, masked_frac, ref_run, run


def _binary_kl(o, logp):
    p, q = math.exp(logp), math.exp(o)
    return q * (o - logp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


def _tv_kept(o, logp, a, low, high):
    moved = math.exp(logp) - math.exp(o)
    return moved <= high if a > 0 else moved >= -low


def _kl_kept(o, logp, a, low, high):
    kl, up = _binary_kl(o, logp), logp > o
    return (kl <= high or not up) if a > 0 else (kl <= low or logp >= o)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "kept"), [("dppo_tv", _tv_kept), ("dppo_kl", _kl_kept)])
def test_dppo_drops_tokens_past_the_divergence_bound(name, kept, mode):
    old, lp, adv, mask = batch(7, spread=1.5)  # large moves: some tokens cross the bound
    lp = lp.detach().clamp(max=-0.01).requires_grad_(True)  # probabilities below 1
    low, high, cap = 0.05, 0.08, 1.5
    config = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": cap}

    def token_loss(o, logp, a, b, t):
        if not kept(o.item(), logp.item(), a.item(), low, high):
            return 0.0 * logp
        weight = min(math.exp((logp - o).item()), cap)  # truncated, detached
        return -a * weight * logp

    loss, grad, metrics = run(name, old, lp, adv, mask, mode, config)
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, mode)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    rows, cols = mask.shape
    dropped = [
        [not kept(old[b, t].item(), lp[b, t].item(), adv[b, t].item(), low, high) for t in range(cols)]
        for b in range(rows)
    ]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(masked_frac(dropped, mask), abs=1e-6)
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    truncated = [
        [(not dropped[b][t]) and math.exp(lp[b, t].item() - old[b, t].item()) > cap for t in range(cols)]
        for b in range(rows)
    ]
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(masked_frac(truncated, mask), abs=1e-6)


@pytest.mark.parametrize("with_weights", [False, True])
def test_geo_mean_is_a_clipped_geometric_mean_ratio_per_sequence(with_weights):
    old, lp, adv, mask = batch(3, spread=0.6)
    low, high = 0.1, 0.2
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) + 0.5 if with_weights else None
    extra = {"rollout_is_weights": weights} if with_weights else {}
    loss, grad, metrics = run(
        "geo_mean", old, lp, adv, mask, "token-mean", {"clip_ratio_low": low, "clip_ratio_high": high}, **extra
    )

    ref_lp = lp.detach().double().clone().requires_grad_(True)
    seq_losses = []
    for b in range(mask.shape[0]):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        logs = []
        for t in tokens:
            diff = ref_lp[b, t] - old[b, t].double()
            clipped = diff.clamp(-low, high)
            logs.append(torch.minimum(diff, clipped) if adv[b, t] > 0 else torch.maximum(diff, clipped))
        ratio = torch.exp(sum(logs) / len(tokens))
        advantage = sum(adv[b, t].double() for t in tokens) / len(tokens)
        seq = -advantage * ratio
        if with_weights:
            seq = seq * math.exp(sum(math.log(weights[b, t].item()) for t in tokens) / len(tokens))
        seq_losses.append(seq)
    ref = sum(seq_losses) / len(seq_losses)  # a mean over sequences, whatever the aggregation mode
    ref.backward()
    assert_close(loss, ref.detach())
    assert_close(grad, ref_lp.grad)
    clipped_up = ((lp.detach() - old > high) | (lp.detach() - old < -low)) & (adv > 0)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(masked_frac(clipped_up.tolist(), mask), abs=1e-6)
