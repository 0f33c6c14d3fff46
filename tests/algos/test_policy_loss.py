"""Policy losses against per-token loop references: loss values, metrics and gradients w.r.t. log_prob."""

import math

import pytest
import torch

from scaletrain.algos import agg_loss, get_policy_loss, register_policy_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def batch(seed, B=5, T=7, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for b, n in enumerate(torch.randint(1, T + 1, (B,), generator=gen).tolist()):
        mask[b, :n] = 1
    old = -torch.rand(B, T, generator=gen) * 3
    log_prob = (old + spread * torch.randn(B, T, generator=gen)).requires_grad_(True)
    adv = torch.randn(B, T, generator=gen)
    return old, log_prob, adv, mask


def agg_weights(mask, mode):
    """d(aggregate)/d(token loss) for each token, written out per mode."""
    B, T = mask.shape
    w = torch.zeros(B, T, dtype=torch.float64)
    lengths = mask.sum(-1).tolist()
    n_tokens, n_seqs = sum(lengths), sum(1 for n in lengths if n > 0)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                w[b, t] = {
                    "token-mean": 1 / n_tokens,
                    "seq-mean-token-sum": 1 / n_seqs,
                    "seq-mean-token-mean": 1 / (n_seqs * lengths[b]),
                    "seq-mean-token-sum-norm": 1 / (n_seqs * T),
                }[mode]
    return w


def ref_aggregate(token_losses, mask, mode):
    """token_losses: dict (b, t) -> scalar tensor, only for unmasked tokens."""
    w = agg_weights(mask, mode)
    return sum(w[b, t].item() * loss for (b, t), loss in token_losses.items())


def run(name, old, log_prob, adv, mask, mode, config, **kwargs):
    log_prob.grad = None
    loss, metrics = get_policy_loss(name)(old, log_prob, adv, mask, mode, config, **kwargs)
    loss.backward()
    return loss.detach(), log_prob.grad.clone(), metrics


def ref_run(token_loss_fn, old, log_prob, adv, mask, mode):
    lp = log_prob.detach().double().clone().requires_grad_(True)
    losses = {
        (b, t): token_loss_fn(old[b, t].double(), lp[b, t], adv[b, t].double(), b, t)
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t]
    }
    total = ref_aggregate(losses, mask, mode)
    total.backward()
    return total.detach(), lp.grad


def assert_close(a, b):
    torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)


