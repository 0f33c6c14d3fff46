"""Rollout correction in the single controller (layer 4): ``algorithm.rollout_correction`` applied per step.

The rollout engine (vLLM, ...) and the trainer compute the same policy with different kernels, so the
``rollout_log_probs`` the engine returns differ from the trainer's ``old_log_probs``. ``old_log_probs`` computes
those (one step of fit()); ``apply_rollout_correction`` runs on the driver right after them (cheap tensor ops on the
whole batch):

- always (when the batch has ``rollout_log_probs``): the ``rollout_corr/*`` mismatch metrics;
- ``rollout_is`` = token | sequence: truncated importance weights pi_train / pi_rollout put in the batch as
  ``rollout_is_weights``, which every policy loss multiplies into its per-token losses;
- ``rollout_rs`` = token_k1 | seq_sum_k1: tokens (or whole sequences) whose ratio falls outside the bounds are
  rejected by clearing ``response_mask`` there, so advantages, losses and the response-length metrics skip them.

The math is in ``scaletrain.algos.rollout_correction``; ``validate_rollout_correction`` checks the keys before
Ray starts, including that the configured policy loss really uses the weights.

``bypass_mode=true`` (verl's key) skips the trainer's old-log-prob forward: the rollout's log-probs are the old
ones, so PPO's ratio is pi_theta / pi_rollout (two policies instead of three). It saves one forward pass over the
batch per step. With ``loss_type=reinforce``, ``rollout_is`` or ``rollout_rs`` the correction runs in the
``bypass_mode`` policy loss against the current policy (scaletrain/algos/policy_loss_bypass.py), as in verl: the
trainer picks that loss (``worker_configs.py``), and the driver computes no weights. The engines return log-probs
of the distribution they sampled from (temperature-scaled, and renormalised under top-k / top-p): with truncation
on, the ratio also carries that difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scaletrain.algos import compute_mismatch_metrics, compute_rollout_correction, get_policy_loss, masked_mean
from scaletrain.algos.rollout_correction import rs_ratio_bounds
from scaletrain.protocol import DataProto
from scaletrain.trainer.step.metrics import timer
from scaletrain.utils.typed_config import ConfigError

if TYPE_CHECKING:
    from scaletrain.trainer.config.ppo_config import PPOConfig, RolloutCorrectionConfig
    from scaletrain.workers.roles import ActorRolloutRefRole

KEY = "algorithm.rollout_correction"
IS_OPTIONS = ("token", "sequence")
# verl's rejection options that map onto the ratio bounds of compute_rollout_correction(mode="mask"):
# k1 = log ratio, per token or summed over the sequence (the product of the token ratios)
RS_OPTIONS = {"token_k1": "token", "seq_sum_k1": "sequence"}


def rs_bounds(cfg: RolloutCorrectionConfig) -> tuple[float, float]:
    """(lower, upper) ratio bounds of ``rollout_rs_threshold``: "lower_upper" ratio bounds, or one upper bound."""
    spec = cfg.rollout_rs_threshold
    if spec is None:
        raise ConfigError(
            f"{KEY}.rollout_rs={cfg.rollout_rs} needs {KEY}.rollout_rs_threshold "
            '("lower_upper" ratio bounds, e.g. "0.5_2.0", or an upper bound)'
        )
    try:
        return rs_ratio_bounds(spec)
    except ValueError as exc:
        raise ConfigError(f"{KEY}.rollout_rs_threshold: {exc}") from None


def validate_rollout_correction(cfg: PPOConfig) -> None:
    """ConfigError naming the key for an unsupported value or a bad threshold; every set key must take effect."""
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None and rc.rollout_is not in IS_OPTIONS:
        raise ConfigError(f"{KEY}.rollout_is: unsupported '{rc.rollout_is}'; supported: null, {', '.join(IS_OPTIONS)}")
    if not 1.0 <= rc.rollout_is_threshold < float("inf"):
        raise ConfigError(
            f"{KEY}.rollout_is_threshold must be >= 1 (a weight of 1 must pass untruncated), "
            f"got {rc.rollout_is_threshold}"
        )
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        raise ConfigError(f"{KEY}.rollout_is_batch_normalize needs {KEY}.rollout_is (token | sequence)")
    if rc.rollout_rs is not None:
        if rc.rollout_rs not in RS_OPTIONS:
            raise ConfigError(
                f"{KEY}.rollout_rs: unsupported '{rc.rollout_rs}'; supported: null, {', '.join(RS_OPTIONS)}"
            )
        rs_bounds(rc)
    elif rc.rollout_rs_threshold is not None:
        raise ConfigError(f"{KEY}.rollout_rs_threshold is set but {KEY}.rollout_rs is null")
    if not 0.0 < rc.mismatch_log_prob_threshold < float("inf"):
        raise ConfigError(f"{KEY}.mismatch_log_prob_threshold must be positive, got {rc.mismatch_log_prob_threshold}")
    _validate_bypass(cfg)
    if rc.rollout_is is not None and not rc.bypass_mode:
        _check_loss_uses_weights(cfg)


def corrects_in_the_loss(rc: RolloutCorrectionConfig) -> bool:
    """Bypass mode with something to correct against the current policy: the ``bypass_mode`` loss does it."""
    return rc.bypass_mode and (rc.loss_type != "ppo_clip" or rc.rollout_is is not None or rc.rollout_rs is not None)


def _validate_bypass(cfg: PPOConfig) -> None:
    rc, loss_mode = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.loss_type not in ("ppo_clip", "reinforce"):
        raise ConfigError(f"{KEY}.loss_type: unsupported '{rc.loss_type}'; supported: ppo_clip, reinforce")
    if not rc.bypass_mode and rc.loss_type != "ppo_clip":
        raise ConfigError(f"{KEY}.loss_type={rc.loss_type} applies in bypass mode: set {KEY}.bypass_mode=true")
    if loss_mode == "bypass_mode" and not rc.bypass_mode:
        raise ConfigError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: set {KEY}.bypass_mode=true instead (the "
            "trainer picks that loss when its bypass corrects in the loss)"
        )
    if corrects_in_the_loss(rc) and loss_mode not in ("vanilla", "bypass_mode"):
        raise ConfigError(
            f"{KEY}.bypass_mode with loss_type={rc.loss_type}, rollout_is={rc.rollout_is}, rollout_rs={rc.rollout_rs} "
            f"trains with the bypass_mode loss, not actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: set "
            "loss_mode=vanilla, or use bypass_mode with loss_type=ppo_clip and neither rollout_is nor rollout_rs"
        )


def bypass_policy_loss(rc: RolloutCorrectionConfig) -> dict[str, Any]:
    """What the ``bypass_mode`` loss reads (``policy_loss.rollout_correction``)."""
    keys = ("loss_type", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize")
    return {key: getattr(rc, key) for key in (*keys, "rollout_rs", "rollout_rs_threshold")}


def _check_loss_uses_weights(cfg: PPOConfig) -> None:
    """The configured policy loss must multiply its per-token losses by ``rollout_is_weights``.

    Probed on a tiny random batch: with all-zero weights such a loss is 0 (to a millionth of its unweighted value).
    A loss that rejects the keyword or ignores it would silently train without the correction."""
    actor = cfg.actor_rollout_ref.actor
    mode = actor.policy_loss.loss_mode
    where = (
        f"{KEY}.rollout_is={cfg.algorithm.rollout_correction.rollout_is}: policy loss '{mode}' "
        "(actor_rollout_ref.actor.policy_loss.loss_mode)"
    )
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=gen) - 0.1
    log_prob = old + 0.1 * torch.randn(2, 4, generator=gen)
    advantages = torch.randn(2, 4, generator=gen)
    mask, zeros = torch.ones(2, 4), torch.zeros(2, 4)
    loss_fn = get_policy_loss(mode)
    try:
        loss, _ = loss_fn(old, log_prob, advantages, mask, actor.loss_agg_mode, actor, rollout_is_weights=zeros)
        unweighted, _ = loss_fn(old, log_prob, advantages, mask, actor.loss_agg_mode, actor)
    except TypeError as exc:
        raise ConfigError(f"{where} takes no rollout_is_weights: {exc}") from exc
    except ValueError as exc:  # the loss refuses its own settings (e.g. dro without dro_beta)
        raise ConfigError(f"{where}: {exc}") from exc
    # GMPO's geometric mean of the weights keeps an epsilon (verl's): zero weights leave ~1e-10 of the loss
    if abs(float(loss)) > 1e-6 * max(1.0, abs(float(unweighted))):
        raise ConfigError(
            f"{where} ignores rollout_is_weights "
            f"(all-zero weights gave loss {float(loss):.4g}); set rollout_is to null or use a loss "
            "that applies them"
        )


def old_log_probs(
    actor: ActorRolloutRefRole, batch: DataProto, cfg: RolloutCorrectionConfig, metrics: dict, timings: dict
) -> DataProto:
    """``batch`` with ``old_log_probs``: the actor's forward pass (its entropy as ``actor/entropy``) and then the
    rollout correction, or in bypass mode the rollout's own log-probs."""
    if cfg.bypass_mode:
        if "rollout_log_probs" not in batch.tensors.keys():
            raise ValueError(f"{KEY}.bypass_mode=true needs the rollout's log-probs, and this batch has none")
        batch.tensors["old_log_probs"] = batch.tensors["rollout_log_probs"]
        return batch
    with timer("old_log_prob", timings):
        old = actor.compute_log_prob(batch)
        entropy = old.tensors["entropys"][batch.tensors["response_mask"].bool()]
        metrics["actor/entropy"] = entropy.mean().item()
        batch = batch.union(old.select(batch_keys=[str(k) for k in old.tensors.keys() if k != "entropys"]))
    metrics.update(apply_rollout_correction(batch, cfg))
    return batch


