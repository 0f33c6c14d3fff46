"""Exact loss aggregation across micro-batches and DP ranks, checked inside the engine tests' multi-rank launches.

``check_exact_aggregation(make_engine, model_dir, dp_rank, dp_size)`` builds three engines on one model that
split their rank's rows differently: one micro-batch per rank, one micro-batch per row (4 per rank), and dynamic
batch sizes (a token budget: micro-batches of unequal rows and tokens), then takes the same steps with the
production actor loss (scaletrain/workers/losses.py ``actor_loss_fn``, entropy bonus included) in two
``loss_agg_mode``s: token-mean, then seq-mean-token-mean. Every step must equal the single-process step on the
whole batch (``dp_size`` ranks against 1 process, any split against none), to 1e-6 relative: the reported
``loss`` and ``actor/pg_loss`` (on every rank, no averaging), the gradient norm and the updated weights. The
optimizer is SGD-like (Adam with betas (0, 0) and eps 1: a step of ``lr * g / (|g| + 1)``, no clipping), so the
weights follow the gradients' scale, which Adam's usual ~``lr * sign(g)`` first step would hide.

The batch has response lengths from 1 to 10 tokens and one row with an empty response mask, and the check first
shows that the former row-share weighting (each micro-batch's loss times its share of the rows) is off by more than
1% for both modes here, so the equalities cannot hold by accident.
"""

from __future__ import annotations

import torch

from backends.config import OptimConfig
from tests.backends import reference
from tests.backends.multirank import assert_close
from tests.backends.tiny import make_batch

# an engine config's micro-batching per split (each rank holds 4 rows; lengths = prompt + response tokens <= 22)
SPLITS = {
    "one_micro_batch": dict(micro_batch_size_per_gpu=4),
    "four_micro_batches": dict(micro_batch_size_per_gpu=1),
    "dynamic_bsz": dict(use_dynamic_bsz=True, max_token_len_per_gpu=30),
}
MODES = ("token-mean", "seq-mean-token-mean")
SGD_LIKE = OptimConfig(lr=0.05, betas=(0.0, 0.0), eps=1.0, weight_decay=0.0, grad_clip=0.0)
REL = 1e-6


def exact_batch(model):
    """8 rows of unequal response lengths, row 2 without response tokens; old log-probs from ``model``. Positive
    advantages: the policy term then outweighs the entropy bonus, so float32 cancellation in the loss stays far
    below the tolerance."""
    batch = make_batch(8, 12, 10, seed=4)
    mask = batch.batch["response_mask"]
    mask[2] = 0
    batch.batch["advantages"] = (batch.batch["advantages"].abs() + 0.5) * mask
    with torch.no_grad():  # ratio 1: every token's policy gradient flows (no clipped token)
        batch.batch["old_log_probs"] = reference.ref_outputs(model, batch)["log_probs"]
    return batch


def assert_rel(a: float, b: float, what: str, rel: float = REL) -> None:
    if not abs(a - b) <= rel * abs(b):
        raise AssertionError(f"{what}: {a!r} vs {b!r} (relative diff {abs(a - b) / abs(b):.3g} > {rel})")


def row_share_loss(model, batch, loss_fn) -> float:
    """What the former engines optimised with one micro-batch per row: the mean of the rows' own losses."""
    with torch.no_grad():
        rows = [batch.select_idxs([i]) for i in range(len(batch))]
        return sum(float(loss_fn(reference.ref_outputs(model, r), r)[0]) for r in rows) / len(rows)


def check_exact_aggregation(make_engine, model_dir: str, dp_rank: int, dp_size: int) -> None:
    """Run the module docstring's check; ``make_engine(optim, **engine_settings)`` builds one training engine."""
    from transformers import AutoModelForCausalLM

    from scaletrain.workers.config import ActorConfig
    from scaletrain.workers.losses import actor_loss_fn

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = exact_batch(ref)
    per = len(batch) // dp_size
    share = batch.select_idxs(list(range(dp_rank * per, (dp_rank + 1) * per)))
    engines = {name: make_engine(SGD_LIKE, **settings) for name, settings in SPLITS.items()}
    outputs = ("log_probs", "entropy")
    for mode in MODES:
        loss_fn = actor_loss_fn(ActorConfig(loss_agg_mode=mode, entropy_coeff=0.01))
        with torch.no_grad():
            ref_metrics = loss_fn(reference.ref_outputs(ref, batch), batch)[1]
        approx = row_share_loss(ref, batch, loss_fn)
        ref_loss, ref_norm = reference.ref_step(ref, batch, loss_fn, reference.ref_outputs, SGD_LIKE)
        assert abs(approx - ref_loss) > 0.01 * abs(ref_loss), (mode, approx, ref_loss)
        ref_sd = ref.state_dict()
        for name, engine in engines.items():
            what = f"{mode} {name}"
            metrics = engine.train_step(share, loss_fn, outputs)
            assert_rel(metrics["loss"], ref_loss, f"{what} loss")
            assert_rel(metrics["actor/pg_loss"], ref_metrics["actor/pg_loss"], f"{what} pg_loss")
            assert_rel(metrics["actor/entropy"], ref_metrics["actor/entropy"], f"{what} entropy")
            assert_rel(metrics["grad_norm"], ref_norm, f"{what} grad_norm")
            weights = {k: v for bucket in engine.export_weights(1 << 30) for k, v in bucket}
            for k, v in weights.items():
                assert_close(v, ref_sd[k], f"{what} weight {k}", tol=REL * max(1.0, ref_sd[k].abs().max().item()))
