"""Vision-language models in the training engines' forward (Qwen2-VL / Qwen2.5-VL: a vision tower whose patch
embeddings replace the image pad tokens, and 3-D "M-RoPE" positions).

A batch row with images carries its processor outputs in the non-tensor column ``multi_modal_inputs``
(``pixel_values``: (patches, dim), ``image_grid_thw``: (images, 3); scaletrain/data/vision.py); a micro-batch's are
concatenated in row order (``gather_vision_inputs``), the order in which the model consumes image pad tokens.

The policy never emits a vision special token (image / video pad, vision start / end): the rollout suppresses
them and the trainer's log-probs and entropy exclude them (``mask_vision_tokens``), so both describe the same
distribution; a model token holding one is refused (``refuse_vision_tokens_in_responses``). A tool turn's image
tokens (mask 0, a multi-turn trajectory's) are no action: their log-probs are 0.

Under FSDP or ZeRO-3 every rank must run the same modules in the same order: a micro-batch without images runs the
vision tower on a blank image where the model would run it and adds 0 x its output (``idle_vision_tower``).

Positions: the batch keeps text positions (0, 1, ... per row). The model's 3-D positions follow from the ids, the
image grid and the mask (its ``get_rope_index``, told which ids are image or video tokens); ``mrope_positions``
computes them on the padded micro-batch. The packed (remove-padding) forward takes them with the text positions
prepended, (4, 1, total): transformers finds the rows' boundaries from that first row, as for a text model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

VISION_INPUTS = ("pixel_values", "image_grid_thw")
MASKED_LOGIT = -1e30  # a vision special token's logit in the policy (see mask_vision_tokens)
MULTI_MODAL_INPUTS = "multi_modal_inputs"  # the non-tensor column holding each row's vision inputs


def hf_config(model: nn.Module) -> Any:
    """The HF config of a model, through the wrappers that hold it as ``module`` (DeepSpeed's engine, whose own
    ``config`` is DeepSpeed's)."""
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    if isinstance(config, PretrainedConfig):
        return config
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        return hf_config(inner)
    raise ValueError(f"{type(model).__name__} has no Hugging Face config")


def is_vision_language(config: Any) -> bool:
    """Whether an HF config is a vision-language model's (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def causal_lm_class(config: Any) -> Any:
    """The transformers auto class of a generating model with ``config``: AutoModelForImageTextToText for a
    vision-language model, AutoModelForCausalLM for a text one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


@functools.cache
def _classifier(config_class: type, kind: str) -> type:
    from transformers import AutoModel, AutoModelForImageTextToText
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification

    # the backbone (e.g. Qwen2_5_VLModel: the vision tower and the language model, no head)
    backbone: type = AutoModel._model_mapping[config_class]  # pyright: ignore[reportAssignmentType]
    pretrained = next(c for c in backbone.__mro__ if c.__name__.endswith("PreTrainedModel") and c is not backbone)
    generic, suffix = {
        "value": (GenericForTokenClassification, "ForTokenClassification"),
        "reward": (GenericForSequenceClassification, "ForSequenceClassification"),
    }[kind]
    name = backbone.__name__.removesuffix("Model") + suffix
    # the checkpoint keys are the generating model's (model.*, visual.*): load and save them as that class does
    generating: type = AutoModelForImageTextToText._model_mapping[config_class]  # pyright: ignore[reportAssignmentType]
    conversions = get_checkpoint_conversion_mapping(generating.__name__) or []
    register_checkpoint_conversion_mapping(name, conversions, overwrite=True)
    return type(name, (generic, pretrained), {"__module__": __name__})


def head_model_class(config: Any, kind: str) -> Any:
    """The transformers class of a ``kind`` model ("value": a value per token, "reward": a score per sequence)
    with ``config``: AutoModelForTokenClassification / AutoModelForSequenceClassification for a text model; for a
    vision-language model (transformers ships no classifier of the Qwen2-VL family) its backbone (the vision tower
    and the language model, ``model.*``, the keys of its generating checkpoint) under transformers' generic
    token / sequence classification head (``score``), named like the auto classes would name it
    (Qwen2_5_VLForTokenClassification): the critic and the reward model read the images as the actor does."""
    if not is_vision_language(config):
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

        return {"value": AutoModelForTokenClassification, "reward": AutoModelForSequenceClassification}[kind]
    return _classifier(type(config), kind)


def vision_keys(non_tensor_batch: dict[str, Any]) -> list[str]:
    """The non-tensor keys of a batch that hold its rows' vision inputs: ``[MULTI_MODAL_INPUTS]`` when the batch has
    that column, else ``[]`` (for a ``select`` / ``pop`` that must carry the images with the ids)."""
    return [MULTI_MODAL_INPUTS] if MULTI_MODAL_INPUTS in non_tensor_batch else []


def gather_vision_inputs(
    column: np.ndarray | Sequence[dict[str, Any]] | None, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The micro-batch's vision inputs: each name's tensors of the rows with images, concatenated in row order
    ({} when no row has images). A trajectory's renders (a prompt's images, then a tool answer's) join the same way."""
    rows = [inputs for inputs in (column if column is not None else ()) if inputs]
    if not rows:
        return {}
    unknown = sorted({k for inputs in rows for k in inputs} - set(VISION_INPUTS))
    if unknown:
        raise ValueError(f"{MULTI_MODAL_INPUTS}: inputs {unknown} are not supported (images: {list(VISION_INPUTS)})")
    return {name: torch.cat([inputs[name] for inputs in rows]).to(device) for name in VISION_INPUTS}


def _rope_module(model: nn.Module) -> nn.Module:
    """The submodule that defines ``get_rope_index`` (the VL model under its LM head, PEFT or FSDP wrappers)."""
    for module in model.modules():
        if hasattr(type(module), "get_rope_index"):
            return module
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen2-VL family model")


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder of a vision-language model (Qwen2-VL family: ``visual``; LLaVA-style: ``vision_tower`` or
    ``vision_model``), found under the LM head and PEFT wrappers."""
    for module in model.modules():
        for name in ("visual", "vision_tower", "vision_model"):
            tower = getattr(module, name, None)
            if isinstance(tower, nn.Module):
                return tower
    raise ValueError(f"{type(model).__name__} has no vision tower (visual / vision_tower / vision_model)")


def freeze_vision_tower(model: nn.Module) -> None:
    """verl's ``actor.freeze_vision_tower``: the vision encoder gets no gradient (the optimizers take parameters with
    ``requires_grad`` only, backends/optim.py); the language model and the vision-to-text merger under it train on.
    Qwen2-VL's merger sits inside ``visual`` and is frozen with it, as in verl."""
    vision_tower(model).requires_grad_(False)


def vision_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``mm_token_type_ids``: 1 at image pad tokens, 2 at video pad tokens, 0 elsewhere."""
    token_types = torch.zeros_like(input_ids, dtype=torch.int32)
    token_types[input_ids == config.image_token_id] = 1
    video_id = getattr(config, "video_token_id", None)
    if video_id is not None:
        token_types[input_ids == video_id] = 2
    return token_types


def vision_special_tokens(config: Any) -> list[int]:
    """The ids a rollout must never sample: the image / video pads and the vision start / end markers."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [i for i in (getattr(config, name, None) for name in names) if i is not None]


def is_vision_special(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Where ``ids`` hold a vision special token (image / video pad, vision start / end)."""
    return torch.isin(ids, torch.tensor(vision_special_tokens(config), device=ids.device))


def mask_vision_tokens(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """The logits with the vision special tokens out of reach (a large negative value, finite so that entropy's
    p * logit stays 0): the policy's actions are text tokens, the distribution the rollout samples from."""
    ids = torch.tensor(vision_special_tokens(config), device=logits.device)
    return logits.index_fill(-1, ids, MASKED_LOGIT)


def mrope_positions(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, vision: dict[str, torch.Tensor]
) -> torch.Tensor:
    """(3, b, T) temporal / height / width positions of a padded micro-batch (text tokens: the same value thrice)."""
    token_types = vision_token_types(hf_config(model), input_ids)
    positions, _ = _rope_module(model).get_rope_index(  # pyright: ignore[reportCallIssue]
        input_ids, token_types, vision.get("image_grid_thw"), None, attention_mask=attention_mask
    )
    return positions


def vision_forward_kwargs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vision: dict[str, torch.Tensor],
    packed_text_positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The model's vision inputs and ``position_ids``: (3, b, T) for the padded forward, or with
    ``packed_text_positions`` (1, total) the packed forward's (4, 1, total)."""
    positions = mrope_positions(model, input_ids, attention_mask, vision)
    if packed_text_positions is not None:
        valid = positions[:, attention_mask.bool()]  # (3, total): the packed order is row by row
        positions = torch.cat([packed_text_positions, valid])[:, None, :]
    return {**vision, "position_ids": positions}


def check_image_tokens(config: Any, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> None:
    """The batch's image pad tokens number its images' merged patches: a prompt whose vision inputs were dropped on
    the way (the rows' ``multi_modal_inputs`` column not passed) would otherwise run with its image pads read as
    text, silently (transformers checks the count only when pixel values come)."""
    pads = int((input_ids == config.image_token_id).sum())
    grid = vision.get("image_grid_thw")
    merge = config.vision_config.spatial_merge_size
    expected = 0 if grid is None else int(grid.prod(-1).sum()) // merge**2
    if pads != expected:
        raise ValueError(
            f"the batch holds {pads} image pad tokens but its vision inputs ({MULTI_MODAL_INPUTS}) give {expected} "
            "image tokens: pass each row's multi_modal_inputs with its prompt"
        )


def refuse_vision_tokens_in_responses(config: Any, responses: torch.Tensor | None, valid: torch.Tensor) -> None:
    """A generated image or video pad token would be taken for a placeholder of vision features: the rollout must
    never sample one (it suppresses them for a vision-language model); ValueError naming the rows otherwise."""
    if responses is None:
        return
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    ids = [i for i in ids if i is not None]
    found = torch.isin(responses, torch.tensor(ids, device=responses.device)) & valid
    if bool(found.any()):
        rows = sorted({int(r) for r in found.nonzero()[:, 0]})
        raise ValueError(
            f"responses of rows {rows} hold the model's image / video pad token ({ids}): the rollout must not sample "
            "vision placeholder tokens"
        )


@contextlib.contextmanager
def idle_vision_tower(model: nn.Module, device: torch.device | str) -> Iterator[None]:
    """For a forward without images: the vision tower runs on one blank image of a single merged patch where the
    model runs it for images (right after the token embedding, before the language model: a hook on the embedding),
    and 0 x its output joins the embeddings. Every rank then runs the same modules in the same order per
    micro-batch, as the ranks with images do (FSDP and ZeRO-3 gather weights collectively: a rank that skipped the
    tower, or ran it elsewhere, would leave the others waiting), and nothing changes."""
    vl_model = _rope_module(model)
    vision = hf_config(model).vision_config
    merge = vision.spatial_merge_size
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2

    def after_embedding(module, args, output):
        pixels = torch.zeros(merge * merge, dim, device=device)
        grid = torch.tensor([[1, merge, merge]], device=device)
        features = vl_model.get_image_features(pixels, grid).pooler_output  # pyright: ignore[reportCallIssue]
        return output + torch.cat(list(features)).sum() * 0.0

    hook = vl_model.get_input_embeddings().register_forward_hook(after_embedding)  # pyright: ignore[reportCallIssue]
    try:
        yield
    finally:
        hook.remove()
