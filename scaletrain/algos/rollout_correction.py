"""Rollout correction: importance weights for the mismatch between the rollout engine and the trainer.

The rollout engine (vLLM, ...) samples with its own kernels and precision, so its log-probs
(``rollout_log_probs``) differ from the trainer's recomputation of the same policy (``old_log_prob``). The
training objective assumes samples from the trainer's policy; weighting each token (or sequence) by
pi_train / pi_rollout corrects for that. Weights are truncated (TIS: min(w, threshold)) or tokens outside
[lower, threshold] are masked out (weight 0). Pass the weights to a policy loss as ``rollout_is_weights``.

Mismatch metrics (``rollout_corr/*``): KL(pi_rollout || pi_train) estimated with k1 and k3, the mean / max
absolute log-prob difference (and the share of tokens above a threshold), the importance ratio's mean / max /
min, the truncated or masked share, the effective sample size, and the perplexities of the responses under
both policies. The trainer applies all this per step in ``scaletrain/trainer/step/rollout_correction.py``.
"""

from __future__ import annotations

import torch

from scaletrain.algos.masked import masked_mean

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


@torch.no_grad()
def compute_mismatch_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    log_prob_diff_threshold: float | None = None,
) -> dict:
    """KL, log-prob difference and perplexity metrics comparing the trainer's and the rollout engine's log-probs.

    ``rollout_corr/log_prob_abs_diff_mean|max`` are over the response tokens of |log pi_train - log pi_rollout|;
    with ``log_prob_diff_threshold``, ``rollout_corr/log_prob_abs_diff_above_threshold_frac`` is the share of
    tokens whose difference exceeds it. Floats; 0 when the mask is empty.
    """
    mask = response_mask.to(old_log_prob.dtype)
    valid = mask.bool()
    log_ratio = old_log_prob - rollout_log_probs  # log(pi_train / pi_rollout)
    k1 = masked_mean(-log_ratio, mask)  # E_rollout[log pi_rollout - log pi_train]
    clamped = log_ratio.clamp(-20.0, 20.0)
    k3 = masked_mean(torch.exp(clamped) - 1.0 - clamped, mask)
    abs_diff = log_ratio.abs()
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    train_ppl = torch.exp(-masked_mean(old_log_prob, mask, dim=-1))
    rollout_ppl = torch.exp(-masked_mean(rollout_log_probs, mask, dim=-1))
    metrics = {
        "rollout_corr/kl_k1": float(k1),
        "rollout_corr/kl_k3": float(k3),
        "rollout_corr/log_prob_abs_diff_mean": float(masked_mean(abs_diff, mask)),
        "rollout_corr/log_prob_abs_diff_max": float(abs_diff[valid].max()) if valid.any() else 0.0,
        "rollout_corr/training_ppl": float(masked_mean(train_ppl, has_tokens)),
        "rollout_corr/rollout_ppl": float(masked_mean(rollout_ppl, has_tokens)),
        "rollout_corr/ppl_ratio": float(masked_mean(train_ppl / rollout_ppl, has_tokens)),
    }
    if log_prob_diff_threshold is not None:
        above = (abs_diff > log_prob_diff_threshold).to(mask.dtype)
        metrics["rollout_corr/log_prob_abs_diff_above_threshold_frac"] = float(masked_mean(above, mask))
    return metrics


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_threshold: float = 2.0,
    rollout_is_level: str = "token",
    rollout_is_mode: str = "truncate",
    rollout_is_threshold_lower: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Importance weights pi_train / pi_rollout (batch, response_length), detached, 0 at masked positions.

    - ``rollout_is_level="token"``: one ratio per token; ``"sequence"``: the product of a sequence's token
      ratios (exp of the summed log-ratio, clamped to [-20, 20]) broadcast over its tokens.
    - ``rollout_is_mode="truncate"``: w = min(w, threshold); ``"mask"``: w is kept inside
      [lower, threshold] and set to 0 outside (lower defaults to 1 / threshold).

    Returns (weights, metrics); metrics are the mismatch metrics plus ``rollout_corr/is_ratio_mean|max|min``
    (before truncation, over tokens or sequences by level), ``rollout_corr/is_truncated_frac`` or
    ``rollout_corr/is_masked_frac``, and ``rollout_corr/is_ess``
    ((sum w)**2 / (n sum w**2) of the final weights, in (0, 1]).
    """
    lower, upper = _is_bounds(rollout_is_level, rollout_is_mode, rollout_is_threshold, rollout_is_threshold_lower)
    keep = response_mask.bool()
    log_ratio = torch.where(keep, (old_log_prob - rollout_log_probs).float(), 0.0)
    if rollout_is_level == "token":
        unit_mask, unit_raw = keep, torch.exp(log_ratio.clamp(-20.0, 20.0))  # one unit per token
    else:
        unit_mask, unit_raw = keep.any(-1), torch.exp(log_ratio.sum(-1).clamp(-20.0, 20.0))  # one per sequence

    if rollout_is_mode == "truncate":
        unit_w = unit_raw.clamp(max=upper)
        cut, cut_name = unit_raw > upper, "rollout_corr/is_truncated_frac"
    else:
        inside = (unit_raw >= lower) & (unit_raw <= upper)
        unit_w = torch.where(inside, unit_raw, 0.0)
        cut, cut_name = ~inside, "rollout_corr/is_masked_frac"
    weights = unit_w if rollout_is_level == "token" else unit_w[:, None].expand_as(log_ratio)
    weights = torch.where(keep, weights, 0.0)

    metrics = compute_mismatch_metrics(old_log_prob.float(), rollout_log_probs.float(), keep)
    metrics.update(_is_weight_metrics(unit_raw[unit_mask], unit_w[unit_mask], cut[unit_mask], cut_name))
    return weights, metrics


def _is_bounds(level: str, mode: str, threshold: float, threshold_lower: float | None) -> tuple[float, float]:
    """(lower, upper) bounds of the importance weights, after checking the level, mode and thresholds."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is_level '{level}'; expected one of: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown rollout_is_mode '{mode}'; expected one of: {', '.join(IS_MODES)}")
    upper = float(threshold)
    lower = 1.0 / upper if threshold_lower is None else float(threshold_lower)
    if upper <= 0 or lower < 0 or lower > upper:
        raise ValueError(f"need 0 <= lower <= threshold and threshold > 0, got lower={lower}, threshold={upper}")
    return lower, upper


