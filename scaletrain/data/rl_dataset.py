"""RL prompt dataset: parquet files in verl's row format -> left-padded prompt tensors + per-row fields.

Row format (one parquet row = one prompt)::

    data_source   str                              picks the reward function (data.reward_fn_key: another column)
    prompt        list of {"role": str, "content": str}   chat messages
    ability       str (optional)
    reward_model  {"style": "rule" | "model", "ground_truth": ...}   ground_truth is required
    extra_info    dict (optional)                  passed through to the reward function
    agent_name    str (optional)                   picks the agent loop
    images        list of images (optional)        with a processor: {"bytes"} / {"path"} / a path (vision.py),
                                                   each placed at an ``<image>`` in the prompt's text

Each prompt is rendered with the tokenizer's chat template (``add_generation_prompt=True``, as text) and that text
is tokenized with ``add_special_tokens=False``: the template already writes any BOS/system tokens the model
wants, so letting the tokenizer add them again would double them.

``dataset[i]`` is a dict: ``input_ids`` / ``attention_mask`` / ``position_ids`` (1-D, left-padded to
``max_prompt_length``; position ids count valid tokens from 0) plus the non-tensor fields ``data_source``,
``reward_model``, ``extra_info``, ``ability``, ``raw_prompt`` (the messages; left out with
``return_raw_chat=False``), ``raw_prompt_ids`` (unpadded token
ids), ``index`` (``extra_info["index"]`` when present, else ``row_id``), ``row_id`` (the row's position across all
files, unique, counted before filtering), ``agent_name`` when any file has that column, and every other column of
the files as it is (verl passes them through: a custom reward manager may read them; None in a row without it).
A column named like a field the dataset makes is refused (rl_rows.py), as are videos and audio (not supported yet)
and images without a processor.

With a ``processor`` (a vision-language model's), a row with images is rendered by the processor: its prompt ids
hold the vision tokens (``max_prompt_length`` counts them; such a prompt is filtered when overlong, never
truncated), ``raw_prompt`` holds the messages with image items, and every row gets verl's ``multi_modal_data``
(``{"image": [PIL images]}``) and ``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``; empty dicts for a
row without images). Position ids stay the text positions (0, 1, ...): a model with 3-D (M-RoPE) positions derives
them in its forward from the ids, the image grid and which ids are image tokens.
``collate_fn`` turns a list of those into a DataProto.

Everything is tokenized once in ``__init__`` (tens of microseconds a row), so overlong prompts are known up front:
``filter_overlong_prompts=True`` drops them (``num_filtered`` counts them); otherwise ``truncation`` decides:
``"error"`` raises naming file and row, ``"left"`` keeps the last tokens, ``"right"`` the first ones.
Malformed rows raise ValueError naming the file and the 0-based row index.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from scaletrain.data.rl_rows import RowColumns, check_row
from scaletrain.data.vision import decode_images, encode_prompt, vision_messages
from scaletrain.protocol import DataProto, object_column

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")
TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")


def left_pad(token_ids: Sequence[Sequence[int]], length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pad id lists to ``length``: ``input_ids``, ``attention_mask``, ``position_ids`` of shape (B, length).

    Position ids are 0 at the first valid token and count up; padding positions hold 0.
    """
    input_ids = torch.full((len(token_ids), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(token_ids), length), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if len(ids) > length:
            raise ValueError(f"row {row} has {len(ids)} tokens, more than the padded length {length}")
        if ids:
            input_ids[row, length - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[row, length - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def require_chat_template(tokenizer: Any, needed_for: str) -> None:
    """ValueError naming the tokenizer unless it has a chat template (``needed_for`` says what renders with it)."""
    if getattr(tokenizer, "chat_template", None) is None:
        where = getattr(tokenizer, "name_or_path", "") or "(built in memory)"
        raise ValueError(
            f"the tokenizer {where} has no chat template; {needed_for} with apply_chat_template. Use "
            "an instruct/chat checkpoint, or add a chat_template.jinja to the model directory"
        )


def collate_fn(items: Sequence[dict[str, Any]]) -> DataProto:
    """Rows from ``RLDataset.__getitem__`` -> one DataProto: tensors stacked, other fields as object arrays."""
    return DataProto.from_dict(*collate_rows(items))


def collate_rows(items: Sequence[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Rows (dicts with the same fields) -> (tensor fields stacked, the other fields as 1-D object arrays)."""
    if not items:
        raise ValueError("collate_fn needs at least one row")
    keys = list(items[0])
    for i, item in enumerate(items[1:], start=1):
        if set(item) != set(keys):
            raise ValueError(f"collate_fn: row {i} has fields {sorted(item)}, row 0 has {sorted(keys)}")
    tensors = {k: torch.stack([item[k] for item in items]) for k in keys if isinstance(items[0][k], torch.Tensor)}
    non_tensors = {k: object_column([item[k] for item in items]) for k in keys if k not in tensors}
    return tensors, non_tensors


class RLDataset:
    """Prompts of one or more parquet files in verl's row format, tokenized and ready for ``collate_fn``.

    Args:
        data_files: one path or a list of paths; rows are concatenated in order.
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_length: the padded prompt length (tokens).
        prompt_key: the column holding the chat messages.
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` (counted in ``num_filtered``).
        truncation: when not filtering: ``"error"``, ``"left"`` (keep the end) or ``"right"`` (keep the start).
        max_samples: keep only the first ``max_samples`` rows (before filtering); None keeps all.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``).
        return_raw_chat: keep each row's chat messages (``raw_prompt``).
        reward_fn_key: the column that picks each row's scorer (a non-empty string in every row); with another
            column than ``data_source``, ``data_source`` may be absent and then takes that column's value.
        processor: a vision-language model's processor (``scaletrain.models.processor.load_processor``); None
            for a text model, whose data then must not have images.
        image_key, video_key: the image and video columns (verl's ``data.image_key`` / ``data.video_key``).
    """

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        max_prompt_length: int = 1024,
        *,
        prompt_key: str = "prompt",
        filter_overlong_prompts: bool = False,
        truncation: str = "error",
        max_samples: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        return_raw_chat: bool = True,
        reward_fn_key: str = "data_source",
        processor: Any = None,
        image_key: str = "images",
        video_key: str = "videos",
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if isinstance(data_files, (str, os.PathLike)):
            data_files = [data_files]
        self.data_files = [os.fspath(f) for f in data_files]
        if not self.data_files:
            raise ValueError("RLDataset needs at least one data file")
        require_chat_template(tokenizer, "RLDataset renders the prompts' chat messages")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.processor = processor
        self.columns = RowColumns(prompt_key, reward_fn_key, image_key if processor is not None else None, video_key)
        self.return_raw_chat = return_raw_chat
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad prompts with")
        self.pad_token_id = int(pad)

        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []
        self.num_filtered = 0
        self.num_truncated = 0
        self.has_agent_name = False
        self.has_images = False  # some row has images: every row gets multi_modal_data / multi_modal_inputs
        self.other_columns: list[str] = []  # the files' columns beyond the known ones, in every row (None if absent)
        self._load(max_samples)

    # ---------------------------------------------------------------------------------------------- loading
    def _load(self, max_samples: int | None) -> None:
        rows, wheres = self._read_rows(max_samples)
        for row_id, (row, ids, where) in enumerate(zip(rows, self._tokenize_prompts(rows, wheres), wheres)):
            ids = self._fit_prompt(list(ids), where, bool(row["images"]))
            if ids is None:
                continue
            row["row_id"] = row_id
            index = row["extra_info"].get("index")
            row["index"] = index if index is not None else row_id
            self.rows.append(row)
            self.prompt_ids.append(ids)
        limit = self.max_prompt_length
        if self.num_filtered:
            logger.info(
                "filtered %d of %d prompts longer than %d tokens (%s)",
                self.num_filtered,
                len(rows),
                limit,
                ", ".join(self.data_files),
            )
        if self.num_truncated:
            logger.warning("%s-truncated %d prompts to %d tokens", self.truncation, self.num_truncated, limit)
        if not self.rows:
            raise ValueError(
                f"no prompts left in {', '.join(self.data_files)} "
                f"({len(rows)} read, {self.num_filtered} longer than max_prompt_length={limit})"
            )
        logger.info("RL dataset: %d prompts from %d file(s)", len(self.rows), len(self.data_files))

    def _read_rows(self, max_samples: int | None) -> tuple[list[dict[str, Any]], list[str]]:
        """The checked rows of every data file (at most ``max_samples`` in all) and where each came from."""
        rows, wheres = [], []
        for path in self.data_files:
            if not os.path.exists(path):
                raise FileNotFoundError(f"RL data file not found: {path}")
            table = pq.read_table(path)
            self.has_agent_name |= "agent_name" in table.column_names
            for i, raw in enumerate(table.to_pylist()):
                if max_samples is not None and len(rows) >= max_samples:
                    break
                where = f"{path}: row {i}"
                row = check_row(raw, self.columns, where)
                if row["images"]:
                    row["image_dir"] = os.path.dirname(os.path.abspath(path))  # relative image paths: beside it
                rows.append(row)
                wheres.append(where)
        self.other_columns = sorted({name for row in rows for name in row["columns"]})
        self.has_images = any(row["images"] for row in rows)
        return rows, wheres

    def _tokenize_prompts(self, rows: list[dict[str, Any]], wheres: list[str]) -> list[list[int]]:
        """Token ids of each row's chat prompt (generation prompt added): the text rows tokenized in one batch, a
        row with images through the processor (its vision tokens counted)."""
        ids: dict[int, list[int]] = {}
        for i, (row, where) in enumerate(zip(rows, wheres)):
            if row["images"]:
                row["raw_prompt"] = vision_messages(row["raw_prompt"], len(row["images"]), f"{where}: prompt")
                ids[i] = self._vision_inputs(row, where)[0]
        text_rows = [i for i in range(len(rows)) if i not in ids]
        ids.update(zip(text_rows, self._tokenize_texts([rows[i] for i in text_rows], [wheres[i] for i in text_rows])))
        return [ids[i] for i in range(len(rows))]

    def _vision_inputs(self, row: dict[str, Any], where: str) -> tuple[list[int], dict[str, Any], list[Any]]:
        """(prompt ids, the model's vision inputs, the decoded images) of a row with images."""
        column = f"{where}: column '{self.columns.image_key}'"
        images = decode_images(row["images"], column, row.get("image_dir"))
        try:
            ids, inputs = encode_prompt(self.processor, row["raw_prompt"], images, self.chat_template_kwargs)
        except Exception as exc:  # the processor's errors are about this row's data: say which row
            raise ValueError(f"{where}: the processor failed on this row: {exc}") from exc
        return ids, inputs, images

    def _tokenize_texts(self, rows: list[dict[str, Any]], wheres: list[str]) -> list[list[int]]:
        """Token ids of text rows' chat prompts, tokenized in one batch."""
        texts = []
        for row, where in zip(rows, wheres):
            try:
                text = self.tokenizer.apply_chat_template(
                    row["raw_prompt"], add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
                )
            except Exception as exc:  # template errors are user data errors: say which row
                raise ValueError(f"{where}: applying the chat template failed: {exc}") from exc
            texts.append(text)
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def _fit_prompt(self, ids: list[int], where: str, has_images: bool = False) -> list[int] | None:
        """``ids`` within max_prompt_length: as is, truncated, or None when overlong prompts are filtered out."""
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.filter_overlong_prompts:
            self.num_filtered += 1
            return None
        if self.truncation == "error" or has_images:
            if has_images:
                raise ValueError(
                    f"{where}: prompt (with its images' tokens) has {len(ids)} tokens, more than "
                    f"max_prompt_length={limit}, and a prompt with images cannot be truncated: raise "
                    "max_prompt_length or set filter_overlong_prompts=True"
                )
            raise ValueError(
                f"{where}: prompt has {len(ids)} tokens, more than max_prompt_length={limit}; "
                "raise max_prompt_length, set filter_overlong_prompts=True or truncation='left'|'right'"
            )
        self.num_truncated += 1
        return ids[-limit:] if self.truncation == "left" else ids[:limit]

    # ---------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        row = self.rows[idx]
        ids = self.prompt_ids[idx]
        padded = left_pad([ids], self.max_prompt_length, self.pad_token_id)
        item: dict[str, Any] = {k: padded[k][0] for k in TENSOR_KEYS}
        item.update(
            data_source=row["data_source"],
            reward_model=copy.deepcopy(row["reward_model"]),
            extra_info=copy.deepcopy(row["extra_info"]),
            ability=row["ability"],
            raw_prompt_ids=list(ids),
            index=row["index"],
            row_id=row["row_id"],
        )
        if self.return_raw_chat:  # data.return_raw_chat: the chat messages travel with the row
            item["raw_prompt"] = copy.deepcopy(row["raw_prompt"])
        if self.has_agent_name:
            item["agent_name"] = row["agent_name"]
        for name in self.other_columns:
            item[name] = copy.deepcopy(row["columns"].get(name))
        if self.has_images:
            item.update(self._vision_item(row))
        return item

    def _vision_item(self, row: dict[str, Any]) -> dict[str, Any]:
        """verl's fields of a row with images: ``multi_modal_data`` ({"image": PIL images}: what a rollout engine
        takes) and ``multi_modal_inputs`` (the processor's tensors: what the model's forward takes); empty dicts
        for a row without images. The processor runs again here, as at load, so no tensors are kept in memory."""
        if not row["images"]:
            return {"multi_modal_data": {}, "multi_modal_inputs": {}}
        where = f"row {row['row_id']}"
        _, inputs, images = self._vision_inputs(row, where)
        return {"multi_modal_data": {"image": images}, "multi_modal_inputs": inputs}

    def get_batch(self, indices: Sequence[int]) -> DataProto:
        """Rows ``indices`` collated into one DataProto."""
        return collate_fn([self[int(i)] for i in indices])
