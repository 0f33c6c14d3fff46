"""Loss aggregation modes, KL estimators (incl. straight-through '+' variants), KL controllers, the in-reward
KL penalty, the KL loss term and the clipped value loss, against loop references."""

import math

import pytest
import torch

from scaletrain.algos import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty_to_rewards,
    build_kl_controller,
    compute_kl_loss,
    compute_value_loss,
    kl_penalty,
)


def ragged(seed, B=5, T=6, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for b, n in enumerate(torch.randint(1, T + 1, (B,), generator=gen).tolist()):
        mask[b, :n] = 1
    if empty_row:
        mask[-1] = 0
    return gen, mask


def ref_agg(x, mask, mode):
    B, T = mask.shape
    rows = [[x[b, t].item() for t in range(T) if mask[b, t]] for b in range(B)]
    flat = [v for r in rows for v in r]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum-norm":  # verl: over sequences with a token, then / the padded length
        return sum(sum(r) for r in nonempty) / (len(nonempty) * T)
    raise AssertionError(mode)


@pytest.mark.parametrize("empty_row", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_modes(mode, empty_row):
    gen, mask = ragged(0, empty_row=empty_row)
    x = torch.randn(5, 6, generator=gen)
    assert agg_loss(x, mask, mode).item() == pytest.approx(ref_agg(x, mask, mode), abs=1e-6)


def test_agg_modes_differ_and_unknown_mode():
    gen, mask = ragged(1)
    x = torch.randn(5, 6, generator=gen)
    values = {m: agg_loss(x, mask, m).item() for m in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]}
    assert len(set(round(v, 6) for v in values.values())) == 3
    rows = sum(bool(mask[b].any()) for b in range(5))
    assert agg_loss(x, mask, "seq-mean-token-sum-norm", loss_scale_factor=3).item() == pytest.approx(
        sum(x[b, t].item() for b in range(5) for t in range(6) if mask[b, t]) / (rows * 3), abs=1e-6
    )
    assert agg_loss(x, mask, "token-sum").item() == pytest.approx(float((x * mask).sum()), abs=1e-5)
    with pytest.raises(ValueError, match="seq-sum-bogus"):
        agg_loss(x, mask, "seq-sum-bogus")
    assert agg_loss(x, torch.zeros_like(mask), "token-mean").item() == 0.0


def ref_kl(lp, ref, name):
    d = lp - ref
    if name in ("k1", "kl"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("k2", "mse"):
        return 0.5 * d * d
    if name in ("k3", "low_var_kl"):
        return max(-10.0, min(10.0, math.exp(ref - lp) - (ref - lp) - 1))
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators(name):
    gen = torch.Generator().manual_seed(2)
    lp = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    ref = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    lp[0, 0], ref[0, 0] = -15.0, 0.0  # k3 clamp at 10
    out = kl_penalty(lp, ref, name)
    expected = torch.tensor(
        [[ref_kl(lp[b, t].item(), ref[b, t].item(), name) for t in range(5)] for b in range(4)], dtype=torch.float64
    )
    torch.testing.assert_close(out, expected)
    if name in ("k3", "low_var_kl"):
        assert out[0, 0].item() == 10.0


@pytest.mark.parametrize("base", ["k1", "abs", "k3", "low_var_kl", "mse"])
def test_plus_variants_value_of_base_gradient_of_k2(base):
    gen = torch.Generator().manual_seed(3)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    weights = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    out = kl_penalty(lp, ref, base + "+")
    torch.testing.assert_close(out.detach(), kl_penalty(lp.detach(), ref, base))
    (out * weights).sum().backward()
    torch.testing.assert_close(lp.grad, weights * (lp.detach() - ref))  # d/dlp of (lp - ref)^2 / 2
    if base != "mse":  # the plain estimator has a different gradient
        lp2 = lp.detach().clone().requires_grad_(True)
        (kl_penalty(lp2, ref, base) * weights).sum().backward()
        assert not torch.allclose(lp2.grad, lp.grad)


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="k7"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k7")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=1000)
    expected = 0.1
    for kl, n in [(0.6, 64), (5.0, 64), (0.0, 128), (0.5, 32)]:
        ctrl.update(current_kl=kl, n_steps=n)
        error = min(max(kl / 0.5 - 1, -0.2), 0.2)
        expected *= 1 + error * n / 1000
        assert ctrl.value == pytest.approx(expected)
    assert isinstance(build_kl_controller("adaptive", 0.1, 0.5, 10), AdaptiveKLController)
    assert build_kl_controller("fixed", 0.3).value == 0.3
    with pytest.raises(ValueError):
        build_kl_controller("bogus")


def test_apply_kl_penalty_to_rewards():
    gen, mask = ragged(4)
    scores = torch.randn(5, 6, generator=gen)
    old = torch.randn(5, 6, generator=gen)
    ref = torch.randn(5, 6, generator=gen)
    ctrl = AdaptiveKLController(0.2, target_kl=0.01, horizon=100)
    rewards, metrics = apply_kl_penalty_to_rewards(scores, old, ref, mask, ctrl, kl_penalty="low_var_kl")
    row_kl = []
    for b in range(5):
        kls = []
        for t in range(6):
            kl = ref_kl(old[b, t].item(), ref[b, t].item(), "k3") if mask[b, t] else 0.0
            kls.append(kl)
            assert rewards[b, t].item() == pytest.approx(scores[b, t].item() - 0.2 * kl, abs=1e-5)
        row_kl.append(sum(kls) / mask[b].sum().item())
    current = sum(row_kl) / 5
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, abs=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + min(max(current / 0.01 - 1, -0.2), 0.2) * 5 / 100))


