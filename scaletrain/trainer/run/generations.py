"""Scored samples as records (layer 4): gathered over batches, dumped as JSONL, a few picked for the loggers.

``ScoredSamples`` collects, per sample, what a reward manager returned for a rollout batch (the total reward and
its extra info, e.g. ``acc`` / ``pred``), the data source and prompt uid, and optionally the decoded prompt,
response and ground truth. The trainer uses it for

- ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``: ``<dir>/<step>.jsonl``, one JSON object per sample
  with ``input``, ``output``, ``gts``, ``score``, ``step``, ``data_source`` and every reward extra-info key (a key
  named like one of those is left out: ``score`` is the final reward, the extra info's own ``score`` the scorer's
  value before any manager adjustment);
- ``trainer.log_val_generations``: ``pick_samples`` chooses the logged samples deterministically (sorted by input,
  then shuffled with a fixed seed), so the same prompts are followed from one validation to the next.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np
import torch

from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)

PICK_SEED = 42
_RECORD_KEYS = ("input", "output", "gts", "score", "step", "data_source")


def decode_valid(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The valid (mask 1) tokens of each row, decoded without special tokens."""
    return tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)


class ScoredSamples:
    """Columns of scored samples, one entry per sample, appended batch by batch."""

    def __init__(self) -> None:
        self.data_sources: list[str] = []
        self.uids: list[Any] = []
        self.scores: list[float] = []
        self.extra: dict[str, list] = {}  # reward extra info; None where a batch lacked a key
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.gts: list[Any] = []

    def __len__(self) -> int:
        return len(self.scores)

    def add(self, batch: DataProto, reward: dict[str, Any], tokenizer=None) -> None:
        """One scored batch: ``reward`` is the reward manager's ``return_dict=True`` result. With a tokenizer, the
        prompts, responses and ground truths are kept too (for dumps and logged generations)."""
        n, before = len(batch), len(self)
        non_tensor = batch.non_tensor_batch
        self.scores += reward["reward_tensor"].sum(-1).tolist()
        self.data_sources += [str(s) for s in non_tensor["data_source"]]
        self.uids += list(non_tensor["uid"]) if "uid" in non_tensor else [None] * n
        extra = reward.get("reward_extra_info") or {}
        for key in set(self.extra) | set(extra):
            values = list(extra.get(key, [None] * n))
            if len(values) != n:
                raise ValueError(f"reward extra info '{key}' has {len(values)} values for a batch of {n} samples")
            self.extra.setdefault(key, [None] * before).extend(values)
        if tokenizer is not None:
            prompt_len = batch.tensors["prompts"].shape[1]
            mask = batch.tensors["attention_mask"]
            self.inputs += decode_valid(tokenizer, batch.tensors["prompts"], mask[:, :prompt_len])
            self.outputs += decode_valid(tokenizer, batch.tensors["responses"], mask[:, prompt_len:])
            self.gts += [(rm or {}).get("ground_truth") for rm in non_tensor.get("reward_model", [None] * n)]

    def columns(self) -> dict[str, list]:
        """The per-sample variables the validation metrics read: ``reward`` and the reward extra info."""
        return {**self.extra, "reward": self.scores}

    def records(self, step: int) -> list[dict[str, Any]]:
        """One dict per sample (needs the decoded text: ``add`` with a tokenizer)."""
        if len(self.inputs) != len(self):
            raise RuntimeError("ScoredSamples.records needs the decoded samples: pass a tokenizer to add()")
        extra = {k: v for k, v in self.extra.items() if k not in _RECORD_KEYS}
        return [
            {
                "input": self.inputs[i],
                "output": self.outputs[i],
                "gts": self.gts[i],
                "score": self.scores[i],
                "step": step,
                "data_source": self.data_sources[i],
                **{k: v[i] for k, v in extra.items()},
            }
            for i in range(len(self))
        ]


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)) and value.ndim == 0:
        return value.item()
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    return str(value)


def dump_jsonl(directory: str, step: int, records: list[dict[str, Any]]) -> str:
    """Writes ``<directory>/<step>.jsonl`` (replacing a file a resumed run left) and returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=_json_default) + "\n")
    os.replace(tmp, path)  # a crash mid-write leaves no half file under the final name
    logger.info("dumped %d samples to %s", len(records), path)
    return path


def dump_batch(directory: str, step: int, batch: DataProto, reward: dict[str, Any], tokenizer) -> str:
    """``dump_jsonl`` of one scored rollout batch (``trainer.rollout_data_dir``)."""
    samples = ScoredSamples()
    samples.add(batch, reward, tokenizer)
    return dump_jsonl(directory, step, samples.records(step))


def pick_samples(records: list[dict[str, Any]], n: int, seed: int = PICK_SEED) -> list[dict[str, Any]]:
    """``n`` records as ``{"input", "output", "score"}``: sorted by input (stable), shuffled with ``seed``, the first
    ``n`` kept. For the same set of prompts the same positions, hence the same prompts, are chosen whatever order
    the prompts came in (samples of one prompt keep their order)."""
    ordered = sorted(records, key=lambda r: r["input"])
    order = np.random.default_rng(seed).permutation(len(ordered))
    return [{key: ordered[i][key] for key in ("input", "output", "score")} for i in order[:n]]
