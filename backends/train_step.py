"""What every training engine's ``train_step`` does the same way, whatever the backend (layer 1): the guards before
the micro-batch loop and the tail after the backward passes. Used by the HF-model engines (backends/hf_engine.py,
for FSDP2 and DeepSpeed) and by the Megatron engine.

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
from collections.abc import Callable

import torch

from backends.batching import Partition
from backends.config import EngineConfig, MicroBatching, OptimConfig
from backends.dist import agreed_partition
from scaletrain.protocol import DataProto

logger = logging.getLogger(__name__)


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