def test_kl_loss_term():
    gen, mask = ragged(5)
    lp = torch.randn(5, 6, generator=gen).requires_grad_(True)
    ref = torch.randn(5, 6, generator=gen)
    loss, metrics = compute_kl_loss(lp, ref, mask, kl_loss_type="k1", loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref_agg(lp.detach() - ref, mask, "seq-mean-token-mean"), abs=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(loss.item())
    loss.backward()
    lengths = mask.sum(-1, keepdim=True)
    torch.testing.assert_close(lp.grad, mask / lengths / 5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_clipping(mode):
    gen, mask = ragged(6, B=6, T=7)
    values = torch.randn(6, 7, generator=gen)
    vpreds = (values + 0.5 * torch.randn(6, 7, generator=gen)).requires_grad_(True)
    returns = torch.randn(6, 7, generator=gen)
    c = 0.2
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=c, loss_agg_mode=mode)
    token_losses, clipped, grads = torch.zeros(6, 7), [], torch.zeros(6, 7)
    for b in range(6):
        for t in range(7):
            v, r, old = vpreds[b, t].item(), returns[b, t].item(), values[b, t].item()
            vc = min(max(v, old - c), old + c)
            token_losses[b, t] = max((v - r) ** 2, (vc - r) ** 2)
            if mask[b, t]:
                clipped.append((vc - r) ** 2 > (v - r) ** 2)
            grads[b, t] = (
                2 * (v - r) if (v - r) ** 2 >= (vc - r) ** 2 else (2 * (vc - r) if old - c < v < old + c else 0.0)
            )
    assert loss.item() == pytest.approx(0.5 * ref_agg(token_losses, mask, mode), abs=1e-5)
    assert clipfrac == pytest.approx(sum(clipped) / len(clipped))
    assert 0 < clipfrac < 1
    loss.backward()
    lengths = mask.sum(-1, keepdim=True)
    weight = mask / mask.sum() if mode == "token-mean" else mask / lengths / 6
    torch.testing.assert_close(vpreds.grad, 0.5 * grads * weight, atol=1e-5, rtol=1e-4)
    unclipped, frac0 = compute_value_loss(vpreds, returns, values, mask, cliprange_value=None, loss_agg_mode=mode)
    assert frac0 == 0.0
    assert unclipped.item() == pytest.approx(0.5 * ref_agg((vpreds.detach() - returns) ** 2, mask, mode), abs=1e-5)
