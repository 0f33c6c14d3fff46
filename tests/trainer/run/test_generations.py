"""Scored samples: gathered over batches, dumped as JSONL, picked deterministically, shown by each logger."""

import json

import numpy as np
import pytest
import torch

from scaletrain.data.tokenizer import build_arithmetic_tokenizer
from scaletrain.protocol import DataProto
from scaletrain.trainer.run.generations import ScoredSamples, dump_batch, dump_jsonl, pick_samples
from scaletrain.trainer.run.tracking import Tracking


@pytest.fixture(scope="module")
def tokenizer():
    return build_arithmetic_tokenizer()


def scored_batch(tokenizer, prompts, responses, extra):
    """A rollout batch as the trainer has it after the reward (left-padded prompts, right-padded responses)."""
    pad = tokenizer.pad_token_id
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    plen, rlen = max(map(len, p_ids)), max(map(len, r_ids))
    prompt = torch.tensor([[pad] * (plen - len(x)) + x for x in p_ids])
    response = torch.tensor([x + [pad] * (rlen - len(x)) for x in r_ids])
    mask = torch.tensor(
        [[0] * (plen - len(p)) + [1] * (len(p) + len(r)) + [0] * (rlen - len(r)) for p, r in zip(p_ids, r_ids)]
    )
    batch = DataProto.from_dict(
        tensors={"prompts": prompt, "responses": response, "attention_mask": mask},
        non_tensors={
            "data_source": np.array(["arith"] * len(prompts), dtype=object),
            "uid": np.array([f"u{p}" for p in prompts], dtype=object),
            "reward_model": np.array([{"ground_truth": str(eval(p[:-1]))} for p in prompts], dtype=object),
        },
    )
    scores = torch.zeros(len(prompts), rlen)
    right = [r.replace("<eos>", "") == str(eval(p[:-1])) for p, r in zip(prompts, responses)]
    scores[:, 0] = torch.tensor(right, dtype=torch.float32)
    return batch, {"reward_tensor": scores, "reward_extra_info": extra}


def test_samples_gather_batches_and_fill_missing_extra_keys(tokenizer):
    samples = ScoredSamples()
    b1, r1 = scored_batch(tokenizer, ["1+2=", "10+20="], ["3<eos>", "31"], {"pred": ["3", "31"], "score": [9, 9]})
    b2, r2 = scored_batch(tokenizer, ["4+4="], ["8<eos>"], {"acc": [True]})
    samples.add(b1, r1, tokenizer)
    samples.add(b2, r2, tokenizer)
    assert samples.scores == [1.0, 0.0, 1.0] and samples.uids == ["u1+2=", "u10+20=", "u4+4="]
    assert samples.extra == {"pred": ["3", "31", None], "score": [9, 9, None], "acc": [None, None, True]}
    assert samples.columns()["reward"] == [1.0, 0.0, 1.0]
    records = samples.records(step=7)
    assert records[1] == {
        "input": "10+20=",
        "output": "31",
        "gts": "30",
        "score": 0.0,
        "step": 7,
        "data_source": "arith",
        "pred": "31",
        "acc": None,
    }  # padding and <eos> not decoded
    assert records[0]["input"] == "1+2=" and records[0]["output"] == "3"
    undecoded = ScoredSamples()
    undecoded.add(b1, r1)
    with pytest.raises(RuntimeError, match="needs the decoded samples"):
        undecoded.records(0)
    with pytest.raises(ValueError, match="reward extra info 'pred' has 1 values for a batch of 2"):
        ScoredSamples().add(b1, {**r1, "reward_extra_info": {"pred": ["3"]}})


def test_dump_one_line_per_sample(tokenizer, tmp_path):
    batch, reward = scored_batch(
        tokenizer, ["1+2=", "5+5="], ["3<eos>", "9<eos>"], {"pred": ["3", "9"], "len": [np.int64(1), np.int64(1)]}
    )
    path = dump_batch(str(tmp_path / "rollouts"), 3, batch, reward, tokenizer)
    assert path == str(tmp_path / "rollouts" / "3.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert [r["score"] for r in rows] == [1.0, 0.0] and rows[1]["gts"] == "10" and rows[1]["len"] == 1
    assert set(rows[0]) == {"input", "output", "gts", "score", "step", "data_source", "pred", "len"}
    dump_jsonl(str(tmp_path / "rollouts"), 3, rows[:1])  # a rerun of the step replaces the file
    assert len(open(path).readlines()) == 1 and not list((tmp_path / "rollouts").glob("*.tmp"))


def test_pick_is_deterministic_and_independent_of_sample_order():
    records = [{"input": f"{i}+1=", "output": str(i + 1), "score": float(i % 2), "gts": None} for i in range(20)]
    picked = pick_samples(records, 3)
    assert len(picked) == 3 and set(picked[0]) == {"input", "output", "score"}
    assert pick_samples(list(reversed(records)), 3) == picked
    assert pick_samples(records, 3, seed=1) != picked
    assert len(pick_samples(records, 50)) == 20


SAMPLES = [{"input": "12+30=", "output": "42", "score": 1.0}, {"input": "5+6=", "output": "10", "score": 0.0}]


def log_samples(tmp_path, names):
    with Tracking("proj", "exp", names, tmp_path) as tracking:
        tracking.log_generations(SAMPLES, step=0)
        tracking.log({"val/a/acc": 0.5}, step=0)
        tracking.log_generations(SAMPLES[:1], step=2)
        return tracking.backends["mlflow"].run_id if "mlflow" in names else None


def test_console_and_jsonl_show_validation_samples(tmp_path, capsys):
    log_samples(tmp_path, ["console", "jsonl"])
    out = capsys.readouterr().out
    assert "validation samples at step 2:" in out and "[score 1] '12+30=' -> '42'" in out
    rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, **SAMPLES[0]}, {"step": 0, **SAMPLES[1]}, {"step": 2, **SAMPLES[0]}]
    with Tracking("proj", "exp", ["jsonl"], tmp_path, resume_step=2):  # a resumed run redoes step 2
        pass
    assert len((tmp_path / "val_generations.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # ~30 s here, mostly starting the three packages
def test_tensorboard_wandb_mlflow_show_validation_samples(tmp_path, monkeypatch):
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow_run = log_samples(tmp_path, ["tensorboard", "wandb", "mlflow"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("val/generations/text_summary")}
    assert sorted(texts) == [0, 2] and "**Input:** 5+6=" in texts[0] and "5+6=" not in texts[2]

    tables = sorted((tmp_path / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json"))
    assert len(tables) == 2
    last = max((json.loads(t.read_text()) for t in tables), key=lambda t: len(t["data"]))
    assert last["columns"] == ["step", "input", "output", "score"]
    assert last["data"] == [[0, "12+30=", "42", 1.0], [0, "5+6=", "10", 0.0], [2, "12+30=", "42", 1.0]]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    path = client.download_artifacts(mlflow_run, "val_generations/step_2.json", str(tmp_path / "dl"))
    assert json.loads(open(path).read()) == SAMPLES[:1]
