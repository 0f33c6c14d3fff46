"""Per-micro-batch losses the role workers hand to their TrainEngine (layer 2).

Each builder returns ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` as ``backends.base.LossFn`` expects;
the pieces (policy loss, aggregation, KL, value loss) come from ``scaletrain.algos``. Each loss is aggregated over
``response_mask`` with its ``loss_agg_mode``, and ``aggregated(mode)`` tells the engine how many units (tokens,
sequences) a micro-batch holds, so the engine's step is exactly the whole mini-batch's loss_agg_mode loss across
micro-batches and DP ranks (backends/accumulation.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from backends.base import LossFn
from scaletrain.algos import agg_count, agg_loss, compute_value_loss, get_policy_loss, kl_penalty
from scaletrain.protocol import DataProto
from scaletrain.workers.config import ActorConfig, CriticConfig

# batch fields the actor update reads besides the model inputs
ACTOR_INPUTS = (
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "old_log_probs",
    "advantages",
)
CRITIC_INPUTS = ("responses", "input_ids", "attention_mask", "position_ids", "response_mask", "values", "returns")


def aggregated(mode: str, mask_key: str = "response_mask") -> Callable[[Callable], Callable]:
    """Decorator for a loss_fn that aggregates over ``mb.batch[mask_key]`` with ``mode``: gives it the
    ``count(micro_batch)`` the engines weight micro-batches by (backends/base.py ``LossFn``)."""

    def wrap(loss_fn: Callable) -> Callable:
        loss_fn.count = lambda mb: agg_count(mb.batch[mask_key], mode)
        return loss_fn

    return wrap


def actor_loss_fn(config: ActorConfig) -> LossFn:
    """PPO-family policy loss (registered ``policy_loss.loss_mode``) - entropy bonus + KL loss."""
    policy_loss = get_policy_loss(config.policy_loss.loss_mode)
    mode = config.loss_agg_mode
    optional = _accepted(policy_loss, ("rollout_log_probs", "token_level_rewards", "rollout_is_weights"))

    @aggregated(mode)
    def loss_fn(outputs: dict[str, torch.Tensor], mb: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        log_prob = outputs["log_probs"]
        mask = mb.tensors["response_mask"]
        extra = {k: mb.tensors[k] for k in optional if k in mb.tensors.keys()}
        pg_loss, metrics = policy_loss(
            mb.tensors["old_log_probs"], log_prob, mb.tensors["advantages"], mask, mode, config, **extra
        )
        loss = pg_loss
        if config.entropy_coeff:
            entropy = agg_loss(outputs["entropy"], mask, mode)
            loss = loss - config.entropy_coeff * entropy
            metrics["actor/entropy"] = entropy.item()
        elif "entropy" in outputs:
            metrics["actor/entropy"] = agg_loss(outputs["entropy"].detach(), mask, mode).item()
        if config.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, mb.tensors["ref_log_prob"], config.kl_loss_type), mask, mode)
            loss = loss + config.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
            metrics["actor/kl_coef"] = config.kl_loss_coef
        return loss, metrics

    return loss_fn


def _accepted(fn: Callable, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The optional batch fields ``fn`` takes: all with ``**kwargs``, else those it names (a loss written for verl
    names only ``rollout_is_weights``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return keys
    return tuple(k for k in keys if k in params)


def actor_outputs(config: ActorConfig) -> tuple[str, ...]:
    return ("log_probs", "entropy") if config.entropy_coeff else ("log_probs",)


def critic_loss_fn(config: CriticConfig) -> Callable:
    """Clipped value loss against the returns."""

    @aggregated(config.loss_agg_mode)
    def loss_fn(outputs: dict[str, torch.Tensor], mb: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        vpreds = outputs["values"]
        loss, clipfrac = compute_value_loss(
            vpreds,
            mb.tensors["returns"],
            mb.tensors["values"],
            mb.tensors["response_mask"],
            config.cliprange_value,
            config.loss_agg_mode,
        )
        mask = mb.tensors["response_mask"].bool()
        return loss, {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": float(clipfrac),
            "critic/vpred_mean": vpreds.detach()[mask].mean().item() if mask.any() else 0.0,
        }

    return loss_fn