def _is_weight_metrics(raw: torch.Tensor, weights: torch.Tensor, cut: torch.Tensor, cut_name: str) -> dict:
    """Ratio mean / max / min (before truncation), the share ``cut`` (truncated or masked) and the effective
    sample size of the final weights, over the valid units (tokens or sequences); all 0 when there are none."""
    if raw.numel() == 0:
        names = ("is_ratio_mean", "is_ratio_max", "is_ratio_min")
        return {**{f"rollout_corr/{n}": 0.0 for n in names}, cut_name: 0.0, "rollout_corr/is_ess": 0.0}
    return {
        "rollout_corr/is_ratio_mean": float(raw.mean()),
        "rollout_corr/is_ratio_max": float(raw.max()),
        "rollout_corr/is_ratio_min": float(raw.min()),
        cut_name: float(cut.float().mean()),
        "rollout_corr/is_ess": float(weights.sum() ** 2 / (weights.numel() * weights.square().sum()).clamp(min=1e-12)),
    }


def rs_ratio_bounds(spec: str | float) -> tuple[float, float]:
    """(lower, upper) ratio bounds of a rejection threshold: "lower_upper" (e.g. "0.5_2.0"), or one upper bound
    (lower = 1 / upper). ValueError unless 0 < lower <= 1 <= upper (a token both sides agree on is never rejected)."""
    parts = str(spec).split("_") if isinstance(spec, str) else [spec]
    try:
        values = [float(p) for p in parts]
    except (TypeError, ValueError):
        values = []
    if len(values) not in (1, 2):
        raise ValueError(f'expected "lower_upper" or a number, got {spec!r}')
    upper = values[-1]
    lower = values[0] if len(values) == 2 else (1.0 / upper if upper > 0 else 0.0)
    if not 0.0 < lower <= 1.0 <= upper < float("inf"):
        raise ValueError(f"need 0 < lower <= 1 <= upper, got lower={lower}, upper={upper} (from {spec!r})")
    return lower, upper
