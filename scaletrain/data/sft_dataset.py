"""SFTDataset: prompt / response rows of parquet files, tokenized once into verl's batch layout.

A row's prompt is a string (rendered as one user message) or a list of chat messages (verl's RL row format, so
an RL parquet serves SFT too); it is rendered with the chat template (with the generation prompt) and left-padded
to ``max_prompt_length``. The response column may be nested: ``reward_model.ground_truth`` reads that field of
the ``reward_model`` struct. The response gets the EOS token appended and is right-padded to
``max_response_length``. Batches are DataProtos with ``input_ids`` / ``attention_mask`` / ``position_ids``
(B, P + R) and ``responses`` / ``response_mask`` (B, R), the layout every training engine takes.

Images: given a vision-language model's processor, a row's ``image_key`` column (verl's multimodal format:
scaletrain/data/vision.py) is rendered with it, as the RL dataset does: the prompt's ids hold the vision tokens
(counted by ``max_prompt_length``; a prompt with images is never truncated) and the batch carries each row's
vision inputs in the non-tensor column ``multi_modal_inputs`` ({} for a row without images). Images without a
processor are refused, naming the column.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pyarrow.parquet as pq
import torch

from scaletrain.data.rl_dataset import left_pad, require_chat_template
from scaletrain.data.vision import decode_images, encode_prompt, vision_messages
from scaletrain.protocol import DataProto
from scaletrain.protocol.rows import object_column

logger = logging.getLogger(__name__)
MULTI_MODAL_INPUTS = "multi_modal_inputs"


def _files(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def column_values(table: dict[str, list[Any]], key: str, path: str) -> list[Any]:
    """The values of column ``key`` (``a.b``: field ``b`` of struct column ``a``) of a table read ``to_pydict``."""
    top, *fields = key.split(".")
    values = table[top]
    for i, field in enumerate(fields):
        name = ".".join([top, *fields[: i + 1]])
        if any(not isinstance(v, dict) or field not in v for v in values):
            raise ValueError(f"{path}: column '{name}': not a field of every row of '{name.rsplit('.', 1)[0]}'")
        values = [v[field] for v in values]
    return values


def as_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """A prompt string as one user message; a chat message list as it is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
        return prompt
    raise ValueError(f"{where}: the prompt must be a string or a list of chat messages, got {prompt!r:.100}")


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
        processor: Any = None,
        image_key: str = "images",
    ):
        require_chat_template(tokenizer, "SFT renders its prompts")
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has no EOS token to end responses with")
        self.tokenizer, self.processor, self.image_key = tokenizer, processor, image_key
        rows = self._read(_files(files), prompt_key, response_key)[:max_samples]
        if not rows:
            raise ValueError(f"no SFT rows in {files}")
        prompt_ids, vision = self._tokenize_prompts(rows)
        response_ids = tokenizer([r["response"] + tokenizer.eos_token for r in rows], add_special_tokens=False)
        response_ids = response_ids["input_ids"]
        P, R = max_prompt_length, max_response_length
        for i, (p_ids, r_ids) in enumerate(zip(prompt_ids, response_ids)):
            if len(p_ids) > P or len(r_ids) > R:
                if truncation == "error" or (vision[i] and len(p_ids) > P):
                    how = " or set data.truncation=truncate"
                    how = " (a prompt with images is never truncated)" if vision[i] else how
                    raise ValueError(
                        f"{rows[i]['where']}: {len(p_ids)} prompt / {len(r_ids)} response tokens exceed "
                        f"data.max_prompt_length={P} / data.max_response_length={R} (EOS included); raise them{how}"
                    )
                prompt_ids[i], response_ids[i] = p_ids[-P:], r_ids[:R]
        self.tensors = self._tensors(prompt_ids, response_ids, P, R)
        self.vision = object_column(vision) if any(vision) else None
        logger.info("SFT dataset: %d rows from %s", len(rows), ", ".join(_files(files)))

    def _read(self, files: list[str], prompt_key: str, response_key: str) -> list[dict[str, Any]]:
        """Each row's prompt messages, response text, images (None: none) and where it is (file: row i)."""
        rows = []
        for path in files:
            has_images = self.image_key in pq.read_schema(path).names
            wanted = {prompt_key, response_key.split(".")[0], *([self.image_key] if has_images else [])}
            table = pq.read_table(path, columns=sorted(wanted)).to_pydict()
            images = table[self.image_key] if has_images else [None] * len(table[prompt_key])
            for i, (p, r, imgs) in enumerate(zip(table[prompt_key], column_values(table, response_key, path), images)):
                where = f"{path}: row {i}"
                if not isinstance(r, str):
                    raise ValueError(f"{where}: '{response_key}' must be a string, got {r!r:.100}")
                self._check_images(imgs, where)
                rows.append(
                    {"prompt": as_messages(p, where), "response": r, "images": imgs, "where": where, "dir": path}
                )
        return rows

    def _check_images(self, images: Any, where: str) -> None:
        column = f"{where}: column '{self.image_key}'"
        if images is not None and not isinstance(images, list):
            raise ValueError(f"{column}: expected a list of images, got {images!r:.100}")
        if images and self.processor is None:
            raise ValueError(f"{column}: images need a model with a processor (a vision-language model)")

    def _tokenize_prompts(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[dict[str, Any]]]:
        """Each row's prompt ids (a row with images through the processor, its vision tokens counted) and vision
        inputs ({} for a text row)."""
        tok = self.tokenizer
        ids: list[list[int]] = []
        vision: list[dict[str, Any]] = []
        for row in rows:
            if row["images"]:
                column = f"{row['where']}: column '{self.image_key}'"
                images = decode_images(row["images"], column, os.path.dirname(row["dir"]))
                messages = vision_messages(row["prompt"], len(images), f"{row['where']}: prompt")
                row_ids, inputs = encode_prompt(self.processor, messages, images, {})
            else:
                text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
                row_ids, inputs = tok(text, add_special_tokens=False)["input_ids"], {}
            ids.append(row_ids)
            vision.append(inputs)
        return ids, vision

    def _tensors(self, prompt_ids, response_ids, P: int, R: int) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        prompt = left_pad(prompt_ids, P, pad)
        responses = torch.full((len(response_ids), R), pad, dtype=torch.long)
        response_mask = torch.zeros_like(responses)
        for i, ids in enumerate(response_ids):
            responses[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            response_mask[i, : len(ids)] = 1
        attention_mask = torch.cat([prompt["attention_mask"], response_mask], dim=1)
        return {
            "input_ids": torch.cat([prompt["input_ids"], responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
        }

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def get_batch(self, indices: Any) -> DataProto:
        idx = torch.as_tensor(indices, dtype=torch.long)
        non_tensors = {MULTI_MODAL_INPUTS: self.vision[idx.numpy()]} if self.vision is not None else None
        return DataProto.from_dict({k: v[idx] for k, v in self.tensors.items()}, non_tensors=non_tensors)
