"""Reading a DeepSpeed ZeRO-3 checkpoint back as full tensors in one process (layer 1, the offline converter's
DeepSpeed reader: ``python -m scaletrain.model_merger``, and a resume on another backend or layout).

DeepSpeed's own tool does the work: ``deepspeed.utils.zero_to_fp32`` rebuilds each parameter (and, fed the
moments' partitions instead, each Adam moment) from the ranks' fp32 partitions of the optimizer files, lazily
(``lazy_mode``: the files are memory-mapped and a parameter is assembled only when its bucket is drawn). Its
``torch.load`` calls use ``weights_only=False``; here they run with ``weights_only=True`` and the two DeepSpeed
classes the files hold allowed (backends/checkpoint/safe_load.py), so a tampered file is refused, naming it, before
anything of it runs.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
from collections.abc import Iterator

import torch

from backends.base import bucketed
from backends.checkpoint.meta import CHECKPOINT_READERS
from backends.checkpoint.safe_load import load_rank_file
from backends.deepspeed.engine import CKPT_TAG, deepspeed_checkpoint_classes


class _TorchLoadingWeightsOnly:
    """torch, but ``load`` is weights-only: stands in for the name ``torch`` inside DeepSpeed's module."""

    @staticmethod
    def load(f, map_location=None, mmap=False, weights_only=False):
        return load_rank_file(f, map_location, allowed=deepspeed_checkpoint_classes(), mmap=mmap)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextlib.contextmanager
def _weights_only_loads(module):
    """``module``'s ``torch.load`` calls weights-only for the duration (its global name, not torch's own)."""
    original, module.torch = module.torch, _TorchLoadingWeightsOnly()
    try:
        yield
    finally:
        module.torch = original


@CHECKPOINT_READERS.register("deepspeed")
def read_deepspeed_checkpoint(
    path: str, meta: dict, hf_names: list[str], bucket_bytes: int, state: str = "param"
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trained parameters under the engine's names (fp32, DeepSpeed's master copy), or with ``state`` an Adam
    moment of each, in buckets."""
    from deepspeed.utils import zero_to_fp32

    _check_files(os.path.join(path, CKPT_TAG), meta["layout"]["dp"])
    # it prints each file it reads and a progress bar: the converter's console shows its own lines
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        with _weights_only_loads(zero_to_fp32):
            if state == "param":
                tensors = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    path, tag=CKPT_TAG, exclude_frozen_parameters=meta["lora"] is not None, lazy_mode=True
                )
            else:
                tensors = _moments(zero_to_fp32, os.path.join(path, CKPT_TAG), state)
    assert tensors is not None  # DeepSpeed's annotation allows None; it returns a dict or raises
    items = (
        (name, math.prod(t.shape) * 4, lambda t=t: t if isinstance(t, torch.Tensor) else t.contiguous())
        for name, t in tensors.items()
    )
    yield from bucketed(items, bucket_bytes)


def _moments(zero_to_fp32, tag_dir: str, state: str) -> dict:
    """Adam moment ``state`` of each trained parameter: DeepSpeed's own reassembly of the fp32 master weights
    (each rank's flat partition per parameter group, cut at the parameters' boundaries), fed the moment's flat
    partitions instead (the same shape: ZeRO-3 keeps one optimizer entry per flat fp32 group)."""
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(tag_dir))
    flat_groups = []
    for file in zero_to_fp32.get_optim_files(tag_dir):
        saved = load_rank_file(file, "cpu", allowed=deepspeed_checkpoint_classes(), mmap=True)
        inner = saved["optimizer_state_dict"]["optimizer_state_dict"]  # the client optimizer's (torch AdamW)
        order = [index for group in inner["param_groups"] for index in group["params"]]
        flat_groups.append([inner["state"][index][state] for index in order])
    merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(len(flat_groups), flat_groups, model_states, True)
    trained = {name for shapes in model_states[0].param_shapes for name in shapes}
    shared = {alias for alias, source in model_states[0].shared_params if source in trained}
    return {name: t for name, t in merged.items() if name in trained or name in shared}


def _check_files(tag_dir: str, ranks: int) -> None:
    """Each rank's model-states and optimizer-states file is there (a cut one fails when it is read, named)."""
    for rank in range(ranks):
        for kind in ("model", "optim"):
            if not glob.glob(os.path.join(tag_dir, f"*zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")):
                raise FileNotFoundError(
                    f"{tag_dir}: no zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt: rank {rank}'s file is missing"
                )
