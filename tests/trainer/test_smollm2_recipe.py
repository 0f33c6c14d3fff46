"""launch/recipes/smollm2_reasoning_gym.sh, shortened to 2 GRPO steps, on each training backend: the real model
(SmolLM2-135M-Instruct) and a real task (reasoning-gym chain_sum) through the whole stack (Ray, the backend on 2
ranks, vLLM rollout with a weight sync after every update, the task's own scorer, validation).

fsdp with LoRA runs the script itself (vLLM serves the synced adapter); deepspeed and megatron (PP=2: SmolLM2's 9
attention heads, 3 KV heads, rule out TP=2) run the script's own overrides (``PRINT_ONLY=1``: it prepares the model
and data and prints them) in this process, on the session's Ray cluster.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.runs import ROOT, env

pytestmark = pytest.mark.slow

SOURCE = "reasoning_gym/chain_sum"
SHORT = [
    "data.train_batch_size=1",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "data.max_response_length=8",
    "trainer.plot_at_end=false",
]


def recipe(backend: str, lora_rank: int, out, extra: list[str], print_only: bool):
    run_env = dict(env(), PYTHON=sys.executable, BACKEND=backend, LORA_RANK=str(lora_rank), STEPS="2")
    run_env.update(TEST_FREQ="-1", TRAIN_SIZE="12", TEST_SIZE="4", OUT=str(out), PRINT_ONLY="1" if print_only else "")
    proc = subprocess.run(
        [str(ROOT / "launch/recipes/smollm2_reasoning_gym.sh"), *SHORT, *extra],
        env=run_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize(
    "backend,lora_rank,layout",
    [
        ("fsdp", 8, []),
        ("deepspeed", 0, []),
        ("megatron", 0, ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]),
    ],
)
def test_recipe_two_steps(backend, lora_rank, layout, smollm2_dir, ray_cluster, tmp_path):
    from scaletrain.trainer.main_ppo import run

    if lora_rank:  # the script as a user runs it
        recipe(backend, lora_rank, tmp_path, layout, print_only=False)
    else:  # the script's run, in this process
        run(recipe(backend, lora_rank, tmp_path, layout, print_only=True).splitlines())
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
