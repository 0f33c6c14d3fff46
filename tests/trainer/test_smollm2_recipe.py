"""launch/recipes/smollm2_reasoning_gym.sh, shortened to 2 GRPO steps, on fsdp with LoRA: the
real model (SmolLM2-135M-Instruct) and a real task (reasoning-gym chain_sum) through the whole stack (Ray, the
backend on 2 ranks, vLLM rollout with a weight sync after every update, the task's own scorer, validation)."""

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.test_ppo_resume import ROOT, env

pytestmark = pytest.mark.slow

SOURCE = "reasoning_gym/chain_sum"
SHORT = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.max_response_length=8",
    "trainer.plot_at_end=false",
]


# One run: fsdp with LoRA (vLLM serves the synced adapter on the real model). What the recipe would add on the other
# backends is covered on this model elsewhere, each for a fraction of a recipe run's ~100-150 s: fsdp's
# full-parameter sync into vLLM (tests/workers/test_rollout_mismatch_smollm2.py), every backend's update and
# HF-named export, megatron's PP=2 and TP=3 mapping included (tests/backends/test_real_model_parity.py).
@pytest.mark.parametrize("backend,lora_rank,layout", [("fsdp", 8, [])])
def test_recipe_two_steps(backend, lora_rank, layout, smollm2_dir, tmp_path):
    run_env = dict(
        env(),
        PYTHON=sys.executable,
        BACKEND=backend,
        LORA_RANK=str(lora_rank),
        STEPS="2",
        TEST_FREQ="-1",
        TRAIN_SIZE="12",
        TEST_SIZE="4",
        OUT=str(tmp_path),
    )
    out = subprocess.run(
        [str(ROOT / "launch/recipes/smollm2_reasoning_gym.sh"), *SHORT, *layout],
        env=run_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run_dir = tmp_path / "runs" / (f"chain_sum_{backend}" + (f"_lora{lora_rank}" if lora_rank else ""))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["response_length/mean"] > 0 and 0.0 <= row["critic/score/mean"] <= 1.0
        # vLLM samples with the weights the trainer just synced: the two sides' log-probs agree closely
        assert row["rollout_corr/log_prob_abs_diff_mean"] < 1e-3, row["rollout_corr/log_prob_abs_diff_mean"]
    assert rows[0]["step"] == 0 and f"val/{SOURCE}/acc" in rows[0]  # held-out score before and after
    assert f"val/{SOURCE}/acc" in steps[-1] and f"val-core/{SOURCE}/acc/mean@1" in steps[-1]
    assert os.path.isfile(run_dir / "hf" / "model.safetensors") or any((run_dir / "hf").glob("*.safetensors"))
    if lora_rank:  # the adapter alone went to vLLM (a few MB of the model's 540) and was exported
        assert all(row["perf/weight_sync_bytes"] < 20e6 for row in steps)
        assert (run_dir / "hf" / "adapter_config.json").exists()
