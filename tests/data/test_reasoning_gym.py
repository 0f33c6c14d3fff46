"""reasoning-gym converter: CLI -> parquet in verl's row format that RLDataset loads, determinism by seed,
disjoint de-duplicated splits, task kwargs, and usage errors (exit code 2 listing the known tasks)."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from scaletrain.data.preprocess import reasoning_gym as rg
from scaletrain.data.rl_dataset import RLDataset
from tests.data.helpers import BOS_TEMPLATE, char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SMALL_CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 distinct questions


def questions(rows):
    return [json.loads(r["extra_info"]["entry"])["question"] for r in rows]


def test_cli_writes_rows_that_rl_dataset_loads(tmp_path):
    kwargs = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    paths = rg.main(
        [
            "--task",
            "chain_sum",
            "--output_dir",
            str(tmp_path),
            "--train_size",
            "12",
            "--test_size",
            "5",
            "--seed",
            "3",
            "--task_kwargs",
            json.dumps(kwargs),
        ]
    )
    assert paths == {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 12 and len(test) == 5

    import reasoning_gym

    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            info = row["extra_info"]
            entry = json.loads(info["entry"])
            assert row["data_source"] == "reasoning_gym/chain_sum" and row["ability"] == "arithmetic"
            assert row["prompt"] == [{"role": "user", "content": f"{entry['question'].strip()} {rg.INSTRUCTION}"}]
            assert row["reward_model"] == {"style": "rule", "ground_truth": entry["answer"]}
            assert (info["split"], info["index"], info["task"]) == (split, i, "chain_sum")
            assert json.loads(info["task_kwargs"]) == kwargs
            assert 2 <= entry["metadata"]["num_terms"] <= 3  # the kwargs reached the generator
    # the test rows are reasoning-gym's own items of a generator seeded --seed
    first = reasoning_gym.create_dataset("chain_sum", seed=3, size=1, **kwargs)[0]
    assert json.loads(test[0]["extra_info"]["entry"]) == json.loads(json.dumps(first))
    assert "<answer>" in rg.INSTRUCTION and "</answer>" in rg.INSTRUCTION

    tokenizer = char_tokenizer(BOS_TEMPLATE)  # a chat template with a generation prompt
    ds = RLDataset(paths["train"], tokenizer, max_prompt_length=256)
    item = ds[4]
    assert item["data_source"] == "reasoning_gym/chain_sum" and item["index"] == 4
    assert item["reward_model"]["ground_truth"] == train[4]["reward_model"]["ground_truth"]
    text = tokenizer.decode(item["raw_prompt_ids"])
    assert text == f"<bos><user>{train[4]['prompt'][0]['content']}<assistant>"


def test_same_seed_same_rows_other_seed_other_rows():
    a = rg.build_splits("basic_arithmetic", 10, 5, seed=7)
    assert a == rg.build_splits("basic_arithmetic", 10, 5, seed=7)
    b = rg.build_splits("basic_arithmetic", 10, 5, seed=8)
    assert questions(a["test"]) != questions(b["test"]) and questions(a["train"]) != questions(b["train"])
    # the held-out split does not move when the train split grows
    assert rg.build_splits("basic_arithmetic", 30, 5, seed=7)["test"] == a["test"]


def test_splits_are_disjoint_and_deduplicated():
    # 200 possible questions: 150 of them make the draws collide within and across splits
    rows = rg.build_splits("chain_sum", 100, 50, seed=0, task_kwargs=SMALL_CHAIN)
    train, test = questions(rows["train"]), questions(rows["test"])
    assert len(train) == 100 and len(test) == 50
    assert len(set(train)) == 100 and len(set(test)) == 50 and not set(train) & set(test)
    import reasoning_gym

    raw = reasoning_gym.create_dataset("chain_sum", seed=rg.TRAIN_SEED_OFFSET, size=100, **SMALL_CHAIN)
    raw_questions = [raw[i]["question"] for i in range(100)]
    assert len(set(raw_questions)) < 100 or set(raw_questions) & set(test)  # de-duplication had work to do
    with pytest.raises(ValueError, match="distinct new questions"):
        rg.build_splits("chain_sum", 300, 50, seed=0, task_kwargs=SMALL_CHAIN)


def test_library_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'nope'.*basic_arithmetic.*chain_sum"):
        rg.build_splits("nope", 1, 1)
    with pytest.raises(ValueError, match=r"may not set \['seed'\]"):
        rg.build_splits("chain_sum", 1, 1, task_kwargs={"seed": 3})
    with pytest.raises(ValueError, match="chain_sum.*rejects.*no_such_field"):
        rg.build_splits("chain_sum", 1, 1, task_kwargs={"no_such_field": 1})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        rg.build_splits("chain_sum", 1, 1, task_kwargs={"min_terms": 4, "max_terms": 2})
    with pytest.raises(ValueError, match="test_size must be >= 0"):
        rg.build_splits("chain_sum", 1, -1)
    with pytest.raises(ValueError, match="train_size must be at most"):  # its draws would reach other seeds
        rg.build_splits("chain_sum", rg.TRAIN_SEED_OFFSET, 1)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--task_kwargs", "{bad"], "not valid JSON"),
        (["--task_kwargs", "[1]"], "must be a JSON object"),
        (["--task_kwargs", '{"size": 3}'], "may not set"),
    ],
)
def test_cli_usage_errors_exit_2(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        rg.main(["--task", "chain_sum", "--output_dir", str(tmp_path), "--train_size", "1", "--test_size", "1"] + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "train.parquet").exists()


def test_module_entry_point_unknown_task_lists_known_names(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaletrain.data.preprocess.reasoning_gym",
            "--task",
            "chain_sm",
            "--output_dir",
            str(tmp_path),
            "--train_size",
            "2",
            "--test_size",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "unknown reasoning-gym task 'chain_sm'" in out.stderr
    for name in ("basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic"):
        assert name in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_fewshot_turns_precede_every_question_and_stay_out_of_the_splits():
    rows = rg.build_splits("chain_sum", 20, 10, seed=3, task_kwargs=SMALL_CHAIN, fewshot=2)
    first = rows["train"][0]["prompt"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant", "user"]
    examples = [json.loads(r["extra_info"][rg.ENTRY_KEY]) for r in rows["test"][:1]]  # a row's own entry
    assert first[-1]["content"].endswith(rg.INSTRUCTION) and first[-1] != rows["test"][0]["prompt"][-1]
    for split in ("train", "test"):
        assert all(r["prompt"][:4] == first[:4] for r in rows[split])  # the same examples for every row
    shown = {m["content"].removesuffix(" " + rg.INSTRUCTION) for m in first[:4:2]}
    assert not shown & (set(questions(rows["train"])) | set(questions(rows["test"]))), "an example is also a problem"
    import reasoning_gym

    for user, assistant in zip(first[:4:2], first[1:4:2]):  # the worked answer is right by the task's own scorer
        question = user["content"].removesuffix(" " + rg.INSTRUCTION)
        dataset = reasoning_gym.create_dataset("chain_sum", seed=3 + rg.FEWSHOT_SEED_OFFSET, size=50, **SMALL_CHAIN)
        entry = next(dataset[i] for i in range(50) if dataset[i]["question"].strip() == question)
        tagged = assistant["content"].split("<answer>")[1].split("</answer>")[0]
        assert (
            assistant["content"].startswith(entry["metadata"]["expression"])
            and dataset.score_answer(tagged, entry) == 1.0
        )
    assert (
        examples
        and rg.build_splits("chain_sum", 20, 10, seed=3, task_kwargs=SMALL_CHAIN)["train"][0]["prompt"] == first[-1:]
    )
    with pytest.raises(ValueError, match="fewshot must be >= 0"):
        rg.build_splits("chain_sum", 1, 1, fewshot=-1)
