"""The streaming reward loop: a rollout step's generate + reward time with the trajectories scored after the
generation ends vs each scored as soon as it finishes (``reward.stream``), same reward workers, same verifier.

    python benchmarks/reward_loop.py [--quick]

The step is the trainer's: ``AgentLoopManager.generate_sequences`` runs one agent loop per trajectory, then the
reward loop (scaletrain/trainer/rollout/reward_loop.py: ``reward.num_workers`` Ray actors, each the naive manager)
scores the batch. The task is long-tailed and the verifier slow: each trajectory's generation is a wait drawn from
a log-normal (median 0.15 s, sigma 1: a few trajectories take seconds, as the longest responses of a reasoning
batch do) standing in for the engine, so that both rows see the same finishing times; the verifier sleeps 50 ms
per sample (a sandboxed test run, a symbolic check). Row ``after generation``: ``reward.stream=false`` (the
baseline); row ``streaming``: each finished trajectory sent to a worker at once. Figures are seconds per step
(median of the repeats; lower is better); ratio = streaming / after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from benchmarks.common import emit_results  # noqa: E402
from scaletrain.agent.base import AgentLoopBase, AgentLoopOutput, register_agent_loop  # noqa: E402
from scaletrain.protocol import DataProto  # noqa: E402

RESPONSE, VERIFIER_S, MEDIAN_GEN_S, SIGMA = 8, 0.05, 0.15, 1.0
VERIFIER = f"""
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({VERIFIER_S})  # the verifier's work
    return float(solution_str.strip() == str(ground_truth))
"""


@register_agent_loop("long_tail_bench")
class LongTailLoop(AgentLoopBase):
    """A trajectory whose generation takes a long-tailed time (seeded per sample) and answers "4"."""

    async def run(self, sampling_params, **row) -> AgentLoopOutput:
        rng = random.Random(int(row["sample"]) * 7919 + int(sampling_params.get("seed") or 0))
        await asyncio.sleep(MEDIAN_GEN_S * rng.lognormvariate(0.0, SIGMA))
        answer = self.tokenizer("4", add_special_tokens=False)["input_ids"]
        prompt = self.tokenizer("2+2=", add_special_tokens=False)["input_ids"]
        ids = answer + [self.tokenizer.eos_token_id]
        return AgentLoopOutput(prompt, ids, [1] * len(ids), [0.0] * len(ids))


class NoEngine:
    """The server manager's backend: never asked for tokens (the loop above generates none)."""

    dp_size = 1


def prompts(n_prompts: int) -> DataProto:
    def column(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": column([[{"role": "user", "content": "2+2="}]] * n_prompts),
            "agent_name": column(["long_tail_bench"] * n_prompts),
            "data_source": column(["bench"] * n_prompts),
            "reward_model": column([{"ground_truth": "4"}] * n_prompts),
            "extra_info": column([{}] * n_prompts),
            "uid": column([f"p{i}" for i in range(n_prompts)]),
        }
    )


def step_s(manager, loop, batch: DataProto, n: int, seed: int) -> float:
    """One step's generate + reward, as RolloutProducer.scored runs them."""
    start = time.perf_counter()
    stream = loop.open_stream(batch, n)
    out = manager.generate_sequences(batch, {"seed": seed}, n, f"bench{seed}", stream)
    rows = batch.repeat(n, interleave=True).union(out)
    reward = loop(rows, return_dict=True)
    assert reward["metrics"]["reward/errors"] == 0 and reward["metrics"]["reward/score_mean"] == 1.0
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    n_prompts, n, repeats = (8, 4, 2) if args.quick else (16, 8, 3)

    import ray

    from scaletrain.agent.manager import AgentLoopManager
    from scaletrain.agent.server import AsyncServerManager
    from scaletrain.data import build_embedded_default
    from scaletrain.trainer.rollout.reward_loop import RewardLoop
    from scaletrain.workers.config import MultiTurnConfig
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    work = Path(tempfile.mkdtemp(prefix="bench-reward-loop-"))
    task = build_embedded_default(cache_dir=str(work / "cache"), n_train=16, n_val=4, n_test=4)
    scorer = work / "verifier.py"
    scorer.write_text(VERIFIER)
    ray.init(
        address="local", num_cpus=args.workers + 2, include_dashboard=False, logging_level="ERROR", log_to_driver=False
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task["tokenizer"])
    server = AsyncServerManager(NoEngine())  # pyright: ignore[reportArgumentType]
    config = MultiTurnConfig(default_agent_loop="long_tail_bench")
    manager = AgentLoopManager(config, server, tokenizer, prompt_length=8, response_length=RESPONSE)
    batch = prompts(n_prompts)
    results = {}
    for stream in (False, True):
        overrides = [f"custom_reward_function.path={scorer}", f"reward.num_workers={args.workers}"]
        overrides += [f"reward.stream={str(stream).lower()}", "reward_model.num_processes=1"]
        loop = RewardLoop(checked(*ppo_overrides(task, work / "run", 1, overrides)), tokenizer)
        try:
            step_s(manager, loop, batch, n, seed=0)  # warm-up: the workers' scorer processes start
            results[stream] = statistics.median(step_s(manager, loop, batch, n, seed=s) for s in range(1, repeats + 1))
        finally:
            loop.close()
    ray.shutdown()
    after, streaming = results[False], results[True]
    setup = f"{n_prompts} prompts x {n} samples, {args.workers} reward workers, verifier {VERIFIER_S * 1e3:g} ms"
    print(f"\nreward loop: {setup}")
    print(f"{'measure':<28}{'s/step':>9}{'ratio':>9}")
    print(f"{'after generation':<28}{after:>9.3f}{'':>9}")
    print(f"{'streaming':<28}{streaming:>9.3f}{streaming / after:>8.2f}x")
    emit_results([("generate + reward, streaming", streaming, after, "after generation")], unit="s")


if __name__ == "__main__":
    main()
