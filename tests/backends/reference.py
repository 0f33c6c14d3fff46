"""The single-process reference the engine tests compare against: a plain HF model, torch AdamW, the same losses.

``actor_loss`` / ``value_loss`` are token-means over the response tokens of the batch they get (on the whole batch:
the reference loss), written with plain torch ops independently of scaletrain.algos; their ``count`` (the batch's
response tokens) lets an engine weight micro-batches so that any split over micro-batches and ranks must give the
reference step exactly (backends/accumulation.py). ``ref_outputs`` / ``ref_values`` compute log-probs, entropy, the
sum of squared probabilities and values with plain torch ops, ``ref_step`` is one (clipped) AdamW step on the
whole batch.
"""

from __future__ import annotations

import math

import torch


def response_tokens(mb) -> float:
    return float(mb.batch["response_mask"].sum())


def actor_loss(out, mb):
    m = mb.batch["response_mask"].float()
    pg = (out["log_probs"] * mb.batch["advantages"] * m).sum() / m.sum()
    ent = (out["entropy"] * m).sum() / m.sum()
    return -(pg + 0.01 * ent), {"pg": float(pg)}


def value_loss(out, mb):
    m = mb.batch["response_mask"].float()
    return ((out["values"] - mb.batch["advantages"]) ** 2 * m).sum() / m.sum(), {}


actor_loss.count = value_loss.count = response_tokens


def ref_outputs(model, data):
    b = data.batch
    R = b["responses"].shape[1]
    logits = (
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
        .logits[:, -R - 1 : -1]
        .float()
    )
    logp = torch.log_softmax(logits, -1)
    mask = b["attention_mask"][:, -R:]
    return {
        "log_probs": logp.gather(-1, b["responses"][..., None])[..., 0] * mask,
        "entropy": -(logp.exp() * logp).sum(-1) * mask,
        "sum_pi_squared": (logp.exp() ** 2).sum(-1) * mask,
    }


def ref_values(model, data):
    b = data.batch
    R = b["responses"].shape[1]
    v = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[
        :, -R - 1 : -1, 0
    ]
    return {"values": v * b["attention_mask"][:, -R:]}


def actor_reference(model_dir: str, batch, optim, before_on=None):
    """The single-process reference of one actor step on ``batch`` from ``model_dir``'s weights (float32): (the
    outputs before the step on ``before_on``, default the batch; the step's loss; its gradient norm; the state dict
    after it)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        before = ref_outputs(ref, batch if before_on is None else before_on)
    loss, norm = ref_step(ref, batch, actor_loss, ref_outputs, optim)
    return before, loss, norm, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def ref_step(model, data, loss_fn, outputs_fn, optim):
    """One step of torch AdamW (``optim``: an OptimConfig, constant lr; ``grad_clip`` <= 0: no clipping) on
    ``data``; returns (loss, grad_norm)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, eps=optim.eps, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
    )
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn(outputs_fn(model, data), data)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip if optim.grad_clip > 0 else math.inf)
    opt.step()
    return float(loss), float(norm)
