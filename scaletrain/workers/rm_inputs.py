"""The reward model's inputs (layer 2): the policy's tokens as they are, or the rollout re-tokenized for a reward
model with its own tokenizer and chat template.

With ``reward_model.model.input_tokenizer`` set (verl's key: the tokenizer the policy's tokens are in), each row is
rebuilt as text, the way verl's reward-model worker switches chat templates: the row's chat messages
(``raw_prompt``) plus an assistant message holding the response decoded with the policy's tokenizer (special tokens
dropped: the RM's template writes its own turn markers), rendered with the RM tokenizer's chat template and
tokenized by it. Rows are right-padded, position ids 0, 1, ... A row longer than ``max_length`` keeps its last
``max_length`` tokens: the score is read at the last token, so the end of the response must survive.

Without it the RM reads the policy's ``input_ids`` / ``attention_mask`` / ``position_ids`` directly (and a
vision-language rollout's images, ``multi_modal_inputs``); the trainer checks before Ray that both tokenizers have
the same vocabulary (scaletrain/trainer/rollout/rm_reward.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from backends.vision import vision_keys
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)

POLICY_INPUTS = ("input_ids", "attention_mask", "position_ids")


def policy_inputs(data: DataProto) -> DataProto:
    """The policy's model inputs alone, a vision-language rollout's images with them (no meta_info: the RM engine
    batches by its own settings)."""
    return data.select(POLICY_INPUTS, non_tensor_batch_keys=vision_keys(data.non_tensor_batch), meta_info_keys=[])


def rm_texts(data: DataProto, src_tokenizer: Any, rm_tokenizer: Any) -> list[str]:
    """Each row as the RM's chat-template text: its chat messages plus the decoded response as the assistant."""
    if "raw_prompt" not in data.non_tensor_batch:
        raise ValueError(
            "reward_model.model.input_tokenizer re-tokenizes from the rows' chat messages "
            "(non-tensor 'raw_prompt'), which this batch lacks; set data.return_raw_chat=true"
        )
    responses = data.tensors["responses"]
    response_mask = data.tensors["attention_mask"][:, -responses.shape[1] :].bool()
    decoded = src_tokenizer.batch_decode(
        [row[m].tolist() for row, m in zip(responses, response_mask)], skip_special_tokens=True
    )
    texts = []
    for messages, response in zip(data.non_tensor_batch["raw_prompt"], decoded):
        chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
        texts.append(rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
    return texts


def retokenized_inputs(
    data: DataProto, src_tokenizer: Any, rm_tokenizer: Any, max_length: int | None
) -> tuple[DataProto, int]:
    """(the RM's right-padded inputs, the number of rows cut to ``max_length``)."""
    texts = rm_texts(data, src_tokenizer, rm_tokenizer)
    rows = rm_tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    truncated = sum(1 for r in rows if max_length is not None and len(r) > max_length)
    if max_length is not None:
        rows = [r[-max_length:] for r in rows]
    width = max(len(r) for r in rows)
    pad = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, : len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    )
    return batch, truncated
