"""A reward model in the PPO loop (an in-process run of the CLI's, 2 steps, the embedded task and model on fsdp).

The RM is a tiny sequence classifier over tests/backends/tiny.py's character vocabulary with its own chat template,
not the policy's 16-token one, so ``reward_model.model.input_tokenizer`` (the policy's tokenizer) makes the worker
decode each rollout and re-render it with the RM's template. A custom reward function giving 0.5 to every sample
makes the step's reward exactly RM score + 0.5; each dumped sample's RM score is recomputed here with transformers
on the text the RM's template renders.
"""

import json

import pytest
import torch

from tests.trainer.rollout.test_rm_reward import save_char_rm
from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow

RULE = 0.5
REWARD_FILE = f"""
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {RULE}
"""


def test_reward_model_scores_reach_the_reward(ray_cluster, task, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tests.backends.tiny import vocab

    rm_path = save_char_rm(tmp_path / "rm")
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    run_dir, dumps = tmp_path / "run", tmp_path / "rollouts"
    overrides = [
        "trainer.val_before_train=false",
        "data.val_files=null",
        "trainer.save_freq=-1",
        "trainer.plot_at_end=false",
        "trainer.save_hf_at_end=false",
        f"trainer.rollout_data_dir={dumps}",
        f"custom_reward_function.path={reward_file}",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_path}",
        f"reward_model.model.input_tokenizer={task['tokenizer']}",
        "reward_model.micro_batch_size_per_gpu=3",
    ]
    run_in_process(task, run_dir, 2, overrides)

    logged = metrics(run_dir)
    model, chars = AutoModelForSequenceClassification.from_pretrained(rm_path), vocab()
    for step in (1, 2):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 8  # 4 prompts x n=2
        with torch.no_grad():
            for row in rows:
                text = f"<user>{row['input']}<assistant>{row['output']}"  # tiny.py's chat template, by hand
                ids = [chars[c] for c in text]  # one token per character
                expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
                assert row["rm_score"] == pytest.approx(expected, abs=1e-4), row
                assert row["score"] == pytest.approx(expected + RULE, abs=1e-5)  # rule + RM, exactly
        rm_scores = [row["rm_score"] for row in rows]
        assert logged[step]["reward_model/score/mean"] == pytest.approx(sum(rm_scores) / len(rows), abs=1e-6)
        assert logged[step]["critic/score/mean"] == pytest.approx(
            logged[step]["reward_model/score/mean"] + RULE, abs=1e-6
        )
    assert len({round(s, 6) for s in rm_scores}) > 1  # the RM tells responses apart
