"""The reasoning-gym scorer: last ``<answer>`` tag, the task's own scorer on the stored entry (partial credit
included), the ground-truth fallback, default dispatch, and the naive manager on a batch of such rows."""

import json

import pytest
import torch

from scaletrain.data.preprocess.reasoning_gym import build_splits
from scaletrain.reward import NaiveRewardManager, default_compute_score
from scaletrain.reward.scorers import format_score
from scaletrain.reward.scorers.reasoning_gym import compute_score, extract_answer
from tests.data.helpers import char_tokenizer

TASKS = ("basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic")
SEED = 1


@pytest.fixture(scope="module")
def task_rows():
    """Per task: (row, the same entry straight from reasoning-gym, the dataset that made it)."""
    import reasoning_gym

    out = {}
    for task in TASKS:
        row = build_splits(task, 0, 1, seed=SEED)["test"][0]
        dataset = reasoning_gym.create_dataset(task, seed=SEED, size=1)
        entry = dataset[0]
        assert json.loads(row["extra_info"]["entry"])["question"] == entry["question"]
        out[task] = (row, entry, dataset)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """Printable characters (the shared reward tokenizer lacks ``<``, ``>`` and ``/``); used by ``make_batch``."""
    return char_tokenizer()


def partial_answer(task, entry):
    """An answer the task gives partial credit: the truth inside extra text, or countdown's right numbers
    combined the wrong way."""
    if task == "countdown":
        return "+".join(str(n) for n in entry["metadata"]["numbers"])
    return f"= {entry['answer']}"


def wrong_answer(task, entry):
    if task == "countdown":
        return "1+1"
    return str(int(float(entry["answer"])) + 1)


def score(row, response):
    return compute_score(row["data_source"], response, row["reward_model"]["ground_truth"], row["extra_info"])


@pytest.mark.parametrize("task", TASKS)
def test_correct_wrong_partial_and_missing_tag(task, task_rows):
    row, entry, dataset = task_rows[task]
    truth = row["reward_model"]["ground_truth"]
    assert truth == entry["answer"]  # the ground truth is reasoning-gym's answer
    assert score(row, f"Let me think. <answer> {truth} </answer>") == {"score": 1.0, "acc": 1.0, "pred": truth}

    wrong = wrong_answer(task, entry)
    expected = dataset.score_answer(wrong, entry)
    assert expected < 1.0
    assert score(row, f"<answer>{wrong}</answer>") == {"score": expected, "acc": 0.0, "pred": wrong}

    partial = partial_answer(task, entry)
    expected = dataset.score_answer(partial, entry)
    if task != "gsm_symbolic":  # gsm_symbolic reads the first number of any text: "= 5" is simply right
        assert 0.0 < expected < 1.0
    got = score(row, f"<answer>{partial}</answer>")
    assert got["score"] == pytest.approx(expected) and got["pred"] == partial
    assert got["acc"] == (1.0 if expected >= 1.0 else 0.0)

    # no complete tag: 0, even where the task's scorer would give a token reward for an empty answer
    for response in (f"The answer is {truth}.", f"<answer>{truth}", f"{truth}</answer>", ""):
        assert score(row, response) == {"score": 0.0, "acc": 0.0, "pred": ""}


@pytest.mark.parametrize("task", TASKS)
def test_the_last_tag_counts(task, task_rows):
    row, entry, dataset = task_rows[task]
    truth, wrong = entry["answer"], wrong_answer(task, entry)
    assert score(row, f"<answer>{wrong}</answer> wait, no: <answer>{truth}</answer>")["score"] == 1.0
    got = score(row, f"<answer>{truth}</answer> hmm, rather <answer>{wrong}</answer>")
    assert got == {"score": dataset.score_answer(wrong, entry), "acc": 0.0, "pred": wrong}


def test_extraction_matches_reasoning_gym():
    from reasoning_gym.utils import extract_answer as rg_extract

    texts = [
        "<answer>1</answer>",
        "a <answer> 2 </answer> b <answer>\n  3 \n</answer>",
        "<answer></answer>",
        "<answer>x<answer>y</answer>",
        "none",
        "<answer>multi\nline</answer>",
        "<answer>4",
    ]
    for text in texts:
        assert extract_answer(text) == rg_extract(text), text


def test_rows_without_entry_compare_with_ground_truth():
    source = "reasoning_gym/anything"
    assert compute_score(source, "<answer>  1  +  2 </answer>", "1 + 2", None)["score"] == 1.0
    assert compute_score(source, "<answer>12</answer>", "13", {"index": 3})["score"] == 0.0
    assert compute_score(source, "12", "12", None) == {"score": 0.0, "acc": 0.0, "pred": ""}


def test_default_dispatch_and_format_component(task_rows):
    row = task_rows["chain_sum"][0]
    truth = row["reward_model"]["ground_truth"]
    got = default_compute_score(row["data_source"], f"<answer>{truth}</answer>", truth, row["extra_info"])
    assert got == {"score": 1.0, "acc": 1.0, "pred": truth}
    with pytest.raises(NotImplementedError, match="reasoning_gym/"):
        default_compute_score("reasoning_gymx/chain_sum", "<answer>1</answer>", "1")
    assert format_score(row["data_source"], "so <answer>7</answer>", truth) == 1.0
    assert format_score(row["data_source"], "#### 7", truth) == 0.0


def test_naive_manager_scores_a_batch(make_batch, last_token_index, task_rows, tokenizer):
    row, entry, dataset = task_rows["chain_sum"]
    truth, wrong, partial = entry["answer"], wrong_answer("chain_sum", entry), partial_answer("chain_sum", entry)
    broken = dict(row["extra_info"], entry=json.dumps({"question": entry["question"]}))  # no answer: KeyError
    cases = [  # (response, extra_info, expected score, expected pred)
        (f"<answer>{truth}</answer>", row["extra_info"], 1.0, truth),
        (f"<answer>{wrong}</answer>", row["extra_info"], dataset.score_answer(wrong, entry), wrong),
        (f"<answer>{partial}</answer>", row["extra_info"], dataset.score_answer(partial, entry), partial),
        (truth, row["extra_info"], 0.0, ""),
        (f"<answer>{wrong}</answer><answer>{truth}</answer>", row["extra_info"], 1.0, truth),
        (f"<answer>{truth}</answer>", None, 1.0, truth),  # no entry: ground-truth comparison
        (f"<answer>{truth}</answer>", broken, 0.0, None),  # the task's scorer raises: an error, counted
    ]
    rows = [
        {"prompt": "q", "response": response, "ground_truth": truth, "extra_info": info}
        for response, info, _, _ in cases
    ]
    batch = make_batch(rows, data_source=row["data_source"])
    with NaiveRewardManager(tokenizer) as manager:
        out = manager(batch, return_dict=True)
    want = [case[2] for case in cases]
    expected = torch.zeros(batch.batch["responses"].shape)
    for i, index in enumerate(last_token_index(batch)):
        expected[i, index] = want[i]
    assert torch.allclose(out["reward_tensor"], expected)
    assert out["reward_extra_info"]["pred"] == [case[3] for case in cases]
    assert out["reward_extra_info"]["acc"] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, None]
    assert out["metrics"]["reward/errors"] == 1 and out["metrics"]["reward/timeouts"] == 0
