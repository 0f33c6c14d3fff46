"""DAPO's dynamic sampling in the single controller (layer 4): ``algorithm.filter_groups`` (verl's keys).

A group (the n samples of one prompt, one ``uid``) whose ``metric`` is the same for every sample gives GRPO-family
estimators no signal: all its advantages are 0. With ``filter_groups.enable`` the trainer drops such groups and
draws further generation batches from the data loader until ``data.train_batch_size`` prompts' groups are kept,
then trains on exactly that many (the first ones kept, in generation order).

- ``metric``: ``seq_reward`` (sum of the token-level scores), ``seq_final_reward`` (sum of the token-level rewards;
  equal to the scores here, since the in-reward KL penalty is applied later, so validation refuses it with
  ``use_kl_in_reward``), or any per-sample value the reward function returns in its extra info (``acc``,
  ``score``, ...); a key the reward does not return fails at the first step, naming the keys it does return.
- ``max_num_gen_batches``: at most that many generation batches per step (verl: non-positive = no limit); then
  the step fails, saying how many groups were kept.

Extra batches come from the same ``StatefulDataLoader`` the step's first batch came from, so its position (saved
in every checkpoint) counts every batch consumed and a resumed run continues after them. The step's rollout and
reward metrics are averaged over its generation batches; its timings add up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from scaletrain.protocol import DataProto
from scaletrain.utils.typed_config import ConfigError

if TYPE_CHECKING:
    from scaletrain.trainer.config.ppo_config import FilterGroupsConfig, PPOConfig

logger = logging.getLogger(__name__)

KEY = "algorithm.filter_groups"
# both are sums over the response; the token-level rewards equal the scores when groups are filtered (see above)
SEQ_METRICS = ("seq_reward", "seq_final_reward")


@dataclass
class Scored:
    """One scored generation batch: the rows (B * n, interleaved by prompt), the reward manager's
    ``return_dict`` result for them, and the step metrics the rollout and the reward reported."""

    batch: DataProto
    reward: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)


def validate_filter_groups(cfg: PPOConfig) -> None:
    """ConfigError naming the key for settings dynamic sampling cannot honour (checked before Ray starts)."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    if not fg.metric:
        raise ConfigError(f"{KEY}.metric must name a per-sample value (acc, score, seq_reward, seq_final_reward, ...)")
    n = cfg.actor_rollout_ref.rollout.n
    if n < 2:
        raise ConfigError(
            f"{KEY}.enable drops groups whose samples all agree: set actor_rollout_ref.rollout.n >= 2 (got {n})"
        )
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(
            f"{KEY}.metric=seq_final_reward: groups are filtered before the in-reward KL penalty "
            "exists (algorithm.use_kl_in_reward=true); use seq_reward"
        )


def metric_values(scored: Scored, metric: str) -> np.ndarray:
    """One float per row: the group-filter metric of each sample."""
    if metric in SEQ_METRICS:
        return scored.batch.tensors["token_level_scores"].sum(-1).double().numpy()
    extra = scored.reward.get("reward_extra_info") or {}
    if metric not in extra:
        known = sorted([*SEQ_METRICS, *extra])
        raise ValueError(
            f"{KEY}.metric='{metric}': the reward function returned no such per-sample value; "
            f"available: {', '.join(known)}"
        )
    values = extra[metric]
    if any(v is None for v in values):
        raise ValueError(
            f"{KEY}.metric='{metric}': some samples lack it (the scorer returned it for only part of the batch)"
        )
    return np.asarray(values, dtype=np.float64)


def kept_rows(uids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(row mask of the groups whose metric varies, kept groups, groups). A group with one sample is kept (verl)."""
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    keep = np.zeros(len(uids), dtype=bool)
    kept = 0
    for rows in groups.values():
        if len(rows) == 1 or np.std(values[rows]) > 0:
            keep[rows] = True
            kept += 1
    return keep, kept, len(groups)


def select_scored(scored: Scored, rows: np.ndarray) -> Scored:
    """The given rows (indices or a bool mask) of a scored batch, reward tensor and extra info alike."""
    index = np.flatnonzero(rows) if rows.dtype == bool else rows
    reward = dict(scored.reward)
    reward["reward_tensor"] = scored.reward["reward_tensor"][torch.as_tensor(index, dtype=torch.long)]
    reward["reward_extra_info"] = {
        k: [v[i] for i in index] for k, v in (scored.reward.get("reward_extra_info") or {}).items()
    }
    return Scored(scored.batch.select_idxs(index), reward, scored.metrics)


def concat_scored(parts: list[Scored]) -> Scored:
    """Row-wise concatenation; an extra-info key some parts lack is None on their rows."""
    keys = sorted({k for p in parts for k in (p.reward.get("reward_extra_info") or {})})
    extra: dict[str, list] = {k: [] for k in keys}
    for p in parts:
        info, rows = p.reward.get("reward_extra_info") or {}, len(p.batch)
        for k in keys:
            extra[k] += list(info.get(k, [None] * rows))
    reward = {"reward_tensor": torch.cat([p.reward["reward_tensor"] for p in parts]), "reward_extra_info": extra}
    return Scored(DataProto.concat([p.batch for p in parts]), reward)


def _mean_metrics(all_metrics: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the generation batches that reported it."""
    keys = {k for m in all_metrics for k in m}
    return {k: float(np.mean([m[k] for m in all_metrics if k in m])) for k in keys}


def collect_groups(
    first: DataProto,
    rollout: Callable[[DataProto, int], Scored],
    next_batch: Callable[[], DataProto],
    config: FilterGroupsConfig,
    train_batch_size: int,
) -> tuple[Scored, dict[str, float]]:
    """Generate (``rollout(prompts, gen_index)``), score and filter batches, starting with ``first`` and drawing more
    with ``next_batch()``, until ``train_batch_size`` groups are kept; returns exactly those groups' rows and the
    metrics ``train/num_gen_batches`` and ``train/kept_group_ratio`` (kept / generated groups)."""
    kept_parts, all_metrics = [], []
    kept = generated = 0
    prompts, gen_index = first, 0
    while True:
        scored = rollout(prompts, gen_index)
        all_metrics.append(scored.metrics)
        keep, kept_now, groups = kept_rows(scored.batch.non_tensor_batch["uid"], metric_values(scored, config.metric))
        kept, generated, gen_index = kept + kept_now, generated + groups, gen_index + 1
        kept_parts.append(select_scored(scored, keep))
        if kept >= train_batch_size:
            break
        logger.info(
            "dynamic sampling: %d of %d groups kept after %d generation batches", kept, train_batch_size, gen_index
        )
        if 0 < config.max_num_gen_batches <= gen_index:
            raise RuntimeError(
                f"{KEY}: {gen_index} generation batches ({KEY}.max_num_gen_batches="
                f"{config.max_num_gen_batches}) kept only {kept} of data.train_batch_size="
                f"{train_batch_size} groups whose {config.metric} varies; raise the limit, the "
                "temperature or rollout.n, or check the reward"
            )
        prompts = next_batch()
    merged = concat_scored(kept_parts)
    uids = merged.batch.non_tensor_batch["uid"]
    first_groups = list(dict.fromkeys(uids))[:train_batch_size]  # whole groups, in generation order
    merged = select_scored(merged, np.isin(uids, first_groups))
    merged.metrics = _mean_metrics(all_metrics)
    return merged, {"train/num_gen_batches": float(gen_index), "train/kept_group_ratio": kept / generated}