@torch.no_grad()
def apply_rollout_correction(batch: DataProto, cfg: RolloutCorrectionConfig) -> dict[str, float]:
    """The ``rollout_corr/*`` metrics; with correction enabled also ``rollout_is_weights`` / a rejection-masked
    ``response_mask`` in ``batch`` (in place). Nothing when the rollout returned no log-probs."""
    if "rollout_log_probs" not in batch.tensors.keys():
        return {}
    old = batch.tensors["old_log_probs"].float()
    rollout = batch.tensors["rollout_log_probs"].float()
    mask = batch.tensors["response_mask"]
    metrics = compute_mismatch_metrics(old, rollout, mask, cfg.mismatch_log_prob_threshold)
    if cfg.rollout_is is not None:
        weights, is_metrics = compute_rollout_correction(
            old, rollout, mask, cfg.rollout_is_threshold, rollout_is_level=cfg.rollout_is, rollout_is_mode="truncate"
        )
        metrics.update(is_metrics)
        if cfg.rollout_is_batch_normalize:
            weights, metrics["rollout_corr/is_batch_norm_factor"] = _batch_normalize(weights, mask, cfg.rollout_is)
        batch.tensors["rollout_is_weights"] = weights
    if cfg.rollout_rs is not None:
        metrics.update(_reject(batch, old, rollout, cfg))
    return metrics


