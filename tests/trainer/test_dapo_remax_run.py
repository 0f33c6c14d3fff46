"""The trainer (an in-process run of the CLI's) with ReMax's greedy baseline, DAPO's dynamic sampling and
overlong filtering in one run.

The reward hashes the response text: ``score`` in [0, 1) and ``acc`` its parity, so about half the groups of 2
samples agree on ``acc`` (dropped by dynamic sampling, so steps need several generation batches) while every kept
group also varies in score. Responses of at most 4 tokens from the tiny model mostly run into the limit (masked by
overlong filtering). One run covers the three features (and ReMax's baseline surviving the group filtering).
"""

import json
import math

import pytest

from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    h = sum(map(ord, solution_str))
    return {"score": h % 97 / 97, "acc": bool(h % 2)}
"""
QUIET = [
    "trainer.val_before_train=false",
    "data.val_files=null",
    "trainer.save_freq=-1",
    "trainer.plot_at_end=false",
    "trainer.save_hf_at_end=false",
]
ROWS = 8  # 4 prompts x 2 samples


def test_remax_dynamic_sampling_and_overlong_filtering(ray_cluster, task, tmp_path):
    reward, run_dir = tmp_path / "reward.py", tmp_path / "run"
    reward.write_text(REWARD)
    overrides = [
        *QUIET,
        f"custom_reward_function.path={reward}",
        "algorithm.adv_estimator=remax",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=12",
        "algorithm.filter_overlong_responses=true",
    ]
    run_in_process(task, run_dir, 3, overrides)
    steps = metrics(run_dir)
    assert sorted(steps) == [1, 2, 3]
    # save_freq=-1 and a run shorter than trainer.save_freq_minutes (30): one checkpoint, at the end
    assert [p.name for p in run_dir.glob("global_step_*")] == ["global_step_3"]
    for m in steps.values():
        # ReMax: the greedy responses were scored and subtracted from every token's return (the row's score)
        baseline = m["critic/remax_baseline/mean"]
        assert math.isfinite(baseline) and 0 <= baseline < 1 and m["timing_s/gen_max"] > 0
        if "critic/advantages/mean" in m:  # absent when overlong filtering masked every response of the step
            assert m["critic/advantages/mean"] != pytest.approx(m["critic/returns/mean"], abs=1e-6)
        # dynamic sampling: only groups whose acc varies were trained on
        assert m["critic/mixed_reward_groups"] == 1.0
        assert 1 <= m["train/num_gen_batches"] <= 12 and 0 < m["train/kept_group_ratio"] <= 1
        # overlong filtering; the ratio's denominator shows the batch was trimmed to exactly 4 groups of 2
        masked = m["train/overlong_masked"]
        assert 0 < masked <= ROWS and m["train/overlong_masked_ratio"] == masked / ROWS
        assert math.isfinite(m["actor/pg_loss"])
    assert any(m["train/num_gen_batches"] > 1 and m["train/kept_group_ratio"] < 1 for m in steps.values())
    assert any("critic/advantages/mean" in m for m in steps.values())
    # the data loader's saved position counts every generation batch, so a resume continues after all of them
    state = json.loads((run_dir / "global_step_3" / "trainer_state.json").read_text())["dataloader"]
    assert state["epoch"] * 100 + state["batches_in_epoch"] == sum(m["train/num_gen_batches"] for m in steps.values())