def masked_frac(flags, mask):
    hits = [flags[b][t] for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    return sum(hits) / len(hits)


@pytest.mark.parametrize("mode", MODES)
def test_vanilla_ppo_with_asymmetric_and_dual_clip(mode):
    old, lp, adv, mask = batch(0, B=8, T=8, spread=0.8)
    low, high, c = 0.2, 0.28, 1.5
    cfg = {"clip_ratio": 0.1, "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c}

    def token_loss(o, logp, a, b, t):
        ratio = torch.exp(logp - o)
        r_clip = min(max(ratio.item(), 1 - low), 1 + high)
        if (-a * ratio).item() >= (-a * r_clip).item():
            loss = -a * ratio
        else:
            loss = (-a * r_clip).detach()  # clipped: no gradient
        if a < 0 and loss.item() > (-a * c).item():
            loss = (-a * c).detach()  # dual clip caps the loss for negative advantages
        return loss

    loss, grad, metrics = run("vanilla", old, lp, adv, mask, mode, cfg)
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, mode)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)

    ratio = torch.exp(lp.detach() - old)
    clipped = [
        [(-adv[b, t] * min(max(ratio[b, t], 1 - low), 1 + high) > -adv[b, t] * ratio[b, t]).item() for t in range(8)]
        for b in range(8)
    ]
    dual = [[bool(adv[b, t] < 0 and max(ratio[b, t].item(), 1 - low) > c) for t in range(8)] for b in range(8)]
    assert metrics["actor/pg_clipfrac"] == pytest.approx(masked_frac(clipped, mask), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(masked_frac(dual, mask), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0  # both clips exercised
    kl = [(old[b, t] - lp[b, t]).item() for b in range(8) for t in range(8) if mask[b, t]]
    assert metrics["actor/ppo_kl"] == pytest.approx(sum(kl) / len(kl), abs=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(loss.item(), abs=1e-6)


def test_vanilla_rollout_is_weights_multiply_token_losses():
    old, lp, adv, mask = batch(1)
    weights = torch.rand(5, 7, generator=torch.Generator().manual_seed(5)) * 2
    loss_w, grad_w, _ = run("vanilla", old, lp, adv, mask, "token-mean", None, rollout_is_weights=weights)
    # same as scaling the advantages when no clip binds: use a huge clip range
    wide = {"clip_ratio": 100.0, "clip_ratio_c": 1e9}
    loss_a, grad_a, _ = run("vanilla", old, lp, adv * weights, mask, "token-mean", wide)
    loss_b, grad_b, _ = run("vanilla", old, lp, adv, mask, "token-mean", wide, rollout_is_weights=weights)
    assert_close(loss_a, loss_b)
    assert_close(grad_a, grad_b)
    assert not torch.allclose(loss_w, run("vanilla", old, lp, adv, mask, "token-mean", None)[0])


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_sequence_ratio_and_gradient(mode):
    old, lp, adv, mask = batch(2, spread=0.3)
    low, high = 0.05, 0.08
    cfg = {"clip_ratio_low": low, "clip_ratio_high": high}
    loss, grad, metrics = run("gspo", old, lp, adv, mask, mode, cfg)

    w = agg_weights(mask, mode)
    ref_loss, ref_grad, clipped = 0.0, torch.zeros(5, 7, dtype=torch.float64), []
    for b in range(5):
        n = int(mask[b].sum())
        s = math.exp(sum((lp[b, t] - old[b, t]).item() for t in range(n)) / n)
        s_clip = min(max(s, 1 - low), 1 + high)
        for t in range(n):
            a = adv[b, t].item()
            ref_loss += w[b, t].item() * max(-a * s, -a * s_clip)
            unclipped_active = (1 - low <= s <= 1 + high) or (-a * s > -a * s_clip)
            ref_grad[b, t] = w[b, t] * (-a * s) if unclipped_active else 0.0  # d s_t / d log pi_t = s
            clipped.append(-a * s_clip > -a * s)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-5)
    assert_close(grad, ref_grad)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(sum(clipped) / len(clipped), abs=1e-6)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("mode", MODES)
def test_gpg_is_plain_policy_gradient(mode):
    old, lp, adv, mask = batch(3)
    loss, grad, _ = run("gpg", old, lp, adv, mask, mode, None)
    ref_loss, ref_grad = ref_run(lambda o, logp, a, b, t: -a * logp, old, lp, adv, mask, mode)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


def test_cispo_clipped_detached_weight():
    old, lp, adv, mask = batch(4, spread=0.5)
    low, high = 0.3, 0.2

    def token_loss(o, logp, a, b, t):
        weight = min(max(math.exp((logp - o).item()), 1 - low), 1 + high)  # a constant: no gradient through it
        return -a * weight * logp

    loss, grad, metrics = run(
        "cispo", old, lp, adv, mask, "token-mean", {"clip_ratio_low": low, "clip_ratio_high": high}
    )
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, "token-mean")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    ratio = torch.exp(lp.detach() - old)
    flags = ((ratio < 1 - low) | (ratio > 1 + high)).tolist()
    assert metrics["actor/pg_clipfrac"] == pytest.approx(masked_frac(flags, mask), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] > 0


def test_sapo_soft_gate():
    old, lp, adv, mask = batch(5, spread=0.5)
    tau_pos, tau_neg = 1.0, 2.0

    def token_loss(o, logp, a, b, t):
        tau = tau_pos if a > 0 else tau_neg
        gate = 1.0 / (1.0 + torch.exp(-tau * (torch.exp(logp - o) - 1.0)))
        return -a * gate * 4.0 / tau

    loss, grad, metrics = run(
        "sapo", old, lp, adv, mask, "seq-mean-token-mean", {"policy_loss": {"tau_pos": tau_pos, "tau_neg": tau_neg}}
    )
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, "seq-mean-token-mean")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    # on-policy (ratio 1) the gradient equals the plain policy gradient -A * w
    on_policy = lp.detach().clone().requires_grad_(True)
    _, grad_on, metrics_on = run("sapo", on_policy.detach(), on_policy, adv, mask, "token-mean", None)
    assert_close(grad_on, -adv.double() * agg_weights(mask, "token-mean"))
    assert metrics_on["actor/sapo_gate"] == pytest.approx(1.0)
    assert metrics["actor/sapo_gate"] < 1.0


def cov_stats(old, lp, adv, mask):
    valid = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    mean_a = sum(adv[b, t].item() for b, t in valid) / len(valid)
    mean_l = sum(lp[b, t].item() for b, t in valid) / len(valid)
    return valid, {(b, t): (adv[b, t].item() - mean_a) * (lp[b, t].item() - mean_l) for b, t in valid}


