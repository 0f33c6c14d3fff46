"""Gradient accumulation over micro-batches and data-parallel ranks, and the guards and tail of a train step, shared
by every training engine (layer 1).

A ``loss_fn`` (backends/base.py ``LossFn``) returns the loss of ONE micro-batch as a mean over some units: valid
tokens (token-mean), sequences (seq-mean-*), rows. Splitting a mini-batch into micro-batches (and over DP ranks)
must not change what is optimised, so the engine needs to know how many units each micro-batch holds:
``loss_fn.count(micro_batch) -> float`` (an optional attribute; without it a micro-batch counts its rows, which is
exact for per-row-mean losses). The mini-batch loss is the mean over ALL its units, on every rank::

    L = sum_i count_i * loss_i / N,     N = sum of count_i over the micro-batches of every DP rank

so micro-batch i back-propagates ``loss_i * count_i / N * dp_size``: FSDP, ZeRO and megatron DDP average the
gradients over the DP ranks, and the ``dp_size`` factor undoes that average. The summed gradient is then exactly
the whole-mini-batch gradient whatever the partition (fixed or dynamic micro-batch sizes, 1 or many ranks). For
a token-mean loss ``count_i`` is the micro-batch's valid-token count and ``N`` the mini-batch's over all ranks
(verl's "global batch info" semantics), computed once per mini-batch with one all-reduce.

Metrics use the same weights: each rank sums ``count_i / N * metric_i`` over its micro-batches and the sums are
added over the DP group, so every rank reports the whole-mini-batch value (``loss`` is exactly L; a loss_fn metric
is its unit-weighted mean, e.g. the global token mean of a clip fraction; a constant stays that constant).

The train step's shared guards and tail, for every engine's ``train_step`` (the HF-model engines of
backends/hf_engine.py, FSDP2 and DeepSpeed, and the Megatron engine):

- ``require_trainable``: a forward-only engine (built with ``optim_config=None``) refuses ``train_step``.
- ``partition_batch``: the micro-batches of a batch, agreed over the DP group (backends/dist.py), refusing an empty
  batch. The count is agreed first, so an empty batch is empty on every rank and every rank raises: none is left
  waiting in a collective.
- ``finish_train_step``: the step-or-skip decision and the metrics ``TrainEngine.train_step`` returns. The global
  gradient norm decides: a non-finite one (a NaN/inf loss or gradient on any rank) skips the optimizer update on
  every rank alike, since the norm is the same everywhere, and the weights stay as they were.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from backends.batching import Partition
from backends.config import EngineConfig, MicroBatching, OptimConfig
from backends.dist import agreed_partition, sum_over_ranks
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)


def loss_units(loss_fn, micro: DataProto) -> float:
    """How many units (tokens, sequences, rows) ``loss_fn`` averages over in ``micro`` (default: its rows)."""
    count = getattr(loss_fn, "count", None)
    return float(len(micro)) if count is None else float(count(micro))


class Accumulation:
    """One mini-batch's micro-batch weights (``count_i / N``) and weighted metric sums; built collectively."""

    def __init__(self, loss_fn, micros: Sequence[DataProto], device: torch.device, group=None):
        counts = [loss_units(loss_fn, m) for m in micros]
        rows = [float(len(m)) for m in micros]
        self.group = group
        self.dp_size = dist.get_world_size(group) if dist.is_initialized() else 1
        total, total_rows = sum_over_ranks([sum(counts), sum(rows)], device, group)
        if total > 0:
            self.weights = [c / total for c in counts]
        else:  # no unit in the whole mini-batch (e.g. every response masked): the loss is 0, keep metrics finite
            self.weights = [r / total_rows for r in rows]
        self._sums: dict[str, float] = defaultdict(float)

    def grad_scale(self, i: int) -> float:
        """The factor micro-batch ``i``'s loss is back-propagated with (see the module docstring)."""
        return self.weights[i] * self.dp_size

    def add(self, i: int, loss: float | torch.Tensor, metrics: dict) -> None:
        """Record micro-batch ``i``'s loss and loss_fn metrics (plain floats or 0-d tensors)."""
        w = self.weights[i]
        self._sums["loss"] += w * float(loss)
        for key, value in metrics.items():
            self._sums[key] += w * float(value)

    def metrics(self) -> dict[str, float]:
        """The whole mini-batch's metrics, identical on every rank of the group (collective). A key some rank
        never reported adds nothing from that rank."""
        if self.dp_size == 1:
            return dict(self._sums)
        gathered: list[dict[str, float] | None] = [None] * self.dp_size
        dist.all_gather_object(gathered, dict(self._sums), group=self.group)
        out: dict[str, float] = defaultdict(float)
        for sums in gathered:  # rank order: every rank adds in the same order, so all get the same bits
            assert sums is not None  # all_gather_object filled every slot
            for key, value in sums.items():
                out[key] += value
        return dict(out)


# ------------------------------------------------------------------------------------ the train step's guards
def require_trainable(optim_config: OptimConfig | None) -> OptimConfig:
    """``optim_config``; a forward-only engine (built with ``optim_config=None``) refuses ``train_step``."""
    if optim_config is None:
        raise RuntimeError("train_step on a forward-only engine (built with optim_config=None)")
    return optim_config


def partition_batch(
    batch: DataProto, cfg: EngineConfig, device: torch.device, group=None, call: MicroBatching | None = None
) -> Partition:
    """``agreed_partition`` of ``batch`` (``call``: one call's micro-batching over ``cfg``'s); a ValueError (on every
    rank of ``group``) when the batch has no rows."""
    parts = agreed_partition(batch, cfg, device, group, call)
    if not parts:
        raise ValueError("an empty batch (no rows on any data-parallel rank): nothing to compute")
    return parts


def finish_train_step(
    sums: dict[str, float],
    lr: float,
    global_step: int,
    grad_norm: Callable[[], float],
    apply_update: Callable[[], object],
) -> dict[str, float]:
    """After the backward passes: ``grad_norm()`` returns the global gradient norm before clipping (the same on every
    rank; the backend clips there or in ``apply_update``); ``apply_update()`` runs only when that norm is finite.
    Returns the train_step metrics: the mini-batch's ``sums`` (backends/accumulation.py) plus ``grad_norm``, the
    ``lr`` this step used and ``step_skipped`` (1.0 when the update was skipped). Zeroing the gradients and
    advancing the LR schedule, skipped or not, stay with the caller."""
    norm = float(grad_norm())
    skipped = not math.isfinite(norm)
    if skipped:
        logger.warning("non-finite grad norm %s at step %d: optimizer step skipped", norm, global_step)
    else:
        apply_update()
    return {**sums, "grad_norm": norm, "lr": lr, "step_skipped": float(skipped)}
