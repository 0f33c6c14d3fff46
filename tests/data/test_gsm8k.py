"""GSM8K converter: local jsonl/parquet -> verl's RL rows, split handling, and bad rows named by file and line."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from scaletrain.data.preprocess import gsm8k
from scaletrain.data.rl_dataset import RLDataset
from tests.data.helpers import char_tokenizer, write_parquet

ROOT = Path(__file__).resolve().parents[2]
RECORDS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,000 more than $500. Price?", "answer": "It is 1,500.\n#### 1,500"},
]


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_final_answer():
    assert gsm8k.final_answer("blah\n#### 72") == "72"
    assert gsm8k.final_answer("#### 1,234 ") == "1234"
    assert gsm8k.final_answer("#### -3.5") == "-3.5"
    assert gsm8k.final_answer("the answer is 72") is None


def test_convert_jsonl_to_rl_rows(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", RECORDS, extra_lines=[""])  # blank lines are skipped
    test = write_parquet(RECORDS[:1], tmp_path / "gsm8k_test.parquet")
    paths = gsm8k.main(["--input", train, "--input", test, "--output_dir", str(tmp_path / "out")])
    assert set(paths) == {"train", "test"}
    rows = pq.read_table(paths["train"]).to_pylist()
    assert len(rows) == 2 and len(pq.read_table(paths["test"])) == 1
    r = rows[1]
    assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
    assert r["reward_model"] == {"style": "rule", "ground_truth": "1500"}
    assert r["prompt"] == [{"role": "user", "content": RECORDS[1]["question"] + " " + gsm8k.INSTRUCTION}]
    assert "####" in gsm8k.INSTRUCTION
    assert r["extra_info"] == {
        "split": "train",
        "index": 1,
        "question": RECORDS[1]["question"],
        "answer": RECORDS[1]["answer"],
    }
    ds = RLDataset(paths["train"], char_tokenizer(), max_prompt_length=200)  # the output is a valid RL dataset
    assert ds[0]["reward_model"]["ground_truth"] == "7"


def test_split_flag_and_inference(tmp_path):
    data = write_jsonl(tmp_path / "gsm.jsonl", RECORDS)
    with pytest.raises(ValueError, match="cannot tell the split"):
        gsm8k.convert([data], tmp_path / "out")
    paths = gsm8k.convert([data], tmp_path / "out", split="test")
    assert list(paths) == ["test"]
    assert pq.read_table(paths["test"]).to_pylist()[0]["extra_info"]["split"] == "test"


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ('{"question": "q", "answer": "no final number"}', "does not end with '#### <number>'"),
        ('{"question": "q"}', "'answer' must be a non-empty string"),
        ('{"question": "", "answer": "#### 1"}', "'question' must be a non-empty string"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "train.jsonl", RECORDS, extra_lines=["", bad_line])
    with pytest.raises(ValueError, match=rf"train\.jsonl: line 4: .*{message}"):
        gsm8k.convert([path], tmp_path / "out")


def test_module_entry_point(tmp_path):
    data = write_jsonl(tmp_path / "test.jsonl", RECORDS)
    out = subprocess.run(
        [sys.executable, "-m", "scaletrain.data.preprocess.gsm8k", "--input", data, "--output_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == f"gsm8k: test -> {tmp_path / 'test.parquet'}"
    assert len(pq.read_table(tmp_path / "test.parquet")) == 2
