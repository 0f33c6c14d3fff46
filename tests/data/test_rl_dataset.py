"""RLDataset: chat-template tokenization, left padding, overlong filtering / truncation, row errors, collation, the
scorer's column (data.reward_fn_key) and the files' other columns passed through."""

import logging

import numpy as np
import pytest
import torch

from scaletrain.data.rl_dataset import RLDataset, collate_fn, left_pad
from scaletrain.protocol import DataProto
from tests.data.helpers import BOS_TEMPLATE, char_tokenizer, row, write_parquet


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_left_pad_and_positions():
    out = left_pad([[5, 6, 7], [8], []], 4, pad_token_id=0)
    assert out["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="row 0 has 5 tokens"):
        left_pad([[1] * 5], 4, 0)


def test_tokenize_pad_and_decode_back(tmp_path, tok):
    rows = [row("1+2="), row("What is 12 + 30?", ground_truth="42", extra_info={"index": 7, "note": "x"})]
    path = write_parquet(rows, tmp_path / "train.parquet")
    ds = RLDataset(path, tok, max_prompt_length=20)
    assert len(ds) == 2 and ds.num_filtered == 0
    for i, r in enumerate(rows):
        item = ds[i]
        content = r["prompt"][0]["content"]
        n = len(content)
        assert item["input_ids"].shape == (20,) and item["input_ids"].dtype == torch.long
        assert item["attention_mask"].tolist() == [0] * (20 - n) + [1] * n
        assert item["position_ids"].tolist() == [0] * (20 - n) + list(range(n))
        assert (item["input_ids"][: 20 - n] == tok.pad_token_id).all()
        assert tok.decode(item["input_ids"][item["attention_mask"].bool()]) == content
        assert tok.decode(item["raw_prompt_ids"]) == content
        assert item["raw_prompt"] == r["prompt"]
        assert item["data_source"] == "test/src" and item["ability"] == "math"
        assert item["reward_model"] == r["reward_model"]
        assert item["row_id"] == i
    assert ds[0]["index"] == 0  # no extra_info.index: falls back to the row id
    assert ds[1]["index"] == 7 and ds[1]["extra_info"]["index"] == 7
    assert "agent_name" not in ds[0]
    ds[0]["extra_info"]["note"] = "mutated"  # items are copies
    assert ds[0]["extra_info"]["note"] == "1+2"


def test_template_bos_is_not_doubled(tmp_path):
    tok = char_tokenizer(BOS_TEMPLATE, add_bos=True)
    assert tok("a")["input_ids"][0] == tok.bos_token_id  # encode would add a BOS of its own
    path = write_parquet([row("hi")], tmp_path / "p.parquet")
    item = RLDataset(path, tok, max_prompt_length=32)[0]
    valid = item["input_ids"][item["attention_mask"].bool()].tolist()
    assert valid.count(tok.bos_token_id) == 1 and valid[0] == tok.bos_token_id
    assert tok.decode(valid) == "<bos><user>hi<assistant>"


def test_overlong_prompts_filtered_and_counted(tmp_path, tok, caplog):
    rows = [row("12"), row("123456789"), row("1234"), row("1234567")]
    path = write_parquet(rows, tmp_path / "train.parquet")
    with caplog.at_level(logging.INFO, logger="scaletrain.data.rl_dataset"):
        ds = RLDataset(path, tok, max_prompt_length=5, filter_overlong_prompts=True)
    assert ds.num_filtered == 2 and len(ds) == 2
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(2)] == ["12", "1234"]
    assert [ds[i]["row_id"] for i in range(2)] == [0, 2]  # row ids count rows before filtering
    assert "filtered 2 of 4 prompts" in caplog.text
    with pytest.raises(ValueError, match="no prompts left"):
        RLDataset(write_parquet([row("123456")], tmp_path / "long.parquet"), tok, 5, filter_overlong_prompts=True)


