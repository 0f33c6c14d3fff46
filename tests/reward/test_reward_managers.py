"""Reward managers on batches built with a real (character-level) tokenizer: score placement, EOS handling,
extra info, failure counting, DAPO penalties, multi weights, schema errors."""

import logging
import time

import pytest
import torch

from scaletrain.reward import (
    REWARD_MANAGERS,
    BatchRewardManager,
    DAPORewardManager,
    MultiRewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    get_reward_manager,
    load_custom_reward_fn,
)

ARITH_ROWS = [
    {"prompt": "437+258=", "response": "695", "ground_truth": "695"},  # right
    {"prompt": "1+1=", "response": "3", "ground_truth": "2"},  # wrong
    {"prompt": "12+30=", "response": "42", "ground_truth": "42", "eos": False},  # truncated: no EOS
    {"prompt": "9+9=", "response": " 18 ", "ground_truth": "18"},  # right, whitespace around
    {"prompt": "5+5=", "response": "10 and more", "ground_truth": "10"},  # extra text
]


def expected_tensor(batch, scores, last_token_index):
    out = torch.zeros(batch.batch["responses"].shape)
    for row, (idx, score) in enumerate(zip(last_token_index(batch), scores)):
        out[row, idx] = score
    return out


def test_registry_names():
    assert set(REWARD_MANAGERS.names()) >= {"naive", "prime", "batch", "dapo", "multi"}
    assert get_reward_manager("dapo") is DAPORewardManager
    with pytest.raises(ValueError, match="naive"):
        get_reward_manager("nope")


def test_naive_default_scorer_places_at_last_valid_token(tokenizer, make_batch, last_token_index):
    batch = make_batch(ARITH_ROWS, response_width=14)
    with NaiveRewardManager(tokenizer, num_examine=1) as manager:
        out = manager(batch, return_dict=True)
    want = [1.0, 0.0, 0.0, 1.0, 0.0]
    assert torch.equal(out["reward_tensor"], expected_tensor(batch, want, last_token_index))
    assert last_token_index(batch)[:3] == [3, 1, 1]  # "695"+EOS, "3"+EOS, "42" without EOS
    assert out["reward_extra_info"]["score"] == want
    assert out["metrics"]["reward/errors"] == 0 and out["metrics"]["reward/timeouts"] == 0
    assert out["metrics"]["reward/score_mean"] == pytest.approx(0.4)


def test_prime_parallel_custom_dict_scores(tokenizer, make_batch, last_token_index, test_scorers_path):
    rows = [{"prompt": "p", "response": "x" * (i % 5), "ground_truth": "x" * (i % 3)} for i in range(12)]
    batch = make_batch(rows, response_width=8)
    fn = load_custom_reward_fn(test_scorers_path)  # {"score": exact match, "resp_chars": len}
    with PrimeRewardManager(tokenizer, compute_score=fn, num_processes=3) as manager:
        assert manager.pool.num_workers == 3
        out = manager(batch, return_dict=True)
    want = [float(i % 5 == i % 3) for i in range(12)]
    assert torch.equal(out["reward_tensor"], expected_tensor(batch, want, last_token_index))
    assert out["reward_extra_info"]["resp_chars"] == [i % 5 for i in range(12)]  # aligned with the rows
    assert out["reward_extra_info"]["score"] == want


def test_failures_are_counted_and_logged_not_raised(tokenizer, make_batch, last_token_index, test_scorers_path, caplog):
    truths = ["1", "hang", "boom", "nan", "text", "2"]
    batch = make_batch([{"prompt": "q", "response": t if t in "12" else "0", "ground_truth": t} for t in truths])
    fn = load_custom_reward_fn(test_scorers_path, "misbehaving")
    with NaiveRewardManager(tokenizer, compute_score=fn, compute_score_timeout=1.0) as manager:
        caplog.set_level(logging.WARNING, logger="scaletrain.reward")
        start = time.monotonic()
        out = manager(batch, return_dict=True)
        assert time.monotonic() - start < 15
        assert out["metrics"]["reward/timeouts"] == 1 and out["metrics"]["reward/errors"] == 3
        assert torch.equal(out["reward_tensor"], expected_tensor(batch, [1.0, 0, 0, 0, 0, 1.0], last_token_index))
        log = caplog.text
        assert "scorer exploded" in log and "non-finite" in log and "str" in log and "timeout" in log
        again = manager(make_batch([{"prompt": "q", "response": "7", "ground_truth": "7"}]), return_dict=True)
        assert again["reward_tensor"].sum() == 1.0 and again["metrics"]["reward/timeouts"] == 0


def test_batch_manager(tokenizer, make_batch, last_token_index, test_scorers_path):
    fn = load_custom_reward_fn(test_scorers_path, "batch_exact")
    rows = [
        {"prompt": "a", "response": "12", "ground_truth": "12"},
        {"prompt": "b", "response": "1", "ground_truth": "2"},
    ]
    with BatchRewardManager(tokenizer, compute_score=fn, compute_score_timeout=1.0) as manager:
        batch = make_batch(rows)
        out = manager(batch, return_dict=True)
        assert torch.equal(out["reward_tensor"], expected_tensor(batch, [1.0, 0.0], last_token_index))
        hang = make_batch(rows + [{"prompt": "c", "response": "1", "ground_truth": "hang"}])
        start = time.monotonic()
        out = manager(hang, return_dict=True)
        assert time.monotonic() - start < 15
        assert out["reward_tensor"].abs().sum() == 0 and out["metrics"]["reward/timeouts"] == 3
        out = manager(make_batch(rows + [{"prompt": "c", "response": "1", "ground_truth": "short"}]), return_dict=True)
        assert out["reward_tensor"].abs().sum() == 0 and out["metrics"]["reward/errors"] == 3
    with BatchRewardManager(tokenizer) as manager:  # default: default_compute_score row by row
        batch = make_batch(ARITH_ROWS[:2])
        assert torch.equal(manager(batch), expected_tensor(batch, [1.0, 0.0], last_token_index))


