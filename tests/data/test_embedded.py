"""The embedded default: tokenizer round trip, cached build (idempotent, rebuilt when half-built), task files, and
the tiny Qwen2 checkpoint loading and running in transformers."""

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.data.embedded import build_embedded_default, default_cache_dir, sample_problems
from scaletrain.data.loader import StatefulDataLoader
from scaletrain.data.rl_dataset import RLDataset
from scaletrain.data.tokenizer import EOS_ID, arithmetic_vocab, build_arithmetic_tokenizer
from scaletrain.utils.cache import STAMP_FILE

SIZES = dict(seed=3, n_train=200, n_val=20, n_test=30)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_embedded_default(tmp_path_factory.mktemp("cache"), **SIZES)


def test_tokenizer_round_trip():
    tok = build_arithmetic_tokenizer()
    vocab = arithmetic_vocab()
    assert len(tok) == len(vocab) == 16
    ids = tok("437+258=")["input_ids"]
    assert ids == [vocab[c] for c in "437+258="]  # no BOS/EOS added
    assert tok.decode(ids) == "437+258="
    with_eos = tok("695" + tok.eos_token)["input_ids"]
    assert with_eos == [vocab["6"], vocab["9"], vocab["5"], EOS_ID]
    assert tok.decode(with_eos, skip_special_tokens=True) == "695"
    assert tok.decode(with_eos) == "695<eos>"
    user = [{"role": "user", "content": "437+258="}]
    assert tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False) == "437+258="
    pair = user + [{"role": "assistant", "content": "695"}]
    assert tok.apply_chat_template(pair, tokenize=False) == "437+258=695<eos>"
    assert tok("4 3")["input_ids"] == [vocab["4"], tok.unk_token_id, vocab["3"]]


def test_problems_disjoint_and_stable():
    splits = sample_problems(0, 1000, 300, 500)
    assert [len(splits[s]) for s in ("train", "val", "test")] == [1000, 300, 500]
    sets = {k: set(v) for k, v in splits.items()}
    assert sum(len(s) for s in sets.values()) == 1800  # distinct inside and across splits
    assert all(100 <= a <= 999 and 100 <= b <= 999 for pairs in splits.values() for a, b in pairs)
    # held-out sets don't depend on the train size
    other = sample_problems(0, 50, 300, 500)
    assert other["test"] == splits["test"] and other["val"] == splits["val"]
    with pytest.raises(ValueError, match="distinct problems"):
        sample_problems(0, 810_000, 1, 0)


def test_build_writes_task_files(built):
    for key in ("train", "val", "test", "sft_train", "sft_val"):
        assert Path(built[key]).is_file(), key
    assert built["tokenizer"] == built["model"]
    rows = {s: pq.read_table(built[s]).to_pylist() for s in ("train", "val", "test")}
    assert [len(rows[s]) for s in ("train", "val", "test")] == [200, 20, 30]
    first = rows["train"][0]
    a, b = first["extra_info"]["a"], first["extra_info"]["b"]
    assert first["data_source"] == "scaletrain/arithmetic"
    assert first["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    prompts = {s: {r["prompt"][0]["content"] for r in rows[s]} for s in rows}
    assert not prompts["train"] & prompts["test"] and not prompts["train"] & prompts["val"]
    assert not prompts["val"] & prompts["test"]
    sft = pq.read_table(built["sft_train"]).to_pylist()
    assert len(sft) == 200 and sft[0]["prompt"] == f"{a}+{b}=" and sft[0]["response"] == str(a + b)
    assert sft[0]["messages"][1] == {"role": "assistant", "content": str(a + b)}
    assert len(pq.read_table(built["sft_val"])) == 20


def test_cache_is_idempotent_and_rebuilds_half_built(tmp_path, built):
    cache = Path(built["dir"]).parent
    stamp = Path(built["dir"]) / STAMP_FILE
    before = stamp.stat().st_mtime_ns
    assert build_embedded_default(cache, **SIZES) == built
    assert stamp.stat().st_mtime_ns == before  # not rebuilt
    assert json.loads(stamp.read_text())["n_train"] == 200
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # no temporary build left behind

    # a half-built cache (no stamp; a stray file) is thrown away and rebuilt
    half = tmp_path / "half"
    paths = build_embedded_default(half, **dict(SIZES, n_train=10))
    Path(paths["dir"], STAMP_FILE).unlink()
    Path(paths["train"]).unlink()
    Path(paths["dir"], "stray").write_text("x")
    again = build_embedded_default(half, **dict(SIZES, n_train=10))
    assert again == paths and Path(again["train"]).is_file() and not Path(again["dir"], "stray").exists()
    assert Path(again["dir"], STAMP_FILE).is_file()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "embedded"
    monkeypatch.delenv("SCALETRAIN_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "scaletrain" / "embedded"


def test_model_loads_and_runs_forward(built):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(built["model"])
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 512)
    assert config.tie_word_embeddings and config.vocab_size == 16 and config.max_position_embeddings == 64
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    tok = AutoTokenizer.from_pretrained(built["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(built["model"])
    assert model.generation_config.eos_token_id == EOS_ID
    n_params = sum(p.numel() for p in model.parameters())
    assert 450_000 < n_params < 520_000  # ~0.49M, embeddings tied
    ids = torch.tensor([tok("437+258=")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 8, 16) and torch.isfinite(logits).all()


def test_rl_dataset_reads_embedded_task(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["tokenizer"])
    ds = RLDataset(built["test"], tok, max_prompt_length=8)
    batch = next(iter(StatefulDataLoader(ds, batch_size=16, shuffle=False)))
    assert batch.batch["attention_mask"].all()  # every prompt is exactly 8 tokens
    row0 = pq.read_table(built["test"]).to_pylist()[0]
    assert tok.decode(batch.batch["input_ids"][0]) == row0["prompt"][0]["content"]
    assert batch.non_tensor_batch["reward_model"][0]["ground_truth"] == row0["reward_model"]["ground_truth"]


def test_arithmetic_preprocess_script(tmp_path, capsys):
    from scaletrain.data.preprocess import arithmetic

    paths = arithmetic.main(["--output_dir", str(tmp_path), "--n_train", "40", "--n_val", "5", "--n_test", "6"])
    assert "40/5/6" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == [
        "sft_train.parquet",
        "sft_val.parquet",
        "test.parquet",
        "train.parquet",
        "val.parquet",
    ]
    assert len(pq.read_table(paths["test"])) == 6