def test_truncation_modes(tmp_path, tok):
    path = write_parquet([row("12"), row("abcdefgh")], tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet: row 1: prompt has 8 tokens, more than max_prompt_length=5"):
        RLDataset(path, tok, max_prompt_length=5)
    left = RLDataset(path, tok, max_prompt_length=5, truncation="left")
    right = RLDataset(path, tok, max_prompt_length=5, truncation="right")
    assert left.num_truncated == right.num_truncated == 1 and len(left) == 2
    assert tok.decode(left[1]["input_ids"]) == "defgh"
    assert tok.decode(right[1]["input_ids"]) == "abcde"
    assert left[1]["attention_mask"].all()
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset(path, tok, 5, truncation="middle")


MALFORMED = {
    "missing prompt": ({"prompt": None}, "missing 'prompt'"),
    "prompt is a string": ({"prompt": "1+1="}, "non-empty list"),
    "empty prompt": ({"prompt": []}, "non-empty list"),
    "message without content": ({"prompt": [{"role": "user"}]}, "non-empty list"),
    "missing ground truth": ({"reward_model": {"style": "rule"}}, r"reward_model\.ground_truth"),
    "missing reward_model": ({"reward_model": None}, r"reward_model\.ground_truth"),
    "missing data_source": ({"data_source": None}, "data_source"),
    "an images column": ({"images": ["a.png"]}, "column 'images': images need a model with a processor"),
    "a column named like a made field": ({"row_id": 7}, "column 'row_id' has the name of a field the dataset makes"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_row_names_file_and_row(tmp_path, tok, case):
    change, message = MALFORMED[case]
    bad = row("2+2=")
    bad.update(change)
    if change.get("prompt") is None and "prompt" in change:
        del bad["prompt"]  # a column missing from the row (pyarrow fills it with null in other rows)
    # parquet columns have one type: a string prompt can't sit next to a list one, so that file has a single row;
    # a table written from rows takes its columns from the first row, so a column only the bad row has goes alone
    alone = case == "prompt is a string" or not set(change) <= set(row("1+1="))
    rows = [bad] if alone else [row("1+1="), bad]
    path = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=rf"bad\.parquet: row {len(rows) - 1}: .*{message}"):
        RLDataset(path, tok, max_prompt_length=16)


def test_missing_file_and_template(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLDataset(str(tmp_path / "nope.parquet"), tok, 8)
    no_template = char_tokenizer()
    no_template.chat_template = None
    no_template.name_or_path = "/models/base-lm"
    with pytest.raises(ValueError, match="the tokenizer /models/base-lm has no chat template; RLDataset renders"):
        RLDataset(write_parquet([row("1")], tmp_path / "a.parquet"), no_template, 8)


def test_collate_to_dataproto_over_files(tmp_path, tok):
    a = write_parquet(
        [row("1+1=", agent_name="tool_agent"), row("22+2=", agent_name="single_turn")], tmp_path / "a.parquet"
    )
    b = write_parquet([row("3+3=", ground_truth="6", agent_name="tool_agent")], tmp_path / "b.parquet")
    ds = RLDataset([a, b], tok, max_prompt_length=8)
    assert len(ds) == 3 and [ds[i]["row_id"] for i in range(3)] == [0, 1, 2]
    batch = collate_fn([ds[i] for i in range(3)])
    assert isinstance(batch, DataProto) and len(batch) == 3
    assert set(batch.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    assert batch.batch["input_ids"].shape == (3, 8)
    non = batch.non_tensor_batch
    for key in (
        "data_source",
        "reward_model",
        "extra_info",
        "ability",
        "raw_prompt",
        "raw_prompt_ids",
        "index",
        "row_id",
        "agent_name",
    ):
        assert isinstance(non[key], np.ndarray) and non[key].dtype == object and non[key].shape == (3,), key
    assert list(non["agent_name"]) == ["tool_agent", "single_turn", "tool_agent"]
    assert non["reward_model"][2]["ground_truth"] == "6"
    assert non["raw_prompt"][1] == [{"role": "user", "content": "22+2="}]
    # slicing / concat keep working on the collated batch
    assert DataProto.concat([batch[:1], batch[1:]]).non_tensor_batch["raw_prompt"][2][0]["content"] == "3+3="
    assert ds.get_batch([2, 0]).non_tensor_batch["row_id"].tolist() == [2, 0]


def test_max_samples(tmp_path, tok):
    path = write_parquet([row(str(i)) for i in range(10)], tmp_path / "m.parquet")
    ds = RLDataset([path, path], tok, 4, max_samples=13)
    assert len(ds) == 13 and ds[12]["raw_prompt"][0]["content"] == "2"


def test_the_scorer_column_and_the_files_other_columns(tmp_path, tok):
    a = write_parquet([{**row("1+1="), "task": "sum", "level": 2}], tmp_path / "a.parquet")
    b = write_parquet([{**row("2+2="), "task": "twice"}], tmp_path / "b.parquet")
    ds = RLDataset([a, b], tok, 8, reward_fn_key="task")
    batch = ds.get_batch([0, 1])
    non = batch.non_tensor_batch
    # every column travels with its row (None where a file lacks it); data_source stays the rows' own
    assert list(non["task"]) == ["sum", "twice"] and list(non["level"]) == [2, None]
    assert list(non["data_source"]) == ["test/src", "test/src"]
    # without a data_source column, the scorer's column names the rows' source
    nameless = {k: v for k, v in row("3+3=").items() if k != "data_source"}
    c = write_parquet([{**nameless, "task": "sum"}], tmp_path / "c.parquet")
    assert RLDataset(c, tok, 8, reward_fn_key="task")[0]["data_source"] == "sum"
    with pytest.raises(ValueError, match=r"c\.parquet: row 0: 'data_source' \(data.reward_fn_key: picks the scorer\)"):
        RLDataset(c, tok, 8)
    with pytest.raises(ValueError, match=r"a\.parquet: row 0: 'kind' \(data.reward_fn_key"):
        RLDataset(a, tok, 8, reward_fn_key="kind")
