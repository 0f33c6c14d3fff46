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
