"""A call's own micro-batch settings (``ForwardOptions.micro_batching``, a typed ``MicroBatching``) override the
engine's:
how ``rollout.log_prob_micro_batch_size_per_gpu`` / ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu``
(and the ref's) size the log-prob passes."""

import pytest
import torch
import torch.distributed as dist

from backends.config import EngineConfig, MicroBatching
from backends.dist import agreed_partition
from scaletrain.protocol import DataProto


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batch(lengths, meta=None):
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return DataProto.from_dict({"attention_mask": mask}, meta_info=meta or {})


def test_meta_overrides_the_engine_settings(single_rank_group):
    engine = EngineConfig(micro_batch_size_per_gpu=4)
    rows = batch([5] * 12)
    assert len(agreed_partition(rows, engine, torch.device("cpu"))) == 3
    fixed = MicroBatching(micro_batch_size_per_gpu=2, use_dynamic_bsz=False, max_token_len_per_gpu=100)
    assert len(agreed_partition(rows, engine, torch.device("cpu"), call=fixed)) == 6
    budget = MicroBatching(micro_batch_size_per_gpu=2, use_dynamic_bsz=True, max_token_len_per_gpu=20)
    parts = agreed_partition(rows, engine, torch.device("cpu"), call=budget)
    assert len(parts) == 3 and all(len(p) == 4 for p in parts)  # 4 rows x 5 tokens fit a 20-token budget
