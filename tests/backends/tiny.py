"""Tiny models and batches for backend tests and benchmarks (reusable by any test author).

- ``save_tiny_qwen2(path, ...)``: a random-init Qwen2 causal LM (hidden 64, 2 layers, ~100-token vocabulary) and a
  character-level tokenizer with a chat template, written with ``save_pretrained`` so every loader
  (``from_pretrained``, vLLM, the engines) reads it like a real checkpoint. No hub access.
- ``make_tokenizer()``: the character-level ``PreTrainedTokenizerFast`` alone.
- ``save_tiny_reward_model(path)`` / ``reference_rm_scores(path, batch)``: the same Qwen2 as a sequence classifier
  (num_labels=1, a reward model) with the tokenizer, and transformers' score of each unpadded row of a batch.
- ``make_batch(...)``: a random batch in verl's layout: prompts left-padded, responses right-padded,
  ``input_ids`` / ``attention_mask`` / ``position_ids`` of shape (B, P + R), ``responses`` / ``response_mask`` (B, R),
  plus float ``advantages`` and ``old_log_probs`` (B, R) for loss functions.

Everything is seeded: same arguments, same model / batch.
"""

from __future__ import annotations

import string

import torch

from scaletrain.protocol import DataProto

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def vocab() -> dict[str, int]:
    """4 special tokens + the 95 printable ASCII characters (space included): 99 ids."""
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}


def make_tokenizer():
    """Character-level tokenizer (one id per printable character) with a toy chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen2_config(**overrides):
    """scaletrain/models/tiny.py's ``test`` shape for this character-level vocabulary."""
    from scaletrain.models.tiny import tiny_qwen2_config as shaped

    ids = dict(vocab_size=len(vocab()), pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return shaped(**{**ids, **overrides})


def save_tiny_qwen2(path: str, seed: int = 0, with_tokenizer: bool = True, **config_overrides) -> str:
    """Write a random-init tiny Qwen2ForCausalLM (float32) (+ tokenizer) to ``path``; returns ``path``."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**config_overrides))
    model.save_pretrained(path)
    if with_tokenizer:
        make_tokenizer().save_pretrained(path)
    return path


def make_batch(
    batch_size: int = 8,
    prompt_len: int = 12,
    response_len: int = 10,
    vocab_size: int = 99,
    seed: int = 0,
    pad_token_id: int = PAD_ID,
    min_prompt: int = 1,
    min_response: int = 1,
) -> DataProto:
    """A random rollout batch in verl's layout with varied prompt / response lengths (seeded)."""
    g = torch.Generator().manual_seed(seed)
    P, R = prompt_len, response_len
    prompt_lens = torch.randint(min_prompt, P + 1, (batch_size,), generator=g)
    resp_lens = torch.randint(min_response, R + 1, (batch_size,), generator=g)
    prompt_mask = (torch.arange(P)[None, :] >= (P - prompt_lens)[:, None]).long()
    resp_mask = (torch.arange(R)[None, :] < resp_lens[:, None]).long()
    tokens = torch.randint(len(SPECIAL_TOKENS), vocab_size, (batch_size, P + R), generator=g)
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    input_ids = torch.where(attention_mask.bool(), tokens, torch.full_like(tokens, pad_token_id))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    responses = input_ids[:, P:].clone()
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": responses,
            "response_mask": resp_mask,
            "prompts": input_ids[:, :P].clone(),
            "advantages": torch.randn(batch_size, R, generator=g) * resp_mask,
            "old_log_probs": torch.zeros(batch_size, R),
        },
        meta_info={"temperature": 1.0},
    )


def save_tiny_reward_model(path: str, seed: int = 2, **config_overrides) -> str:
    """A random-init tiny Qwen2ForSequenceClassification (num_labels=1; head weights large enough that rows score
    visibly differently) + tokenizer at ``path``; returns ``path``."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_qwen2_config(num_labels=1, **{"initializer_range": 0.2, **config_overrides})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def reference_rm_scores(path: str, batch: DataProto) -> torch.Tensor:
    """(B,) transformers' AutoModelForSequenceClassification score of each row's valid tokens, one unpadded sequence
    at a time (HF pools at its last token)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    with torch.no_grad():
        return torch.tensor([model(input_ids=row[m][None]).logits[0, 0].item() for row, m in zip(ids, mask)])
