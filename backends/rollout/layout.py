"""The rollout output layout shared by every rollout engine (see backends/rollout/base.py).

An engine produces, per sample, the response tokens it generated (any length up to ``max_new_tokens``) and
their log-probs; these helpers turn them into the fixed-shape DataProto the trainer expects:

- ``eos_token_ids(tokenizer, model_path)``: the token ids that end a response (tokenizer EOS plus the model's
  ``generation_config.json`` EOS ids, e.g. Qwen's ``<|im_end|>`` and ``<|endoftext|>``).
- ``mask_after_eos(responses, eos_ids)``: 1 up to and including the first EOS, 0 after (so pad == eos works).
- ``build_rollout_output(prompts, responses, response_mask, log_probs, n)``: the B*n-row output, prompt rows
  repeated n times (tensor and non-tensor fields alike), concatenated ids / masks / positions.
"""

from __future__ import annotations

import json
import os

import torch

from scaletrain.protocol import DataProto


def eos_token_ids(tokenizer, model_path: str | None = None) -> list[int]:
    """EOS ids from the tokenizer and, when present, the checkpoint's generation_config.json (order kept)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    path = os.path.join(model_path, "generation_config.json") if model_path else None
    if path and os.path.exists(path):
        with open(path) as f:
            extra = json.load(f).get("eos_token_id")
        for i in [extra] if isinstance(extra, int) else (extra or []):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("no EOS token: the tokenizer has no eos_token_id and the model no generation_config EOS")
    return ids


def pad_token_id(tokenizer, eos_ids: list[int]) -> int:
    """The tokenizer's pad id, falling back to the first EOS id (responses are masked by EOS, not by pad)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else eos_ids[0]


def mask_after_eos(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """int64 mask (rows, R): 1 up to and including each row's first EOS token, 0 after it."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device)).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded prompts: 0 at each row's first real token, 0 on the padding before it."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def build_rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    n: int,
    pad_id: int,
) -> DataProto:
    """Assemble the documented layout from per-sample responses (B*n, R), their mask and log-probs.

    Response tokens outside ``response_mask`` are overwritten with ``pad_id``, log-probs there with 0.
    ``prompts`` keeps its other tensor / non-tensor fields and meta_info, each row repeated n times.
    """
    out = prompts.repeat(n, interleave=True) if n > 1 else prompts.select_idxs(torch.arange(len(prompts)))
    out.meta_info = dict(prompts.meta_info)
    batch = out.tensors
    prompt_ids = batch["input_ids"]
    prompt_mask = batch["attention_mask"].long()
    if "position_ids" in batch.keys():
        prompt_pos = batch["position_ids"]
    else:
        prompt_pos = prompt_position_ids(prompt_mask)
    if responses.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"{responses.shape[0]} response rows for {prompt_ids.shape[0]} prompt rows x n")
    device = prompt_ids.device
    response_mask = response_mask.to(device=device, dtype=torch.long)
    valid = response_mask.bool()
    responses = torch.where(valid, responses.to(device), torch.full_like(responses, pad_id, device=device))
    log_probs = torch.where(valid, log_probs.to(device=device, dtype=torch.float32), torch.zeros((), device=device))
    steps = torch.arange(1, responses.shape[1] + 1, device=device, dtype=prompt_pos.dtype)
    response_pos = prompt_pos[..., -1:] + steps  # continues after the prompt's last position
    batch["prompts"] = prompt_ids
    batch["responses"] = responses
    batch["response_mask"] = response_mask
    batch["rollout_log_probs"] = log_probs
    batch["input_ids"] = torch.cat([prompt_ids, responses], dim=-1)
    batch["attention_mask"] = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=-1)
    batch["position_ids"] = torch.cat([prompt_pos, response_pos], dim=-1)
    return out
