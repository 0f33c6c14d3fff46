"""One side of the algorithms comparison: GAE, GRPO and the vanilla PPO loss on one implementation.

    .venv/bin/python       benchmarks/peers/algos_side.py --impl ours --out-dir DIR [--quick]
    .venv-peers/bin/python benchmarks/peers/algos_side.py --impl verl --out-dir DIR [--quick]

Inputs come from benchmarks.algos.make_inputs (seeded, so both processes build identical tensors). Each case's
outputs are saved to DIR/<impl>_algos.pt for benchmarks/peers/run.py to compare (the timings only mean
something if both sides compute the same numbers). Settings made equal on both sides: gamma 0.99, lam 0.95,
GRPO eps 1e-6 with std normalisation (both defaults), PPO clip 0.2 / dual clip 3.0 with token-mean aggregation
(both defaults; verl needs them in an ActorConfig). Prints one ``BENCH_JSON`` line of this side's median ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.algos import make_inputs  # noqa: E402
from benchmarks.common import emit_results, median_ms  # noqa: E402

GAMMA, LAM, GROUP = 0.99, 0.95, 8


def load_ours() -> tuple:
    from scaletrain.algos import get_adv_estimator, get_policy_loss

    gae_fn, grpo_fn, ppo_fn = get_adv_estimator("gae"), get_adv_estimator("grpo"), get_policy_loss("vanilla")

    def gae(rewards, values, mask):
        return gae_fn(rewards, mask, values=values, gamma=GAMMA, lam=LAM)

    def grpo(rewards, mask, index):
        return grpo_fn(rewards, mask, index=index, epsilon=1e-6, norm_adv_by_std_in_grpo=True)

    def ppo(old, new, adv, mask):
        return ppo_fn(old, new, adv, mask, "token-mean", {"clip_ratio": 0.2, "clip_ratio_c": 3.0})[0]

    return gae, grpo, ppo


def load_verl() -> tuple:
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import ActorConfig

    # the smallest ActorConfig verl accepts; clip_ratio_low/high fall back to clip_ratio like ours
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2, clip_ratio_c=3.0)
    ppo_fn = core_algos.get_policy_loss_fn("vanilla")

    def gae(rewards, values, mask):
        return core_algos.compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM)

    def grpo(rewards, mask, index):
        return core_algos.compute_grpo_outcome_advantage(
            rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True
        )

    def ppo(old, new, adv, mask):
        return ppo_fn(old, new, adv, mask, loss_agg_mode="token-mean", config=config)[0]

    return gae, grpo, ppo


def run_cases(impl: str, rows: int, seq: int, reps: int) -> tuple[list, dict]:
    """(timing rows, outputs by measure) for the four cases."""
    gae, grpo, ppo = load_ours() if impl == "ours" else load_verl()
    mask, rewards, values, old, new, adv, index = make_inputs(rows, seq, GROUP, torch.device("cpu"))

    def ppo_fwd_bwd():
        lp = new.clone().requires_grad_(True)
        loss = ppo(old, lp, adv, mask)
        loss.backward()
        return loss.detach(), lp.grad

    cases = {
        f"GAE ({rows} x {seq})": lambda: gae(rewards, values, mask),
        f"GRPO outcome advantage (groups of {GROUP})": lambda: grpo(rewards, mask, index),
        "policy loss vanilla fwd": lambda: ppo(old, new, adv, mask),
        "policy loss vanilla fwd+bwd": ppo_fwd_bwd,
    }
    timings, outputs = [], {}
    for name, fn in cases.items():
        out = fn()
        out = out if isinstance(out, tuple) else (out,)
        # verl leaves whitened GAE values at padded positions where ours writes 0; padding never reaches a loss
        outputs[name] = [t.detach() * mask if t.shape == mask.shape else t.detach() for t in out]
        timings.append((name, median_ms(fn, reps)))
        print(f"{impl:>5} {name:<44}{timings[-1][1]:>10.2f} ms", flush=True)
    return timings, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("ours", "verl"), required=True)
    parser.add_argument("--out-dir", type=Path, required=True, help="where <impl>_algos.pt goes")
    parser.add_argument("--quick", action="store_true", help="(128, 512) tensors")
    args = parser.parse_args()
    rows, seq = (128, 512) if args.quick else (1024, 2048)
    torch.set_num_threads(1)
    timings, outputs = run_cases(args.impl, rows, seq, reps=5)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(outputs, args.out_dir / f"{args.impl}_algos.pt")
    emit_results([(name, ms, None, "") for name, ms in timings])


if __name__ == "__main__":
    main()