def _batch_normalize(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, float]:
    """Weights rescaled to mean 1 over the batch's tokens (token level) or sequences (sequence level)."""
    if level == "token":
        mean = masked_mean(weights, mask.to(weights.dtype))
    else:  # every token of a sequence carries the sequence's weight
        seq_mask = (mask.sum(-1) > 0).to(weights.dtype)
        mean = masked_mean(masked_mean(weights, mask.to(weights.dtype), dim=-1), seq_mask)
    factor = float(mean)
    return (weights / factor, factor) if factor > 1e-8 else (weights, 1.0)


def _reject(batch: DataProto, old: torch.Tensor, rollout: torch.Tensor, cfg: RolloutCorrectionConfig) -> dict:
    """Clear ``response_mask`` where the token (or sequence) ratio is outside the ``rollout_rs_threshold`` bounds."""
    assert cfg.rollout_rs is not None  # called only with rollout_rs set
    lower, upper = rs_bounds(cfg)
    mask = batch.tensors["response_mask"]
    kept, rs_metrics = compute_rollout_correction(
        old,
        rollout,
        mask,
        upper,
        rollout_is_mode="mask",
        rollout_is_level=RS_OPTIONS[cfg.rollout_rs],
        rollout_is_threshold_lower=lower,
    )
    keep = kept > 0  # mask mode: the ratio (always > 0) inside the bounds, 0 outside
    valid = mask.bool()
    rejected = valid & ~keep
    batch.tensors["response_mask"] = (mask * keep).to(mask.dtype)
    n_valid = max(int(valid.sum()), 1)
    n_seqs = max(int(valid.any(-1).sum()), 1)
    return {
        "rollout_corr/rs_masked_frac": int(rejected.sum()) / n_valid,
        "rollout_corr/rs_seq_masked_frac": int(rejected.any(-1).sum()) / n_seqs,
        "rollout_corr/rs_ratio_mean": rs_metrics["rollout_corr/is_ratio_mean"],
    }
