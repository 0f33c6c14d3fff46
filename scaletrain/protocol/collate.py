"""Rows (``DataProto[i]``, DataProtoItems) back into one DataProto: a data loader's collate function (layer 0)."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from tensordict import TensorDict

from scaletrain.protocol.core import DataProto, DataProtoItem
from scaletrain.protocol.errors import DataProtoError


def collate_fn(items: list[DataProtoItem]) -> DataProto:
    """The rows in order, meta_info from the first."""
    if not items:
        raise DataProtoError("collate_fn needs at least one DataProtoItem")
    batch = None
    if items[0].batch is not None:
        rows = [cast(torch.Tensor, item.batch) for item in items]  # torch.stack dispatches to TensorDict's own
        batch = cast(TensorDict, torch.stack(rows)).contiguous()
    non = {}
    for key in items[0].non_tensor_batch:
        non[key] = np.empty(len(items), dtype=object)
        non[key][:] = [item.non_tensor_batch[key] for item in items]
    return DataProto(batch=batch, non_tensor_batch=non, meta_info=items[0].meta_info)
