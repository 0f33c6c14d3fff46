"""DAPO's overlong filtering in the single controller (layer 4): ``algorithm.filter_overlong_responses``.

A response cut off at ``data.max_response_length`` before it produced an EOS token is unfinished, so its reward
judges a partial answer. DAPO (Yu et al. 2025) masks such samples out of the loss instead. With the key set, each
step clears ``response_mask`` on the truncated rows right after the old log-probs (where rollout rejection sampling
clears it too), so the advantages, the policy / KL / entropy / value losses and the response-length metrics skip
them; their scores still enter their group's reward statistics (GRPO's mean and std are taken over the scores).

verl has no key for this (its DAPO recipe leaves overlong filtering out), hence a name in verl's style (next to
``data.filter_overlong_prompts``). The overlong reward *shaping* (DAPO's overlong buffer) is the ``dapo`` reward
manager's and independent of this key.

Metrics: ``train/overlong_masked`` (responses masked this step) and ``train/overlong_masked_ratio``.
"""

from __future__ import annotations

import torch

from scaletrain.protocol import DataProto


def truncated_rows(batch: DataProto, eos_ids: list[int]) -> torch.Tensor:
    """Bool (rows,): the response fills its last position (``attention_mask``) with a token that is no EOS."""
    last_token = batch.tensors["responses"][:, -1]
    filled = batch.tensors["attention_mask"][:, -1].bool()
    return filled & ~torch.isin(last_token, torch.tensor(eos_ids, dtype=last_token.dtype))


def mask_overlong_responses(batch: DataProto, eos_ids: list[int]) -> dict[str, float]:
    """Clear ``response_mask`` (in place) on the truncated rows; returns the masked count and share."""
    truncated = truncated_rows(batch, eos_ids)
    mask = batch.tensors["response_mask"]
    batch.tensors["response_mask"] = mask * (~truncated).to(mask.dtype)[:, None]
    return {
        "train/overlong_masked": float(truncated.sum()),
        "train/overlong_masked_ratio": truncated.float().mean().item(),
    }
