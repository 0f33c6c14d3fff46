"""Benchmark scaletrain.algos against straightforward loop implementations measured in the same run.

    python benchmarks/algos.py            # (1024, 2048) tensors
    python benchmarks/algos.py --quick    # (128, 512)
    python benchmarks/algos.py --device cuda

Prints the median milliseconds of each vectorised function next to a loop version (GAE: a loop over time steps;
GRPO: a Python loop over groups; PPO loss: a loop over rows) and the speed-up. The loop versions are also
checked to give the same numbers, so the comparison is between equivalent code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit_results  # noqa: E402
from scaletrain.algos import get_adv_estimator, get_policy_loss, masked_whiten  # noqa: E402


# ---------------------------------------------------------------- loop baselines
def gae_loop(rewards, values, mask, gamma, lam):
    """GAE as a loop over time steps (vectorised over rows), masked steps skipped."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, device=rewards.device)
    running = torch.zeros(B, device=rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        next_value = torch.where(m > 0, values[:, t], next_value)
        running = torch.where(m > 0, new_running, running)
        adv[:, t] = new_running
    returns = (adv + values) * mask
    return masked_whiten(adv, mask) * mask, returns


def grpo_loop(rewards, mask, index, eps=1e-6):
    """GRPO with a Python loop over groups."""
    scores = rewards.sum(-1)
    rows = defaultdict(list)
    for i, uid in enumerate(index):
        rows[uid].append(i)
    out = torch.zeros_like(scores)
    for members in rows.values():
        idx = torch.tensor(members, device=scores.device)
        group = scores[idx]
        if len(members) > 1:
            out[idx] = (group - group.mean()) / (group.std() + eps)
        else:
            out[idx] = group / (1 + eps)
    return out[:, None] * mask


def ppo_loss_loop(old_log_prob, log_prob, advantages, mask, clip=0.2, clip_c=3.0):
    """PPO clipped loss (token-mean) with a loop over rows."""
    total = log_prob.new_zeros(())
    for b in range(log_prob.shape[0]):
        n = int(mask[b].sum())
        ratio = torch.exp(log_prob[b, :n] - old_log_prob[b, :n])
        a = advantages[b, :n]
        loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
        loss = torch.where(a < 0, torch.minimum(loss, -a * clip_c), loss)
        total = total + loss.sum()
    return total / mask.sum()


# ---------------------------------------------------------------- timing
def median_ms(fn, repeats, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_inputs(B, T, group, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=gen).float()
    values = torch.randn(B, T, generator=gen)
    old = -torch.rand(B, T, generator=gen) * 2
    new = old + 0.1 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    index = np.repeat(np.array([f"uid{i}" for i in range(B // group)], dtype=object), group)
    to = lambda x: x.to(device)  # noqa: E731
    return to(mask), to(rewards), to(values), to(old), to(new), to(adv), index


def check_loops_agree(inputs: tuple, gamma: float, lam: float) -> None:
    """The loop baselines give the vectorised functions' numbers, so the timings compare equivalent code."""
    mask, rewards, values, old, new, adv, index = inputs
    gae, grpo, ppo = get_adv_estimator("gae"), get_adv_estimator("grpo"), get_policy_loss("vanilla")
    torch.testing.assert_close(
        gae(rewards, mask, values=values, gamma=gamma, lam=lam)[0],
        gae_loop(rewards, values, mask, gamma, lam)[0],
        atol=1e-3,
        rtol=1e-3,
    )
    torch.testing.assert_close(
        grpo(rewards, mask, index=index)[0], grpo_loop(rewards, mask, index), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        ppo(old, new, adv, mask, "token-mean", None)[0], ppo_loss_loop(old, new, adv, mask), atol=1e-5, rtol=1e-4
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (128 x 512)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    B, T = (128, 512) if args.quick else (1024, 2048)
    repeats = args.repeats or (5 if args.quick else 3)
    group = 8
    inputs = make_inputs(B, T, group, device)
    mask, rewards, values, old, new, adv, index = inputs
    gamma, lam = 0.99, 0.95
    check_loops_agree(inputs, gamma, lam)
    gae, grpo, ppo = get_adv_estimator("gae"), get_adv_estimator("grpo"), get_policy_loss("vanilla")

    def ppo_fwd_bwd(loop):
        lp = new.clone().requires_grad_(True)
        loss = ppo_loss_loop(old, lp, adv, mask) if loop else ppo(old, lp, adv, mask, "token-mean", None)[0]
        loss.backward()

    cases = [
        (
            "gae",
            lambda: gae(rewards, mask, values=values, gamma=gamma, lam=lam),
            lambda: gae_loop(rewards, values, mask, gamma, lam),
        ),
        ("grpo", lambda: grpo(rewards, mask, index=index), lambda: grpo_loop(rewards, mask, index)),
        (
            "ppo loss fwd",
            lambda: ppo(old, new, adv, mask, "token-mean", None),
            lambda: ppo_loss_loop(old, new, adv, mask),
        ),
        ("ppo loss fwd+bwd", lambda: ppo_fwd_bwd(False), lambda: ppo_fwd_bwd(True)),
    ]
    print(
        f"scaletrain.algos benchmark: ({B}, {T}) tensors, groups of {group}, device={device}, "
        f"torch threads={torch.get_num_threads()}, median of {repeats}"
    )
    print(f"{'case':<18}{'vectorised ms':>15}{'loop ms':>12}{'speed-up':>10}")
    rows = []
    for name, fast, slow in cases:
        fast_ms = median_ms(fast, repeats, device)
        slow_ms = median_ms(slow, repeats, device)
        print(f"{name:<18}{fast_ms:>15.2f}{slow_ms:>12.2f}{slow_ms / fast_ms:>9.1f}x")
        rows.append((f"algos {name}", fast_ms, slow_ms, "python loop"))
    emit_results(rows)


if __name__ == "__main__":
    main()