def test_dapo_overlong_penalty(tokenizer, make_batch, last_token_index):
    # max_resp_len 10, buffer 4 -> penalty starts after 6 tokens, reaches -factor at 10. Lengths count EOS.
    rows = [
        {"prompt": "1+1=", "response": "2", "ground_truth": "2"},  # 2 tokens: no penalty
        {"prompt": "1+1=", "response": "2    ", "ground_truth": "2"},  # 6 tokens: still none
        {"prompt": "1+1=", "response": "2      ", "ground_truth": "2"},  # 8 tokens: -0.5 * 2/4
        {"prompt": "1+1=", "response": "2       ", "ground_truth": "2"},  # 9 tokens: -0.5 * 3/4
        {"prompt": "1+1=", "response": "3        ", "ground_truth": "2"},  # 10 tokens, wrong: -0.5
    ]
    batch = make_batch(rows, response_width=10)
    kwargs = dict(max_resp_len=10, overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 0.5})
    with DAPORewardManager(tokenizer, **kwargs) as manager:
        out = manager(batch, return_dict=True)
    penalties = [0.0, 0.0, -0.25, -0.375, -0.5]
    want = [1.0 + p for p in penalties[:4]] + [-0.5]
    assert last_token_index(batch) == [1, 5, 7, 8, 9]
    assert torch.allclose(out["reward_tensor"], expected_tensor(batch, want, last_token_index))
    assert out["reward_extra_info"]["overlong_reward"] == pytest.approx(penalties)
    assert out["reward_extra_info"]["score"] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert out["metrics"]["reward/overlong_frac"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="max_resp_len must be provided"):
        DAPORewardManager(tokenizer, overlong_buffer_cfg={"enable": True, "len": 4})
    with pytest.raises(ValueError, match="unknown keys \\['length'\\]"):
        DAPORewardManager(tokenizer, max_resp_len=10, overlong_buffer_cfg={"enable": True, "length": 4})
    with DAPORewardManager(tokenizer, overlong_buffer_cfg={"enable": False, "len": 4}) as manager:  # off
        assert manager(batch, return_dict=True)["reward_extra_info"]["score"] == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_multi_weights(tokenizer, make_batch, last_token_index, test_scorers_path):
    scorers = [
        {"name": "format", "weight": 0.2},
        {"name": "correctness", "weight": 0.7},
        {"name": "length", "weight": 0.1, "kwargs": {"target_chars": 2}},
    ]
    rows = [
        {"prompt": "437+258=", "response": "695", "ground_truth": "695"},  # fmt 1, right 1, length 3 chars: 0.5
        {"prompt": "1+1=", "response": "12", "ground_truth": "2"},  # fmt 1, wrong, length 1
        {"prompt": "1+1=", "response": "x", "ground_truth": "2"},  # fmt 0, wrong, length 1
    ]
    batch = make_batch(rows)
    with MultiRewardManager(tokenizer, scorers=scorers) as manager:
        out = manager(batch, return_dict=True)
    want = [0.2 + 0.7 + 0.05, 0.2 + 0.1, 0.1]
    assert torch.allclose(out["reward_tensor"], expected_tensor(batch, want, last_token_index))
    info = out["reward_extra_info"]
    assert (
        info["format"] == [1.0, 1.0, 0.0]
        and info["correctness"] == [1.0, 0.0, 0.0]
        and info["length"] == [0.5, 1.0, 1.0]
    )
    # correctness swaps in a configured compute_score; components may also come from files
    custom = [
        {"name": "correctness", "weight": 2.0},
        {"path": str(test_scorers_path), "name": "always_one", "weight": 0.5},
    ]
    fn = load_custom_reward_fn(test_scorers_path)  # {"score": exact match}
    with MultiRewardManager(tokenizer, compute_score=fn, scorers=custom) as manager:
        out = manager(batch, return_dict=True)
    assert out["reward_extra_info"]["score"] == pytest.approx([2.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="unknown component 'nope'"):
        MultiRewardManager(tokenizer, scorers=[{"name": "nope", "weight": 1.0}])
    with pytest.raises(ValueError, match="weight"):
        MultiRewardManager(tokenizer, scorers=[{"name": "format"}])


def test_schema_errors(tokenizer, make_batch):
    rows = [
        {"prompt": "1+1=", "response": "2", "ground_truth": "2"},
        {"prompt": "1+1=", "response": "2", "reward_model": {"style": "rule"}},
    ]
    with NaiveRewardManager(tokenizer) as manager:
        with pytest.raises(ValueError, match=r"row 1: reward_model has no 'ground_truth'"):
            manager(make_batch(rows))
        batch = make_batch(rows[:1])
        batch.non_tensor_batch.pop("data_source")
        with pytest.raises(ValueError, match="data_source"):
            manager(batch)
