"""A micro-batch's model inputs (layer 1): padded, packed (remove-padding) or packed and sliced for Ulysses sequence
parallelism, with the positions the head runs at (backends/hf_model.py's forward).

Packing: the valid tokens of the micro-batch in one (1, total) sequence, position ids restarting at 0 for each row
and no attention mask (transformers finds the boundaries from the position ids). The positions that predict the
valid response tokens (the token before each) are the head's. With a sequence-parallel group each rank holds a
slice of the packed sequence (backends/sequence/ulysses.py): its head computes the predicted positions it holds,
and ``PreparedInputs.gather`` brings every rank's outputs together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from backends.sequence.ulysses import SequenceParallel, SequenceShard
from backends.vision import vision_forward_kwargs


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """Valid tokens of every row concatenated into (1, total); returns (ids, position_ids, packed_index) where
    ``packed_index[i, t]`` is the packed position of token (i, t) (meaningful where the mask is 1)."""
    mask = attention_mask.bool()
    ids = input_ids[mask].unsqueeze(0)
    pos = position_ids[mask].unsqueeze(0)
    lengths = mask.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    first_pos = pos[0, starts[lengths > 0]]
    if bool((first_pos != 0).any()):
        # transformers finds sequence boundaries where the position id does not grow by one
        raise ValueError("remove-padding needs each row's valid position ids to start at 0")
    packed_index = torch.cumsum(mask.flatten().long(), 0).view(mask.shape) - 1
    return ids, pos, packed_index


def _identity(values: torch.Tensor) -> torch.Tensor:
    return values


@dataclasses.dataclass
class PreparedInputs:
    """One micro-batch's model keyword arguments and where its head runs."""

    inputs: dict[str, object]  # the model's keyword arguments
    resp_valid: torch.Tensor  # (b, R) the response tokens that exist
    packed_index: torch.Tensor | None = None  # packed: each token's position in the packed sequence (see ``pack``)
    predict_at: torch.Tensor | None = None  # packed: the head's positions (this rank's, in its slice)
    mine: torch.Tensor | None = None  # sequence-parallel: which valid response tokens this rank's head predicts
    shard: SequenceShard | None = None

    def held(self, positions: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """(the packed ``positions`` this rank holds, in its slice; the function turning their outputs into all
        ``positions``' outputs)."""
        if self.shard is None:
            return positions, _identity
        shard = self.shard
        at, mine = shard.take(positions)
        return at, lambda values: shard.gather(values, mine)

    def mine_only(self, values: torch.Tensor) -> torch.Tensor:
        """The entries of per-valid-response-token ``values`` whose outputs this rank's head computes."""
        return values if self.mine is None else values[self.mine]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """The head's rows as every valid response token's (sequence-parallel: every rank's, see ``held``)."""
        return values if self.shard is None or self.mine is None else self.shard.gather(values, self.mine)


def prepare_inputs(
    model: nn.Module,
    micro: dict[str, torch.Tensor],
    remove_padding: bool,
    vision: dict[str, torch.Tensor] | None,
    sp: SequenceParallel | None = None,
) -> PreparedInputs:
    """The model's inputs for the padded or the packed forward (``vision``, None for a text model: a vision-language
    model's inputs and 3-D positions); packed, the head's positions: response token (i, T-R+j) is predicted at the
    packed position of token (i, T-R+j-1)."""
    input_ids, attention_mask, position_ids = micro["input_ids"], micro["attention_mask"], micro["position_ids"]
    T = input_ids.shape[1]
    R = micro["responses"].shape[1] if "responses" in micro else 0
    resp_valid = attention_mask[:, T - R :].bool()
    if not remove_padding:
        inputs: dict[str, object] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        if vision is not None:
            inputs |= vision_forward_kwargs(model, input_ids, attention_mask, vision)
        return PreparedInputs(inputs, resp_valid)
    ids, pos, packed_index = pack(input_ids, attention_mask, position_ids)
    predict_at = packed_index[:, T - R - 1 : T - 1][resp_valid]  # (n_valid,)
    if sp is not None:
        ids, pos, shard = sp.shard(ids, pos)
        at, mine = shard.take(predict_at)
        return PreparedInputs(
            {"input_ids": ids, "position_ids": pos, "ulysses": shard}, resp_valid, packed_index, at, mine, shard
        )
    inputs = {"input_ids": ids, "position_ids": pos}
    if vision is not None:
        inputs |= vision_forward_kwargs(model, input_ids, attention_mask, vision, packed_text_positions=pos)
    return PreparedInputs(inputs, resp_valid, packed_index, predict_at)
