"""Resuming an engine checkpoint on another backend or layout (layer 1): its state by Hugging Face name.

A checkpoint written by one backend with one layout (fsdp on N ranks, DeepSpeed ZeRO-3 on N ranks, megatron
TP x PP x DP) is read back with that backend's offline reader (meta.py ``CHECKPOINT_READERS``, the model merger's):
the full parameters and Adam's two moments, each under its HF name, plus the engine's step count from the
checkpoint's meta. The engine resuming it (any backend, any layout) takes its own shard of each: the parameters,
the optimizer's fp32 master copy where it keeps one, ``exp_avg`` / ``exp_avg_sq``, Adam's step and the LR
schedule at that step. The moments are element-wise, so the mapping that places a parameter (a TP split, megatron's
fused QKV) places its moments too.

Not carried over: the RNG streams (each rank keeps the seeded streams it started with: the sampled rollouts and
dropout masks differ from an uninterrupted run's, the greedy ones do not), and a LoRA checkpoint (its adapters
resume on their own backend; fsdp on any data-parallel size). Each rank reads the whole state once (the model and
its two moments, in memory together); the converter, which streams, is the tool for a model too big for that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from backends.checkpoint.meta import CHECKPOINT_READERS, STATES, read_checkpoint_meta

logger = logging.getLogger(__name__)

_BUCKET_BYTES = 256 << 20


@dataclass
class PortableState:
    """A checkpoint's training state by HF name, full tensors: ``params`` (every name the model has, tied ones
    included where the checkpoint has them), ``moments[state][name]`` for each trained parameter."""

    path: str
    meta: dict
    params: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.meta["global_step"])

    def moment(self, state: str, name: str) -> torch.Tensor:
        """Moment ``state`` (``exp_avg`` | ``exp_avg_sq``) of parameter ``name``."""
        found = self.moments[state].get(name)
        if found is None:
            raise KeyError(f"{self.path}: no {state} for '{name}' (the checkpoint's optimizer state lacks it)")
        return found


def read_portable_state(
    path: str, architecture: str, hf_names: list[str], trainable: bool, where: str
) -> PortableState:
    """The state of checkpoint ``path`` for an engine of ``architecture`` whose HF state dict has ``hf_names``;
    ``trainable``: with the moments. ``where``: this engine, for the log line. A clear error naming the checkpoint
    when it holds another model, an adapter alone, or no step count."""
    meta = read_checkpoint_meta(path)
    if meta["architecture"] != architecture:
        raise ValueError(f"{path} holds a {meta['architecture']}, this run's model is a {architecture}")
    if meta["lora"] is not None:
        raise ValueError(
            f"{path} holds LoRA adapters: they resume on the backend and layout that wrote them ({meta['backend']}, "
            f"{meta['layout']}; fsdp on any data-parallel size)"
        )
    if "global_step" not in meta:
        raise ValueError(f"{path} was written before checkpoints recorded their step: it resumes on its own layout")
    reader = CHECKPOINT_READERS.get(meta["backend"])
    layout = {k: v for k, v in meta["layout"].items() if k != "places"}
    logger.info("resuming %s (%s, %s) on %s through HF names", path, meta["backend"], layout, where)
    states = {}
    for state in STATES if trainable else STATES[:1]:
        states[state] = {
            name: tensor.detach().contiguous()  # a reader may hand out views
            for bucket in reader(path, meta, hf_names, _BUCKET_BYTES, state=state)
            for name, tensor in bucket
        }
    params = states.pop("param")
    missing = [n for n in hf_names if n not in params and n not in meta["tied_names"]]
    if missing:
        raise ValueError(f"{path}: no tensor for {len(missing)} of the model's parameters: {missing[:4]}")
    return PortableState(path, meta, params, states)
