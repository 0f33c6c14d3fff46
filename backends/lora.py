"""LoRA adapters on the HF training engines (fsdp, deepspeed): wrapping the HF model with PEFT.

With ``ModelConfig.lora_rank > 0``, ``build_model`` (backends/hf_model.py) passes the HF model to ``wrap_lora``:
a fresh adapter (``peft.LoraConfig`` from the ModelConfig keys, dropout 0 so a forward is deterministic) or the
trained one at ``lora_adapter_path`` (``PeftModel.from_pretrained(..., is_trainable=True)``). PEFT freezes every base
weight, so the engines' optimizers (backends/optim.py takes parameters with ``requires_grad`` only) hold state for
the adapters alone. A value or reward model also trains its head: the head gets no adapter and is a PEFT
``modules_to_save`` copy (the original stays frozen and is what the model uses with the adapters disabled). On a
vision-language model the adapters go on the language model: the vision tower (and its merger) gets none and stays
frozen, as in verl.

Supported: adapters on ``nn.Linear`` layers (what ``target_modules="all-linear"`` picks), not on a layer whose weight
is tied to another (a tied ``lm_head``), no DoRA. The names and the merge of the exported weights are
backends/lora_weights.py's.
"""

from __future__ import annotations

import os
import re

from torch import nn

from backends.config import ModelConfig
from backends.vision import is_vision_language, vision_tower

ADAPTER = "default"  # PEFT's name of the one adapter
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "value": "TOKEN_CLS", "reward": "SEQ_CLS"}
HEAD_NAMES = ("score", "classifier")  # the classification head of a value / reward model


def lora_enabled(model_config: ModelConfig) -> bool:
    return model_config.lora_rank > 0


def wrap_lora(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """``model`` as a PEFT model whose only trainable parameters are the adapters (and a value/reward head)."""
    from peft import PeftModel, get_peft_model

    if model_config.lora_adapter_path is not None:
        path = _check_adapter_path(model_config)
        peft_model = PeftModel.from_pretrained(model, path, adapter_name=ADAPTER, is_trainable=True)
    else:
        config = lora_config(model, model_config)
        try:
            peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
        except ValueError as e:  # PEFT's message names neither key
            raise ValueError(f"model.target_modules / model.exclude_modules: {e}") from e
    _check_supported_layers(peft_model)
    return peft_model


def lora_config(model: nn.Module, model_config: ModelConfig):
    """The ``peft.LoraConfig`` of the ModelConfig keys for ``model`` (its kind decides the head handling)."""
    from peft import LoraConfig

    target = model_config.target_modules
    exclude = model_config.exclude_modules
    target = target if isinstance(target, str) else list(target)
    exclude = exclude if exclude is None or isinstance(exclude, str) else list(exclude)
    modules_to_save = None
    if is_vision_language(getattr(model, "config", None)):  # LoRA on the language model: the vision tower stays
        exclude = _exclude_vision_tower(model, exclude)
    if model_config.kind != "causal_lm":
        head = head_name(model)
        exclude, modules_to_save = _exclude_head(exclude, head), [head]
    return LoraConfig(
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        lora_dropout=0.0,
        target_modules=target,
        exclude_modules=exclude,
        modules_to_save=modules_to_save,
        task_type=TASK_TYPES[model_config.kind],
        bias="none",
    )


def head_name(model: nn.Module) -> str:
    for name in HEAD_NAMES:
        if isinstance(getattr(model, name, None), nn.Module):
            return name
    raise ValueError(f"model.lora_rank: cannot find the head of {type(model).__name__} (looked for {HEAD_NAMES})")


def _exclude_head(exclude, head: str):
    """``exclude_modules`` plus the head, in the form PEFT matches: a list by name, a string as a full-match regex."""
    if exclude is None:
        return [head]
    if isinstance(exclude, str):
        return f"(?:{exclude})|(?:(?:.*\\.)?{head})"
    return [*exclude, head]


def _exclude_vision_tower(model: nn.Module, exclude):
    """``exclude_modules`` plus every module of the vision tower (its merger included), as a full-match regex (a
    list's names match as PEFT matches them: the name or its last dotted parts)."""
    tower = vision_tower(model)
    prefix = next(name for name, module in model.named_modules() if module is tower)
    tower_regex = f"(?:{re.escape(prefix)}(?:\\..*)?)"
    if exclude is None:
        return tower_regex
    if isinstance(exclude, str):
        return f"(?:{exclude})|{tower_regex}"
    return "|".join([*(f"(?:(?:.*\\.)?{re.escape(name)})" for name in exclude), tower_regex])


def _check_adapter_path(model_config: ModelConfig) -> str:
    """The adapter directory, after checking it holds a PEFT LoRA adapter of rank ``lora_rank``."""
    import json

    path = model_config.lora_adapter_path
    assert path is not None  # wrap_lora calls this only with an adapter path
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model.lora_adapter_path: {path} is not a PEFT adapter directory (no adapter_config.json)")
    with open(config_file) as f:
        saved = json.load(f)
    if saved.get("peft_type") != "LORA":
        raise ValueError(f"model.lora_adapter_path: {path} holds a {saved.get('peft_type')} adapter, not LoRA")
    if saved.get("r") != model_config.lora_rank:
        raise ValueError(
            f"model.lora_adapter_path: the adapter at {path} has rank {saved.get('r')}, "
            f"model.lora_rank is {model_config.lora_rank}: set them equal"
        )
    return path


def _check_supported_layers(peft_model: nn.Module) -> None:
    """Refuse what the merged export (backends/lora_weights.py) cannot merge: non-Linear layers, DoRA, tied ones."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    shared = _shared_parameter_ids(peft_model)
    layers = [(name, m) for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    for name, module in layers:
        if type(module) is not LoraLinear or not isinstance(module.get_base_layer(), nn.Linear):
            raise ValueError(
                f"model.target_modules: {name} is a {type(module.get_base_layer()).__name__}; LoRA is "
                "supported on nn.Linear layers only"
            )
        if module.use_dora.get(ADAPTER, False) or module.fan_in_fan_out:
            raise ValueError(f"model.lora_adapter_path: {name} uses DoRA or fan_in_fan_out, which are not supported")
        if id(module.get_base_layer().weight) in shared:
            raise ValueError(f"model.target_modules: {name}'s weight is tied to another layer; exclude it")


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    seen, shared = set(), set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared
