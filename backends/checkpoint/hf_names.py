"""The HF checkpoint layout of exported weights (layer 1): what ``save_pretrained`` writes and vLLM loads.

transformers (5.x) converts some checkpoints as it loads them: a mixture-of-experts model's per-expert
``mlp.experts.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj`` tensors become one fused 3-D parameter per layer
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). The engines' state dicts hold the fused names; the
checkpoint files, vLLM's loader and other tools expect the per-expert ones. ``checkpoint_layout`` reverts each
exported bucket with transformers' own ``revert_weight_conversion`` (what ``save_pretrained`` does), so
``save_hf`` and the rollout weight sync carry the checkpoint layout. The per-expert tensors are views of the fused
one (no copy). Models whose conversions only rename (a vision-language model's ``model.language_model.*``) keep
their in-memory names, which transformers and vLLM load as they are; dense text models have no conversion.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


def converts_layout(hf_model: nn.Module) -> bool:
    """Whether transformers changes tensor layouts (not only names) when it loads this model's checkpoint."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    converted = getattr(hf_model, "_weight_conversions", None)
    if converted is None:
        converted = get_model_conversion_mapping(hf_model, add_legacy=False)  # pyright: ignore[reportArgumentType]
    return any(isinstance(c, WeightConverter) for c in converted)


def checkpoint_layout(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], hf_model: nn.Module
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``buckets`` of the model's in-memory (name, tensor) pairs, each reverted to the checkpoint's names and
    layout. A conversion that joins several in-memory tensors needs them in one bucket; the MoE expert fusion
    reverts each tensor on its own."""
    if not converts_layout(hf_model):
        yield from buckets
        return
    from transformers.core_model_loading import revert_weight_conversion

    for bucket in buckets:
        reverted = revert_weight_conversion(hf_model, dict(bucket))  # pyright: ignore[reportArgumentType]
        yield list(reverted.items())


class InMemoryLayout:
    """The inverse of ``checkpoint_layout`` for an engine that loads synced weights into a transformers model (the
    HF rollout): checkpoint-layout (name, tensor) pairs written into the model's in-memory parameters. Each
    checkpoint tensor's elements go where ``revert_weight_conversion`` took them from, found by reverting a tensor
    of element indices, so every conversion that only moves elements (split, stack, transpose, concatenate)
    inverts exactly; the pieces of one fused tensor may arrive in different buckets."""

    def __init__(self, hf_model: nn.Module):
        self.model = hf_model
        params = hf_model.state_dict()
        self.owner = {name: name for name in params}  # checkpoint name -> in-memory name
        if converts_layout(hf_model):
            from transformers.core_model_loading import revert_weight_conversion

            self.owner = {}
            for name, tensor in params.items():  # names only: reverted on the meta device
                for piece in revert_weight_conversion(hf_model, {name: tensor.to("meta")}):  # pyright: ignore
                    self.owner[piece] = name

    @torch.no_grad()
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Write ``bucket`` into the model; KeyError naming the checkpoint names the model has no place for."""
        unknown = [name for name, _ in bucket if name not in self.owner]
        if unknown:
            raise KeyError(f"update_weights: the HF model has no weights named {unknown}")
        direct = {name: t for name, t in bucket if self.owner[name] == name}
        self.model.load_state_dict(direct, strict=False)
        moved: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in bucket:
            if name not in direct:
                moved.setdefault(self.owner[name], []).append((name, tensor))
        params = self.model.state_dict() if moved else {}  # read now: moving the model replaces its tensors
        for owner, pieces in moved.items():
            self._scatter(owner, params[owner], pieces)

    def _scatter(self, owner: str, target: torch.Tensor, pieces: list[tuple[str, torch.Tensor]]) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        assert target.is_contiguous(), f"{owner}: in-memory parameter is not contiguous"  # view(-1) writes through
        index = torch.arange(target.numel(), device=target.device).view(target.shape)
        positions = revert_weight_conversion(self.model, {owner: index})  # pyright: ignore[reportArgumentType]
        flat = target.view(-1)
        for name, tensor in pieces:
            where = positions[name]
            if tuple(where.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model {tuple(where.shape)}"
                )
            flat[where.reshape(-1)] = tensor.reshape(-1).to(device=flat.device, dtype=flat.dtype)
