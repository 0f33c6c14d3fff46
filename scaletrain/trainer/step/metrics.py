"""Step metrics the driver logs (layer 4): data statistics, phase timings, throughput and MFU.

Names follow verl's: ``critic/score/*``, ``critic/rewards/*``, ``critic/advantages/*``, ``response_length/*``,
``prompt_length/*``, ``timing_s/<phase>``, ``perf/throughput`` (tokens per second per device) and
``perf/mfu/actor`` (model FLOPs of the actor update / (time x peak FLOP/s of the devices)).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from scaletrain.protocol import DataProto


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def data_metrics(batch: DataProto) -> dict[str, float]:
    mask = batch.tensors["response_mask"].bool()
    resp_len = mask.sum(-1)
    prompt_len = batch.tensors["attention_mask"][:, : -mask.shape[1]].sum(-1)
    max_resp = mask.shape[1]
    metrics = {
        **_stats("critic/score", batch.tensors["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch.tensors["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch.tensors["advantages"][mask]),
        **_stats("critic/returns", batch.tensors["returns"][mask]),
        **_stats("response_length", resp_len),
        "response_length/clip_ratio": (resp_len >= max_resp).float().mean().item(),
        **_stats("prompt_length", prompt_len),
    }
    if "values" in batch.tensors.keys():
        metrics.update(_stats("critic/values", batch.tensors["values"][mask]))
    if "uid" in batch.non_tensor_batch:
        metrics["critic/mixed_reward_groups"] = mixed_group_share(batch)
    return metrics


def reward_groups(batch: DataProto) -> dict[str, list[float]]:
    """Each group's (prompt's, by ``uid``) sample scores; {} without a ``uid`` column."""
    if "uid" not in batch.non_tensor_batch:
        return {}
    groups: dict[str, list[float]] = {}
    for uid, score in zip(batch.non_tensor_batch["uid"], batch.tensors["token_level_scores"].sum(-1).tolist()):
        groups.setdefault(uid, []).append(score)
    return groups


def mixed_group_share(batch: DataProto) -> float:
    """Share of prompts whose samples got different scores: the groups GRPO can learn from."""
    groups = reward_groups(batch).values()
    return sum(len({round(s, 6) for s in g}) > 1 for g in groups) / max(1, len(groups))


def throughput_metrics(
    batch: DataProto, timings: dict[str, float], world_size: int, actor_params: int, peak_flops: float | None
) -> dict[str, float]:
    tokens = int(batch.tensors["attention_mask"].sum())
    metrics = {"perf/total_num_tokens": float(tokens)}
    step_s = timings.get("step")
    if step_s:
        metrics["perf/throughput"] = tokens / step_s / world_size
    update_s = timings.get("update_actor")
    if update_s and peak_flops and actor_params:
        # 6 N FLOPs per trained token (forward + backward), a standard dense-model estimate
        metrics["perf/mfu/actor"] = 6 * actor_params * tokens / update_s / (peak_flops * world_size)
    return metrics


def count_params(path: str) -> int:
    """Parameters of the HF causal LM (or vision-language model) at ``path`` (built on the meta device: no memory,
    no weights read)."""
    from transformers import AutoConfig

    from backends.vision import causal_lm_class

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = causal_lm_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    return {f"timing_s/{name}": seconds for name, seconds in timings.items()}


_GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def device_peak_flops(device: str) -> float:
    """Peak FLOP/s of one device: a table for known GPUs; on CPU, a short fp32 matmul measurement."""
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in _GPU_PEAK_BF16.items():
            if key in name:
                return value
        return 100e12
    a = torch.randn(512, 512)
    torch.mm(a, a)
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        torch.mm(a, a)
    return 2 * 512**3 * reps / (time.perf_counter() - start)
