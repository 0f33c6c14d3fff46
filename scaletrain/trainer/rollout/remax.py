"""ReMax's greedy baseline in the single controller (layer 4): ``algorithm.adv_estimator=remax``.

ReMax (Li et al. 2023) subtracts from each sample's return the reward of the greedy response to the same prompt.
For every generation batch the producer therefore decodes one greedy response per prompt (the step's sampling with
n = 1, temperature 0) through the same rollout path as the samples (the worker group's batched generate or the
agent loops, producer.py), scores it with the same reward function and puts
the score, repeated for the prompt's n samples, into the batch as ``reward_baselines``: the input the registered
``remax`` estimator (scaletrain/algos/advantage.py) reads. The greedy responses are not trained on.

Metric ``critic/remax_baseline/mean`` (the greedy responses' mean score); timing ``timing_s/gen_max`` (verl's name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from backends.rollout.base import SamplingConfig
from scaletrain.protocol import DataProto


def greedy_baseline(
    generate: Callable[[DataProto, DataProto, SamplingConfig, str], tuple[DataProto, dict]],
    reward_fn: Any,
    batch: DataProto,
    gen_batch: DataProto,
    sampling: SamplingConfig,
    tag: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward (len(batch),) of one greedy response per prompt row of ``batch`` (the prompts' non-tensor
    fields) / ``gen_batch`` (their ids), generated with ``generate(batch, gen_batch, sampling, tag)`` like the
    samples, with ``sampling`` (the samples') made greedy: n = 1, temperature 0."""
    greedy = replace(sampling, n=1, temperature=0.0)
    out, _ = generate(batch, gen_batch, greedy, f"{tag}-greedy")
    if len(out) != len(batch):
        raise RuntimeError(f"remax: the greedy rollout returned {len(out)} rows for {len(batch)} prompts")
    rows = DataProto(
        batch=out.batch,
        non_tensor_batch={**batch.non_tensor_batch, **out.non_tensor_batch},
        meta_info=dict(out.meta_info),
    )
    scores = reward_fn(rows, return_dict=True)["reward_tensor"].sum(-1).float()
    return scores, {"critic/remax_baseline/mean": scores.mean().item()}
