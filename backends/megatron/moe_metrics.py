"""The megatron engine's router metrics for a mixture-of-experts model (layer 1), named as the HF engines'
(backends/moe.py) but measured on megatron's routers, and the padding mask that keeps pads out of them
(``router_padding``):

- ``router_load_imbalance``: per MoE layer and training micro-batch, the busiest expert's routed tokens over the mean
  (1.0: even), from the routing map a forward hook on each megatron ``TopKRouter`` sees, pads left out (the
  engine's ``padding_mask``); averaged over every layer and micro-batch of every rank.
- ``router_aux_loss`` / ``router_z_loss`` (only while their coefficient is set): megatron-core's own per-layer
  load-balancing loss (E * sum_e f_e P_e with f_e the share of the k routing slots sent to expert e, Switch's loss
  divided by k) and z-loss (mean squared log-sum-exp of the router logits), as its loss tracker records them,
  averaged over micro-batches and layers, then over the data-parallel ranks. The HF engines use transformers' loss
  over all layers' tokens at once, so the two backends' values differ in definition; megatron adds its own to the
  gradient (backends/megatron/model.py), which is why they are read back here rather than recomputed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TRACKED = {"load_balancing_loss": "router_aux_loss", "z_loss": "router_z_loss"}


def router_padding(padding: torch.Tensor, layout, tp_rank: int, shard: bool) -> dict[str, torch.Tensor]:
    """A MoE model's ``padding_mask`` argument (True at pads; {} for a dense model): megatron's routers leave pads
    out of their load-balancing and z-losses (RouterMetrics out of the load). Megatron scatters it over the
    sequence-parallel ranks on the first pipeline stage only; ``shard``: a later stage's, cut here."""
    if not layout.num_experts:
        return {}
    if shard:
        padding = padding.chunk(layout.tp, dim=1)[tp_rank].contiguous()
    return {"padding_mask": padding}


class RouterMetrics:
    """Collects the step's router statistics of a megatron GPTModel (no-op for a dense model)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, router_coefs: tuple[float, float]):
        """``router_coefs``: the engine's (load-balancing, z) loss coefficients; a loss is reported while its
        coefficient is set (megatron's tracker is per process, shared with other engines)."""
        self.device = device
        self.tracked = [name for name, coef in zip(_TRACKED, router_coefs) if coef > 0]
        self.routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        self.imbalance: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        # once per training micro-batch: under activation recompute the first forward runs without grad
        if not (module.training and torch.is_grad_enabled()):
            return
        routed = output[1]  # (tokens, experts) routing map, tokens in megatron's (sequence, batch) order
        # the MoE layer's padding mask, (sequence, batch), True at pads
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        if padding is not None:
            routed = routed[~padding.reshape(-1)]
        load = routed.sum(dim=0).float()  # tokens per expert
        self.imbalance.append(load.max() / load.mean().clamp_min(1e-12))

    def step_metrics(self, micro_batches: int) -> dict[str, float]:
        """The step's metrics (collective over the world; every rank returns the same), then a fresh start."""
        if not self.routers:
            return {}
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        stats = torch.tensor([float(sum(self.imbalance)), float(len(self.imbalance))], device=self.device)
        self.imbalance = []
        dist.all_reduce(stats)
        out = {"router_load_imbalance": float(stats[0] / stats[1].clamp_min(1.0))}
        tracker = get_moe_layer_wise_logging_tracker()
        for name in self.tracked:
            metric = _TRACKED[name]
            values = tracker[name]["values"].to(self.device).clone()  # per layer, this stage's layers, summed
            dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())  # over micro-batches
            value = values.mean() / micro_batches
            dist.all_reduce(value, group=ps.get_data_parallel_group())  # gloo has no AVG
            out[metric] = float(value) / ps.get_data_parallel_world_size()
        clear_aux_losses_tracker()
        return out
