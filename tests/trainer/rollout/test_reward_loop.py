"""The reward loop (scaletrain/trainer/rollout/reward_loop.py) on the session's Ray cluster: reward workers score a
batch split among them exactly as the driver's manager scores it whole (scores, extra info, failures counted); a
streamed generate's trajectories are collected by the call on their batch and by no other; a worker that dies
fails the call naming the key; a batch-at-once manager is refused before Ray; and a CLI run of the agent loops
streaming its trajectories to reward workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.reward.conftest import _make_batch
from tests.trainer.config.test_ppo_config import checked

SCORER = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "99":
        raise ValueError("the scorer fails on 99")
    if solution_str.startswith("1"):
        return {"score": float(solution_str == ground_truth), "ones": 1.0}
    return float(solution_str == ground_truth)
"""
RESPONSES = ["12", "13", "99", "7", "12", "5", "99", "17"]


@pytest.fixture
def setup(task, tmp_path):
    from transformers import AutoTokenizer

    from tests.trainer.runs import ppo_overrides

    path = tmp_path / "scorer.py"
    path.write_text(SCORER)

    def config(*extra):
        overrides = [f"custom_reward_function.path={path}", "reward_model.num_processes=1", *extra]
        return checked(*ppo_overrides(task, tmp_path / "run", 1, overrides))

    tokenizer = AutoTokenizer.from_pretrained(task["tokenizer"])
    rows = [{"prompt": "1+1=", "response": r, "ground_truth": "12"} for r in RESPONSES]
    batch = _make_batch(tokenizer, rows)
    batch.non_tensor_batch["uid"] = np.array([f"1-{i // 2}" for i in range(len(rows))], dtype=object)
    return config, tokenizer, batch


def test_workers_score_a_split_batch_as_the_driver_scores_it_whole(ray_cluster, setup):
    from scaletrain.trainer.rollout.reward_loop import RewardLoop, build_rule_reward

    config, tokenizer, batch = setup
    cfg = config("reward.num_workers=3")
    with build_rule_reward(cfg, tokenizer) as driver:
        expected = driver(batch, return_dict=True)
    loop = RewardLoop(cfg, tokenizer)
    try:
        got = loop(batch, return_dict=True)
        assert loop._turn == 3  # 8 rows as 3 + 3 + 2
        assert "the scorer fails on 99" in (loop.last_error or "") and "scorer.py" in loop.scorer_repr
    finally:
        loop.close()
    assert torch.equal(got["reward_tensor"], expected["reward_tensor"])
    assert got["reward_extra_info"] == expected["reward_extra_info"]  # "ones" None where a part's rows lack it
    for key in ("reward/errors", "reward/timeouts", "reward/failed_fraction", "reward/score_mean"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key]), key
    assert got["metrics"]["reward/errors"] == 2 and got["metrics"]["reward/streamed"] == 0.0


def test_a_streamed_generate_is_collected_by_its_batch_and_no_other(ray_cluster, setup):
    """Each trajectory is sent as it finishes (here: in reverse order); a ReMax-like call on another batch in
    between is scored on its own and leaves the stream waiting; the call on the streamed batch sends nothing new."""
    from scaletrain.trainer.rollout.reward_loop import RewardLoop

    config, tokenizer, batch = setup
    loop = RewardLoop(config("reward.num_workers=2"), tokenizer)
    try:
        whole = loop(batch, return_dict=True)
        from scaletrain.protocol import DataProto

        firsts = list(range(0, len(batch), 2))  # a prompt per 2 samples: its fields, as the producer holds them
        prompts = DataProto.from_dict(non_tensors={k: v[firsts] for k, v in batch.non_tensor_batch.items()})
        trajectories = DataProto.from_dict(dict(batch.tensors.items()))  # what the agent loops return
        stream = loop.open_stream(prompts, 2)
        assert stream is not None
        for sample in reversed(range(len(batch))):
            stream(sample, trajectories.select_idxs([sample]))
        sent = loop._turn
        other = batch.select_idxs([0, 1])  # not the streamed batch: scored by itself, a row per worker
        assert loop(other, return_dict=True)["metrics"]["reward/streamed"] == 0.0 and loop._turn == sent + 2
        streamed = loop(batch, return_dict=True)
        assert loop._turn == sent + 2 and streamed["metrics"]["reward/streamed"] == 1.0
        assert torch.equal(streamed["reward_tensor"], whole["reward_tensor"])
        assert streamed["reward_extra_info"] == whole["reward_extra_info"]
        assert streamed["metrics"]["reward/errors"] == 2
        assert loop(batch, return_dict=True)["metrics"]["reward/streamed"] == 0.0  # collected once
    finally:
        loop.close()


def test_a_dead_worker_fails_the_call_naming_the_key(ray_cluster, setup):
    import ray

    from scaletrain.trainer.rollout.reward_loop import RewardLoop

    config, tokenizer, batch = setup
    loop = RewardLoop(config("reward.num_workers=2", "reward.stream=false"), tokenizer)
    try:
        assert loop.open_stream(batch, 1) is None  # reward.stream off
        ray.kill(loop.workers[1])
        with pytest.raises(RuntimeError, match=r"a reward worker \(reward.num_workers\) failed"):
            loop(batch, return_dict=True)
    finally:
        loop.close()


def test_reward_workers_need_a_manager_scoring_each_sample_alone(setup):
    from scaletrain.utils.typed_config import ConfigError

    config, _, _ = setup
    with pytest.raises(ConfigError, match=r"reward_model.reward_manager=batch scores a whole batch at once"):
        config("reward.num_workers=2", "reward_model.reward_manager=batch")
    with pytest.raises(ConfigError, match=r"reward.num_workers must be >= 0"):
        config("reward.num_workers=-1")


@pytest.mark.slow
def test_an_agent_loop_run_scored_by_reward_workers_as_each_trajectory_finishes(ray_cluster, task, tmp_path):
    """The embedded default on the agent loops (rollout.mode=async), one step, its reward scored by 2 reward
    workers, each trajectory as it finishes: the step's rows all came through the stream. (Scoring after the
    generation, reward.stream=false, is the split batch of the tests above.)"""
    from tests.trainer.runs import metrics, run_in_process

    overrides = ["rollout=hf", "actor_rollout_ref.rollout.mode=async", "reward.num_workers=2"]
    overrides += ["trainer.save_freq=-1", "trainer.test_freq=-1"]
    result = run_in_process(task, tmp_path / "run", 1, overrides)
    logged = metrics(result.run_dir)[1]
    assert logged["reward/streamed"] == 1.0
    assert logged["reward/errors"] == 0 and 0.0 <= logged["reward/score_mean"] <= 1.0
