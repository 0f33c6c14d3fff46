"""SFTDataset: prompt / response rows of parquet files, tokenized once into verl's batch layout.

The prompt is rendered with the tokenizer's chat template as one user message (with the generation prompt) and
left-padded to ``max_prompt_length``; the response gets the EOS token appended and is right-padded to
``max_response_length``. Batches are DataProtos with ``input_ids`` / ``attention_mask`` / ``position_ids``
(B, P + R) and ``responses`` / ``response_mask`` (B, R), the layout every training engine takes.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow.parquet as pq
import torch

from scaletrain.data.rl_dataset import left_pad, require_chat_template
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)


def _files(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


class SFTDataset:
    """Prompt / response rows of parquet files, tokenized once into verl-layout tensors (see the module docstring)."""

    def __init__(
        self,
        files: Any,
        tokenizer: Any,
        prompt_key: str = "prompt",
        response_key: str = "response",
        max_prompt_length: int = 512,
        max_response_length: int = 512,
        truncation: str = "error",
        max_samples: int | None = None,
    ):
        require_chat_template(tokenizer, "SFT renders its prompts")
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no EOS token to end responses with")
        prompts, responses, wheres = [], [], []
        for path in _files(files):
            table = pq.read_table(path, columns=[prompt_key, response_key]).to_pydict()
            for i, (p, r) in enumerate(zip(table[prompt_key], table[response_key])):
                if not isinstance(p, str) or not isinstance(r, str):
                    raise ValueError(f"{path}: row {i}: '{prompt_key}' and '{response_key}' must be strings")
                prompts.append(p)
                responses.append(r)
                wheres.append(f"{path}: row {i}")
        if max_samples is not None:
            prompts, responses, wheres = prompts[:max_samples], responses[:max_samples], wheres[:max_samples]
        if not prompts:
            raise ValueError(f"no SFT rows in {files}")
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
        prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer([r + tokenizer.eos_token for r in responses], add_special_tokens=False)["input_ids"]
        P, R = max_prompt_length, max_response_length
        for i, (p_ids, r_ids) in enumerate(zip(prompt_ids, response_ids)):
            if len(p_ids) > P or len(r_ids) > R:
                if truncation == "error":
                    raise ValueError(
                        f"{wheres[i]}: {len(p_ids)} prompt / {len(r_ids)} response tokens exceed "
                        f"data.max_prompt_length={P} / data.max_response_length={R} (EOS included); "
                        "raise them or set data.truncation=truncate"
                    )
                prompt_ids[i], response_ids[i] = p_ids[-P:], r_ids[:R]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        prompt = left_pad(prompt_ids, P, pad)
        responses_t = torch.full((len(response_ids), R), pad, dtype=torch.long)
        response_mask = torch.zeros_like(responses_t)
        for i, ids in enumerate(response_ids):
            responses_t[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            response_mask[i, : len(ids)] = 1
        attention_mask = torch.cat([prompt["attention_mask"], response_mask], dim=1)
        self.tensors = {
            "input_ids": torch.cat([prompt["input_ids"], responses_t], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses_t,
            "response_mask": response_mask,
        }
        logger.info("SFT dataset: %d rows from %s", len(prompts), ", ".join(_files(files)))

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def get_batch(self, indices: Any) -> DataProto:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return DataProto.from_dict({k: v[idx] for k, v in self.tensors.items()})
