"""The porting guide's reward manager example (docs/porting.md): a reward manager written for verl, unedited but for
its import lines, registered through ``scaletrain.compat.verl`` and named by ``reward_model.reward_manager`` in a
short PPO run of scaletrain's trainer: its scores are the ones the run trains on, and ``reward_kwargs`` reach it."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

# --- a verl user's file, unedited but for these imports (verl's: from verl import DataProto;
# from verl.utils.reward_score import default_compute_score; from verl.workers.reward_manager import
# AbstractRewardManager, register) ---
from scaletrain.compat.verl import DataProto
from scaletrain.compat.verl.utils.reward_score import default_compute_score
from scaletrain.compat.verl.workers.reward_manager import AbstractRewardManager, register


@register("porting_example_bonus")
class BonusRewardManager(AbstractRewardManager):
    """verl's naive manager's loop, plus a constant bonus on every response."""

    calls: list[float] = []  # each call's mean score: what the test compares with the run's metrics

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", bonus=0.0):
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.bonus = bonus

    def __call__(self, data: DataProto, return_dict: bool = False):
        reward_tensor = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        reward_extra_info = defaultdict(list)
        for i in range(len(data)):
            data_item = data[i]
            prompt_length = data_item.batch["prompts"].shape[-1]
            valid_response_length = data_item.batch["attention_mask"][prompt_length:].sum()
            valid_response_ids = data_item.batch["responses"][:valid_response_length]
            response_str = self.tokenizer.decode(valid_response_ids, skip_special_tokens=True)
            extra_info = data_item.non_tensor_batch.get("extra_info", {})
            score = self.compute_score(
                data_source=data_item.non_tensor_batch[self.reward_fn_key],
                solution_str=response_str,
                ground_truth=data_item.non_tensor_batch["reward_model"]["ground_truth"],
                extra_info=extra_info,
            )
            reward_extra_info["acc"].append(float(score))
            reward_tensor[i, valid_response_length - 1] = score + self.bonus
        type(self).calls.append(reward_tensor.sum(-1).mean().item())
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": reward_extra_info}
        return reward_tensor


# --- end of the user's file ---


@pytest.fixture
def _unregister():
    yield
    from scaletrain.reward.managers import REWARD_MANAGERS

    del REWARD_MANAGERS["porting_example_bonus"]


@pytest.mark.slow
def test_a_verl_reward_manager_scores_scaletrains_run(ray_cluster, task, tmp_path, _unregister):
    from tests.trainer.runs import metrics, run_in_process

    BonusRewardManager.calls.clear()
    overrides = [
        "reward_model.reward_manager=porting_example_bonus",
        "+reward_model.reward_kwargs.bonus=0.25",
        "trainer.val_before_train=true",
        "trainer.plot_at_end=false",
    ]
    result = run_in_process(task, tmp_path / "run", 2, overrides)
    logged = metrics(result.run_dir)
    # validation before training, step 1, step 2 and the validation after it: each one call
    assert len(BonusRewardManager.calls) == 4
    for step in (1, 2):
        assert logged[step]["critic/score/mean"] == pytest.approx(BonusRewardManager.calls[step], abs=1e-6)
        assert logged[step]["critic/score/mean"] >= 0.25  # the bonus from reward_kwargs reached the manager
    assert logged[2]["reward/score_mean"] == pytest.approx(BonusRewardManager.calls[2], abs=1e-6)
