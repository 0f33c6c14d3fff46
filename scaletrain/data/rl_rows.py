"""One RL parquet row checked and normalised (verl's row format; see rl_dataset.py): which columns a row must have,
which the dataset reads, and which travel with the row as they are.

``check_row`` raises ValueError naming the file, row and column of anything malformed. The image column is kept
as it is here (rl_dataset.py decodes it with vision.py, where the processor is); a video or audio column is
refused (not supported yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KNOWN_COLUMNS = frozenset({"data_source", "reward_model", "extra_info", "ability", "agent_name"})
# fields the dataset makes for each row: a data column with one of these names would be overwritten
MADE_FIELDS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "raw_prompt",
        "raw_prompt_ids",
        "index",
        "row_id",
        "uid",
        "multi_modal_data",
        "multi_modal_inputs",
    }
)
UNSUPPORTED_MEDIA = frozenset({"images", "videos", "audios"})


@dataclass(frozen=True)
class RowColumns:
    """The columns a dataset reads by name (data.prompt_key, data.reward_fn_key, data.image_key, data.video_key)."""

    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    image_key: str | None = None  # None: the model takes no images, and an images column is refused
    video_key: str = "videos"


def is_message(message: Any) -> bool:
    return (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    )


def other_columns(row: dict[str, Any], columns: RowColumns, where: str) -> dict[str, Any]:
    """The row's columns beyond the ones read (they travel with the row as they are, as in verl); a media column
    this dataset cannot read, or one named like a field the dataset makes, is refused, naming it."""
    read = {*KNOWN_COLUMNS, columns.prompt_key, columns.image_key}
    other = {k: v for k, v in row.items() if k not in read}
    for name, value in other.items():
        if name == columns.video_key or name in UNSUPPORTED_MEDIA:
            if value is not None:  # (a file with media for some rows: this one has none)
                raise ValueError(f"{where}: column '{name}': {_media_refusal(name, columns)}")
            continue
        if name in MADE_FIELDS:
            raise ValueError(f"{where}: column '{name}' has the name of a field the dataset makes; rename it")
    return {k: v for k, v in other.items() if k != columns.video_key and k not in UNSUPPORTED_MEDIA}


def _media_refusal(name: str, columns: RowColumns) -> str:
    if name == "images" and columns.image_key is None:
        return "images need a model with a processor (a vision-language model); this one has none"
    if name == "images":
        return f"data.image_key is '{columns.image_key}': name the image column there"
    return "videos and audio are not supported yet (images are)"


def check_row(row: dict[str, Any], columns: RowColumns, where: str) -> dict[str, Any]:
    """Validate one raw parquet row; return its fields normalised (dict copies, defaults filled)."""
    prompt_key, reward_fn_key = columns.prompt_key, columns.reward_fn_key
    messages = row.get(prompt_key)
    if messages is None:
        raise ValueError(f"{where}: missing '{prompt_key}' (a list of {{role, content}} chat messages)")
    if not isinstance(messages, (list, tuple)) or not messages or not all(is_message(m) for m in messages):
        raise ValueError(
            f"{where}: '{prompt_key}' must be a non-empty list of {{role: str, content: str}} messages, "
            f"got {messages!r:.200}"
        )
    scorer_key = row.get(reward_fn_key)
    if not isinstance(scorer_key, str) or not scorer_key:
        raise ValueError(
            f"{where}: '{reward_fn_key}' (data.reward_fn_key: picks the scorer) must be a non-empty string, "
            f"got {scorer_key!r:.100}"
        )
    data_source = row.get("data_source", scorer_key)  # another reward_fn_key: data_source may be absent
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"{where}: 'data_source' must be a non-empty string, got {data_source!r:.100}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(f"{where}: missing 'reward_model.ground_truth' (reward_model={reward_model!r:.200})")
    return {
        "data_source": data_source,
        "raw_prompt": [{"role": m["role"], "content": m["content"]} for m in messages],
        "reward_model": dict(reward_model),
        **_optional_fields(row, where),
        "images": _image_list(row, columns, where),
        "columns": other_columns(row, columns, where),
    }


def _image_list(row: dict[str, Any], columns: RowColumns, where: str) -> list | None:
    """The row's image values (decoded later, with the processor), or None without an image column."""
    images = row.get(columns.image_key) if columns.image_key else None
    if images is not None and not isinstance(images, (list, tuple)):
        raise ValueError(f"{where}: column '{columns.image_key}': expected a list of images, got {images!r:.100}")
    return list(images) if images is not None else None


def _optional_fields(row: dict[str, Any], where: str) -> dict[str, Any]:
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise ValueError(f"{where}: 'extra_info' must be a dict, got {type(extra_info).__name__}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise ValueError(f"{where}: 'ability' must be a string, got {type(ability).__name__}")
    agent_name = row.get("agent_name")
    if agent_name is not None and not isinstance(agent_name, str):
        raise ValueError(f"{where}: 'agent_name' must be a string, got {type(agent_name).__name__}")
    return {"extra_info": dict(extra_info), "ability": ability or "", "agent_name": agent_name}
