"""Mixture-of-experts routers in the HF-model engines (layer 1): their auxiliary losses and per-step metrics.

transformers' MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) route each token through a ``*TopKRouter`` module
returning ``(router_logits, scores, expert_indices)``. ``RouterRecorder`` hooks those modules and keeps, for one
training forward, every layer's router logits and chosen experts; its ``terms()`` turns them into

- ``router_aux_loss``: the load-balancing loss of the Switch Transformer (transformers' own
  ``load_balancing_loss_func``, the value HF's ``output_router_logits=True`` adds), over the micro-batch's real
  tokens (padding excluded);
- ``router_z_loss``: ST-MoE's z-loss, the mean over tokens and layers of ``logsumexp(router_logits)^2``;
- ``router_load_imbalance``: per layer the most loaded expert's share of the top-k assignments over the mean share
  (1.0: perfectly balanced; ``num_experts / top_k`` at worst), averaged over the layers.

The model section's ``router_aux_loss_coef`` / ``router_z_loss_coef`` (default 0: RL post-training leaves the
router to the policy loss, as verl's FSDP actor does) add ``coef x term`` to each micro-batch's loss; the metrics are
reported either way. The recorder is armed only for the forward pass: activation recomputation in the backward
re-runs the routers, and those calls are not counted twice. These models route every token (no expert capacity),
so no token is dropped and no dropped-token count exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

ROUTER_SUFFIX = "TopKRouter"  # transformers' router modules: Qwen3MoeTopKRouter, MixtralTopKRouter, ...


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE router modules (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX) and hasattr(m, "top_k")]


def num_experts(config) -> int:
    """How many experts a model config's MoE layers hold (0: a dense model); a vision-language config's text part."""
    text = getattr(config, "text_config", None) or config
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):  # Qwen-MoE, Mixtral, DeepSeek
        if getattr(text, name, None):
            return int(getattr(text, name))
    return 0


def check_router_coefficients(aux_coef: float, z_coef: float, key: str = "model") -> None:
    """A ValueError naming ``<key>.<name>`` for a coefficient that is not a number >= 0."""
    for name, value in (("router_aux_loss_coef", aux_coef), ("router_z_loss_coef", z_coef)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{key}.{name} must be a number >= 0, got {value!r}")


def check_router_settings(model: nn.Module, aux_coef: float, z_coef: float, key: str = "model") -> None:
    """ValueErrors for coefficients that cannot apply: negative ones, or non-zero ones on a model without a router."""
    check_router_coefficients(aux_coef, z_coef, key)
    for name, value in (("router_aux_loss_coef", aux_coef), ("router_z_loss_coef", z_coef)):
        if value and not routers(model):
            raise ValueError(
                f"{key}.{name}={value} but {type(model).__name__} has no mixture-of-experts router "
                f"(no *{ROUTER_SUFFIX} module): set it to 0 for a dense model"
            )


@dataclass
class RouterRecorder:
    """Records the routers' outputs of the forward passes run inside ``recording(valid)``."""

    model: nn.Module
    logits: list[torch.Tensor] = field(default_factory=list)  # per router call: (tokens, experts)
    chosen: list[torch.Tensor] = field(default_factory=list)  # per router call: (tokens, top_k) expert indices
    valid: torch.Tensor | None = None  # (tokens,) bool: the real tokens of the recorded forward (None: all)
    top_k: int = 0
    num_experts: int = 0
    _armed: bool = False

    def __post_init__(self) -> None:
        found = routers(self.model)
        # transformers' routers keep these as plain ints (nn.Module.__getattr__ types them as tensors or modules)
        self.top_k = int(getattr(found[0], "top_k")) if found else 0  # noqa: B009
        self.num_experts = int(getattr(found[0], "num_experts")) if found else 0  # noqa: B009
        for router in found:
            router.register_forward_hook(self._hook)

    @property
    def active(self) -> bool:
        return self.num_experts > 0

    def _hook(self, module, args, output) -> None:
        if self._armed:
            self.logits.append(output[0])
            self.chosen.append(output[2])

    @contextlib.contextmanager
    def recording(self, valid: torch.Tensor | None) -> Iterator[None]:
        """Record the router calls of the forward run inside; ``valid``: which of the flattened tokens are real
        (the padded path's ``attention_mask``; None on the packed path, where every token is)."""
        self.logits, self.chosen = [], []
        self.valid = None if valid is None else valid.reshape(-1).bool()
        self._armed = self.active
        try:
            yield
        finally:
            self._armed = False

    def terms(self) -> dict[str, torch.Tensor]:
        """The recorded forward's ``router_aux_loss`` and ``router_z_loss`` (with gradient) and
        ``router_load_imbalance`` (without); empty when nothing was recorded."""
        if not self.logits:
            return {}
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        tokens = self.logits[0].shape[0]
        if self.valid is not None and self.valid.numel() != tokens:
            raise RuntimeError(f"the routers saw {tokens} tokens, the token mask has {self.valid.numel()}")
        mask = self.valid.float() if self.valid is not None else None
        aux = load_balancing_loss_func(tuple(self.logits), self.num_experts, self.top_k, mask)  # pyright: ignore
        assert isinstance(aux, torch.Tensor)  # 0 only without logits, excluded above
        z = torch.stack([_masked_mean(torch.logsumexp(lg.float(), -1).square(), mask) for lg in self.logits]).mean()
        return {"router_aux_loss": aux, "router_z_loss": z, "router_load_imbalance": self._imbalance(mask)}

    def _imbalance(self, mask: torch.Tensor | None) -> torch.Tensor:
        per_layer = []
        with torch.no_grad():
            for chosen in self.chosen:
                weights = None if mask is None else mask.repeat_interleave(self.top_k)
                load = torch.bincount(chosen.reshape(-1), weights=weights, minlength=self.num_experts).float()
                per_layer.append(load.max() / load.mean().clamp(min=1e-12))
        return torch.stack(per_layer).mean()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def add_router_terms(
    loss: torch.Tensor, metrics: dict, terms: dict[str, torch.Tensor], aux_coef: float, z_coef: float
) -> tuple[torch.Tensor, dict]:
    """``loss`` plus the coefficients times the router losses, and ``metrics`` with the three router terms."""
    if not terms:
        return loss, metrics
    total = loss + aux_coef * terms["router_aux_loss"] + z_coef * terms["router_z_loss"]
    return total, {**metrics, **{k: float(v.detach()) for k, v in terms.items()}}
