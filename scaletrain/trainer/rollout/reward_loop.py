"""The reward loop (layer 4): the rule reward scored off the driver by ``reward.num_workers`` Ray actors, each
trajectory scored as soon as it finishes where the agent loops generate (``reward.stream``).

``build_rule_reward(cfg, tokenizer)`` is the reward manager a config asks for (``reward_model.reward_manager``,
``custom_reward_function``, the judge and the code sandbox); the driver scores with it itself when
``reward.num_workers`` is 0 (the manager's own worker processes, ``reward_model.num_processes``, run the scorer).
With ``reward.num_workers`` = N > 0, ``RewardLoop`` stands in for it (same interface: ``loop(batch,
return_dict=True)``, ``scorer_repr``, ``last_error``, ``close``): N ``RewardWorker`` actors (1 CPU each, anywhere in
the cluster) each build that manager, and a batch is split among them, scored at once and joined in order, the
metrics merged as one call's (counts summed, fractions and means over all rows).

Streaming: ``open_stream(prompts, n)`` before an agent-loop generate returns the callback the loops call with each
finished trajectory; the trajectory (joined with its prompt's fields, as the batch will hold it) goes to a worker
at once, so scoring overlaps the generation still going on. The next call whose batch is those trajectories (the
same uids and responses, row for row) collects the results instead of scoring again; any other call (a ReMax greedy
pass, validation) scores its own batch and leaves the stream waiting. Scoring one row at a time gives what the
whole batch would: only managers that score each sample on its own stream or split (not ``batch``, nor a manager
written for verl's batch interface: refused before Ray, naming the key).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.protocol import DataProto
from scaletrain.reward import build_reward_manager
from scaletrain.reward.judge import Judge
from scaletrain.reward.sandbox_fusion import SandboxFusion
from scaletrain.utils.typed_config import to_dict

if TYPE_CHECKING:
    from scaletrain.trainer.config.ppo_config import PPOConfig

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # reward workers that have not started by then: the cluster lacks a CPU for them
COUNTED = ("reward/errors", "reward/timeouts", "reward/worker_restarts")  # summed over the workers' calls
COUNTED_PREFIXES = ("judge/", "sandbox_fusion/")


def build_rule_reward(cfg: PPOConfig, tokenizer: Any, judge_url: str | None = None):
    """The reward manager of ``cfg`` (the driver's, or each reward worker's); ``judge_url``: the run's own judge
    endpoint (a generative reward model, judge_engines.py), the judge's base_url in place of reward.judge.base_url."""
    rm = cfg.reward_model
    judge = replace(cfg.reward.judge, base_url=judge_url) if judge_url else cfg.reward.judge
    return build_reward_manager(
        tokenizer,
        rm.reward_manager,
        to_dict(cfg.custom_reward_function),
        load_timeout_s=rm.load_timeout_s,
        offered={  # to a manager that takes them (one written for verl may not)
            "compute_score_timeout": rm.timeout_s,
            "num_processes": rm.num_processes,
            "step_timeout_s": rm.step_timeout_s,
            "max_resp_len": cfg.data.max_response_length,  # DAPO's overlong buffer
            "reward_fn_key": cfg.data.reward_fn_key,
        },
        judge=Judge(judge) if judge.enabled else None,
        sandbox=SandboxFusion(cfg.reward.sandbox_fusion) if cfg.reward.sandbox_fusion.enabled else None,
        **rm.reward_kwargs,
    )


class RewardWorker:
    """One reward worker (a Ray actor): the config's reward manager, scoring the rows it is sent."""

    def __init__(self, cfg: PPOConfig, tokenizer: Any, judge_url: str | None = None) -> None:
        self.manager = build_rule_reward(cfg, tokenizer, judge_url)

    def describe(self) -> str:
        return self.manager.scorer_repr

    def score(self, batch: DataProto) -> tuple[dict[str, Any], str | None]:
        """(the manager's reward dict, its last failure's text or None)."""
        reward = self.manager(batch, return_dict=True)
        assert isinstance(reward, dict)  # return_dict
        return reward, self.manager.last_error

    def close(self) -> None:
        self.manager.close()


class RewardStream:
    """One generate call's trajectories, each sent to a reward worker as it finishes (module docstring)."""

    def __init__(self, loop: RewardLoop, prompts: DataProto, n: int) -> None:
        self.loop, self.prompts, self.n = loop, prompts, n
        self.sent: dict[int, tuple[Any, torch.Tensor]] = {}  # sample -> (the worker's result, its responses)

    def __call__(self, sample: int, trajectory: DataProto) -> None:
        """Score ``trajectory`` (one row: sample ``sample`` of the generate call) now."""
        row = self.prompts.select_idxs([sample // self.n]).union(trajectory)
        self.sent[sample] = (self.loop.submit(row), trajectory.tensors["responses"][0])

    def matches(self, batch: DataProto) -> bool:
        """Whether ``batch`` is this call's trajectories, row for row."""
        if len(batch) != len(self.sent) or sorted(self.sent) != list(range(len(batch))):
            return False
        uids = batch.non_tensor_batch.get("uid")
        prompt_uids = self.prompts.non_tensor_batch.get("uid")
        if uids is None or prompt_uids is None:
            return False
        responses = batch.tensors["responses"]
        same = (
            uids[i] == prompt_uids[i // self.n] and torch.equal(responses[i], self.sent[i][1])
            for i in range(len(batch))
        )
        return all(same)


class RewardLoop:
    """``reward.num_workers`` reward workers behind a reward manager's interface (module docstring)."""

    def __init__(self, cfg: PPOConfig, tokenizer: Any, judge_url: str | None = None) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        worker = ray.remote(num_cpus=1)(RewardWorker)
        self.workers = [worker.remote(cfg, tokenizer, judge_url) for _ in range(cfg.reward.num_workers)]
        self.streaming = cfg.reward.stream
        self.last_error: str | None = None
        self._turn = 0
        self._stream: RewardStream | None = None
        try:
            reprs = ray.get([w.describe.remote() for w in self.workers], timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"the {len(self.workers)} reward workers (reward.num_workers, 1 CPU each) did not start within "
                f"{START_TIMEOUT_S:g} s: the Ray cluster has no free CPU for them"
            ) from None
        self.scorer_repr = reprs[0]

    def submit(self, rows: DataProto) -> Any:
        """The next worker (in turn) scores ``rows``; returns the result's reference."""
        worker = self.workers[self._turn % len(self.workers)]
        self._turn += 1
        return worker.score.remote(rows)

    def open_stream(self, prompts: DataProto, n: int) -> Callable[[int, DataProto], None] | None:
        """The per-trajectory callback of a generate call over ``prompts`` (``n`` samples each), or None when
        ``reward.stream`` is off."""
        if not self.streaming:
            return None
        self._stream = RewardStream(self, prompts, n)
        return self._stream

    def __call__(self, batch: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        start = time.perf_counter()
        stream = self._stream
        streamed = stream is not None and stream.matches(batch)
        if stream is not None and streamed:
            refs = [stream.sent[i][0] for i in range(len(batch))]
            self._stream = None
        else:
            size = math.ceil(len(batch) / len(self.workers)) if len(batch) else 1
            refs = [self.submit(part) for part in batch.split(size)]
        try:
            results = ray.get(refs)
        except (RayActorError, RayTaskError) as e:
            raise RuntimeError(f"a reward worker (reward.num_workers) failed: {e}") from e
        reward = merged([out for out, _ in results], time.perf_counter() - start, batch.tensors["responses"].shape[1])
        reward["metrics"]["reward/streamed"] = float(streamed)  # 1: scored as the trajectories finished
        errors = [error for _, error in results if error]
        if errors:
            self.last_error = errors[-1]
        return reward if return_dict else reward["reward_tensor"]

    def close(self) -> None:
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception as e:  # a worker that died or hangs is killed below all the same
            logger.warning("reward workers did not close cleanly: %s", e)
        for w in self.workers:
            ray.kill(w)  # pyright: ignore[reportArgumentType] (a handle; ray's stubs type it as the class's proxy)
        self.workers = []


def merged(parts: list[dict[str, Any]], seconds: float, width: int) -> dict[str, Any]:
    """The reward dicts of consecutive parts of a batch as one call's: tensors and extra info joined in order
    (None where a part's rows lack a key), counts summed, other metrics averaged over rows (``/max``, ``/min``:
    the extreme), ``reward/failed_fraction`` and ``reward/score_mean`` over all rows."""
    tensors = [p["reward_tensor"] for p in parts]
    reward_tensor = torch.cat(tensors) if tensors else torch.zeros(0, width)
    sizes = [len(t) for t in tensors]
    extra: dict[str, list] = {}
    for key in {k for p in parts for k in p.get("reward_extra_info", {})}:
        extra[key] = [v for p, n in zip(parts, sizes) for v in p.get("reward_extra_info", {}).get(key, [None] * n)]
    rows = sum(sizes)
    metrics: dict[str, float] = {}
    for key in {k for p in parts for k in p["metrics"]}:
        values = [(p["metrics"][key], n) for p, n in zip(parts, sizes) if key in p["metrics"]]
        if key in COUNTED or key.startswith(COUNTED_PREFIXES):
            metrics[key] = float(sum(v for v, _ in values))
        elif key.endswith("/max"):
            metrics[key] = float(max(v for v, _ in values))
        elif key.endswith("/min"):
            metrics[key] = float(min(v for v, _ in values))
        else:
            weight = sum(n for _, n in values)
            metrics[key] = float(sum(v * n for v, n in values) / weight) if weight else 0.0
    failed = metrics.get("reward/errors", 0.0) + metrics.get("reward/timeouts", 0.0)
    metrics["reward/failed_fraction"] = failed / rows if rows else 0.0
    metrics["reward/score_mean"] = reward_tensor.sum(-1).mean().item() if rows else 0.0
    metrics["reward/seconds"] = seconds
    return {"reward_tensor": reward_tensor, "reward_extra_info": extra, "metrics": metrics}