def test_clip_cov_detaches_all_eligible_tokens_when_ratio_is_large():
    old, lp, adv, mask = batch(6, B=6, T=8, spread=0.4)
    cfg = {"clip_ratio": 0.2, "clip_cov_ratio": 1.0, "clip_cov_lb": 0.2, "clip_cov_ub": 1.5}
    valid, cov = cov_stats(old, lp, adv, mask)

    def ppo(o, logp, a):
        ratio = torch.exp(logp - o)
        r = ratio.item()
        if 0.8 <= r <= 1.2 or -a * r >= -a * min(max(r, 0.8), 1.2):
            return -a * ratio, False
        return (-a * min(max(r, 0.8), 1.2)).detach(), True

    eligible = {
        (b, t) for b, t in valid if not ppo(old[b, t], lp[b, t].detach(), adv[b, t])[1] and 0.2 < cov[(b, t)] < 1.5
    }
    assert 0 < len(eligible) < len(valid)

    def token_loss(o, logp, a, b, t):
        loss, _ = ppo(o, logp, a)
        return loss * 0.0 if (b, t) in eligible else loss

    loss, grad, metrics = run("clip_cov", old, lp, adv, mask, "token-mean", cfg)
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, "token-mean")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["actor/pg_cov_clipfrac"] == pytest.approx(len(eligible) / len(valid))


def test_clip_cov_picks_a_random_subset_of_eligible_tokens():
    old, lp, adv, mask = batch(7, B=8, T=10, spread=0.2)
    cfg = {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0}
    valid, cov = cov_stats(old, lp, adv, mask)
    n_pick = max(int(0.05 * len(valid)), 1)
    _, ppo_grad, _ = run("vanilla", old, lp, adv, mask, "token-mean", {"clip_ratio_c": 1e9})
    grads = []
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        _, grad, metrics = run("clip_cov", old, lp, adv, mask, "token-mean", cfg, generator=gen)
        grads.append(grad)
        zeroed = {(b, t) for b, t in valid if grad[b, t] == 0 and ppo_grad[b, t] != 0}
        assert all(grad[b, t] == ppo_grad[b, t] for b, t in valid if (b, t) not in zeroed)
        assert len(zeroed) == n_pick
        assert all(cov[bt] > 0 for bt in zeroed)
        assert metrics["actor/pg_cov_clipfrac"] == pytest.approx(n_pick / len(valid))
    _, again, _ = run("clip_cov", old, lp, adv, mask, "token-mean", cfg, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again, grads[0])  # reproducible with a seeded generator


def test_kl_cov_penalises_top_covariance_tokens():
    old, lp, adv, mask = batch(8, B=6, T=8)
    ratio_share, coef = 0.1, 0.7
    valid, cov = cov_stats(old, lp, adv, mask)
    k = max(int(len(valid) * ratio_share), 1)
    top = set(sorted(valid, key=lambda bt: cov[bt], reverse=True)[:k])

    def token_loss(o, logp, a, b, t):
        loss = -a * torch.exp(logp - o)
        return loss + coef * (logp - o).abs() if (b, t) in top else loss

    loss, grad, metrics = run(
        "kl_cov", old, lp, adv, mask, "token-mean", {"kl_cov_ratio": ratio_share, "ppo_kl_coef": coef}
    )
    ref_loss, ref_grad = ref_run(token_loss, old, lp, adv, mask, "token-mean")
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["actor/kl_cov_frac"] == pytest.approx(k / len(valid))


def test_unknown_policy_loss_and_registration():
    with pytest.raises(ValueError) as err:
        get_policy_loss("nope")
    for name in ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo"):
        assert name in str(err.value)

    @register_policy_loss("test_only_reward_aware", override=True)
    def reward_aware(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, **kwargs):
        return agg_loss(-log_prob * kwargs["token_level_rewards"], response_mask, loss_agg_mode), {}

    old, lp, adv, mask = batch(9)
    rewards = torch.randn(5, 7)
    loss, _ = get_policy_loss("test_only_reward_aware")(
        old, lp, adv, mask, "token-mean", None, token_level_rewards=rewards
    )
    expected = (
        sum((-lp[b, t] * rewards[b, t]).item() for b in range(5) for t in range(7) if mask[b, t]) / mask.sum().item()
    )
    assert loss.item() == pytest.approx(expected, abs=1e-5)
