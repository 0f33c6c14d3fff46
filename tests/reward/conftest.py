"""Fixtures for the reward tests: a character-level tokenizer built locally (no hub) and a batch builder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from scaletrain.protocol import DataProto

HERE = Path(__file__).parent
TEST_SCORERS = HERE / "reward_fns_for_tests.py"  # loaded by path, as a user's custom reward file would be

_CHARS = list("0123456789+-*=#.,$ {}\\_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_CHARS += list("`\n()[]:;'\"<>/%!?|&^~@")  # code (the sandbox_fusion tests' responses)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"] + _CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def _make_batch(tokenizer, rows, response_width=None, data_source="scaletrain/arithmetic") -> DataProto:
    """rows: dicts with prompt, response, eos (append EOS, default True), ground_truth, and optionally
    data_source / extra_info / reward_model (overrides the built one). Prompts left-padded (after a BOS),
    responses right-padded to ``response_width``."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [[tokenizer.bos_token_id] + enc(r["prompt"]) for r in rows]
    responses = [enc(r["response"]) + ([tokenizer.eos_token_id] if r.get("eos", True) else []) for r in rows]
    p_len = max(map(len, prompts))
    r_len = response_width or max(map(len, responses))
    pad = tokenizer.pad_token_id
    prompt_t = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts])
    response_t = torch.tensor([r + [pad] * (r_len - len(r)) for r in responses])
    mask = torch.tensor(
        [
            [0] * (p_len - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (r_len - len(r))
            for p, r in zip(prompts, responses)
        ]
    )
    non_tensors = {
        "data_source": np.array([r.get("data_source", data_source) for r in rows], dtype=object),
        "reward_model": np.array(
            [r.get("reward_model", {"ground_truth": r.get("ground_truth"), "style": "rule"}) for r in rows],
            dtype=object,
        ),
        "extra_info": np.array([r.get("extra_info") for r in rows], dtype=object),
    }
    return DataProto.from_dict(
        tensors={"prompts": prompt_t, "responses": response_t, "attention_mask": mask}, non_tensors=non_tensors
    )


def _last_token_index(batch: DataProto) -> list[int]:
    """Independent of the managers: index of the last 1 in each row's response mask."""
    p_len = batch.batch["prompts"].shape[1]
    out = []
    for row in batch.batch["attention_mask"][:, p_len:].tolist():
        ones = [i for i, v in enumerate(row) if v]
        out.append(ones[-1] if ones else -1)
    return out


@pytest.fixture
def make_batch(tokenizer):
    return lambda rows, **kwargs: _make_batch(tokenizer, rows, **kwargs)


@pytest.fixture
def last_token_index():
    return _last_token_index


@pytest.fixture
def test_scorers_path() -> Path:
    return TEST_SCORERS
