"""The porting guide's reward manager example (docs/porting.md): a reward manager written for verl, unedited but for
its import lines, registered through ``scaletrain.compat.verl`` and named by ``reward_model.reward_manager`` in a
short PPO run of scaletrain's trainer: its scores are the ones the run trains on, ``reward_kwargs`` and
``data.reward_fn_key`` reach it, the data's own columns reach it as batch columns, and its per-row extra info
reaches the advantage estimator as batch columns (GDPO on ``acc``)."""

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
    seen: set = set()  # (scorer key value, the row's "difficulty" column) of every row scored

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
            row = data_item.non_tensor_batch
            type(self).seen.add((row[self.reward_fn_key], row["difficulty"]))
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


def renamed_scorer_column(path: str, out) -> str:
    """The task's rows with data_source renamed to ``task_kind`` and a column of the user's own (``difficulty``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    table = table.rename_columns(["task_kind" if c == "data_source" else c for c in table.column_names])
    table = table.append_column("difficulty", pa.array(["easy"] * table.num_rows))
    pq.write_table(table, out)
    return str(out)


@pytest.mark.slow
def test_a_verl_reward_manager_scores_scaletrains_run(ray_cluster, task, tmp_path, _unregister):
    import pyarrow.parquet as pq

    from tests.trainer.runs import metrics, run_in_process

    BonusRewardManager.calls.clear()
    BonusRewardManager.seen.clear()
    kinds = set(pq.read_table(task["train"]).column("data_source").to_pylist())
    overrides = [
        f"data.train_files={renamed_scorer_column(task['train'], tmp_path / 'train.parquet')}",
        f"data.val_files={renamed_scorer_column(task['test'], tmp_path / 'test.parquet')}",
        "data.reward_fn_key=task_kind",  # handed to the manager: its column picks the scorer
        "reward_model.reward_manager=porting_example_bonus",
        "+reward_model.reward_kwargs.bonus=0.25",
        "algorithm.adv_estimator=gdpo",  # reads the manager's reward_extra_info["acc"] as a batch column
        "algorithm.gdpo_reward_keys=[acc]",
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
    assert all(abs(logged[step]["critic/advantages/mean"]) < 1e-5 for step in (1, 2))  # GDPO whitens the batch
    # the manager read the scorer's name from data.reward_fn_key's column, and the user's own column reached it
    assert BonusRewardManager.seen == {(kind, "easy") for kind in kinds}
    assert any(key.startswith(f"val-core/{next(iter(kinds))}/") for key in logged[2])  # data_source: that column


# --- a verl 0.9 user's per-sample (reward-loop) manager, unedited but for its imports (verl's: from
# verl.experimental.reward_loop.reward_manager import register; from verl.experimental.reward_loop.reward_manager.base
# import RewardManagerBase) ---
from scaletrain.compat.verl.experimental.reward_loop.reward_manager import register as register_loop  # noqa: E402
from scaletrain.compat.verl.experimental.reward_loop.reward_manager.base import RewardManagerBase  # noqa: E402


@register_loop("porting_example_length")
class LengthRewardManager(RewardManagerBase):
    """Score: the response's share of max_len (from reward_kwargs), computed off the event loop."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        self.max_len = config.reward.get("reward_kwargs", {}).get("max_len", 10)

    async def run_single(self, data: DataProto) -> dict:
        data_item = data[0]
        response_length = data_item.batch["responses"].shape[-1]
        valid = int(data_item.batch["attention_mask"][-response_length:].sum())
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(data_item.batch["responses"][:valid], skip_special_tokens=True)
        )
        return {"reward_score": valid / self.max_len, "reward_extra_info": {"chars": len(text)}}


# --- end of the user's file ---


def test_a_verl_reward_loop_manager_scores_a_batch_as_the_trainer_runs_it(task):
    import numpy as np

    from scaletrain.compat.verl.utils import hf_tokenizer
    from scaletrain.reward import build_reward_manager
    from scaletrain.reward.managers import REWARD_LOOP_MANAGERS
    from scaletrain.trainer.config.checks import _validate_names
    from scaletrain.trainer.config.ppo_config import PPOConfig

    tokenizer = hf_tokenizer(task["model"])
    try:
        cfg = PPOConfig()
        cfg.reward_model.reward_manager = "porting_example_length"
        _validate_names(cfg)  # the trainer's config check knows the name
        manager = build_reward_manager(tokenizer, "porting_example_length", max_len=4)  # reward_kwargs
        responses = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])
        data = DataProto.from_dict(
            {
                "prompts": torch.tensor([[1, 2], [0, 2]]),
                "responses": responses,
                "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]]),
            },
            {"data_source": np.array(["x", "x"], dtype=object)},
        )
        out = manager(data, return_dict=True)
        assert out["reward_tensor"].tolist() == [[0.0, 0.0, 0.75, 0.0], [0.25, 0.0, 0.0, 0.0]]
        assert out["reward_extra_info"]["chars"] == [
            len(tokenizer.decode(r[:n])) for r, n in ((responses[0], 3), (responses[1], 1))
        ]
        assert out["metrics"]["reward/score_mean"] == pytest.approx(0.5)
    finally:
        del REWARD_LOOP_MANAGERS["porting_example_length"]
