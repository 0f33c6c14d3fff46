"""verl's sequence-balancing helpers (``scaletrain.compat.verl.utils.seqlen_balancing``) over scaletrain's
partitioners: verl's contract for partitions, verl's micro-batch count (the minimum, the most any of two gloo ranks
needs, the round-up), the way back to the original order, and uid runs kept whole. verl's own tests of this module
are not in its sdist; ``make test-verl VERL_CHECKOUT=<clone>`` runs them too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

from scaletrain.compat.verl import DataProto
from scaletrain.compat.verl.utils.seqlen_balancing import (
    calculate_workload,
    ceildiv,
    get_group_balanced_partitions,
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    greedy_partition,
    log_seqlen_unbalance,
    prepare_dynamic_batch,
    rearrange_micro_batches,
    restore_dynamic_batch,
)
from scaletrain.utils.errors import InvalidInput


def _batch(valid: list[int], width: int = 16) -> TensorDict:
    mask = torch.zeros(len(valid), width, dtype=torch.long)
    for row, n in enumerate(valid):
        mask[row, width - n :] = 1  # left padding
    ids = torch.arange(len(valid) * width).view(len(valid), width)
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(valid)])


@pytest.mark.parametrize("split", [get_seqlen_balanced_partitions, greedy_partition])
def test_partitions_cover_every_row_once_with_balanced_sums(split):
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    for equal_size in (False, True):
        parts = split(lengths, 4, equal_size)
        assert len(parts) == 4 and all(p == sorted(p) and p for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(8))
        assert [sum(lengths[i] for i in p) for p in parts] == [10] * 4  # the best split exists: it is found
        if equal_size:
            assert all(len(p) == 2 for p in parts)
    with pytest.raises(InvalidInput, match=r"number of items:\[3\] < k_partitions:\[4\]"):
        get_seqlen_balanced_partitions([1, 2, 3], 4, False)
    with pytest.raises(AssertionError, match="equal size"):  # verl asserts: its callers catch AssertionError
        get_seqlen_balanced_partitions([1, 2, 3], 2, True)


def test_the_differencing_method_beats_longest_first_on_its_classic_example():
    lengths = [8, 7, 6, 5, 4]  # Karmarkar and Karp's example: differencing leaves 16 / 14, longest-first 17 / 13
    assert sorted(sum(lengths[i] for i in p) for p in greedy_partition(lengths, 2, False)) == [13, 17]
    assert sorted(sum(lengths[i] for i in p) for p in get_seqlen_balanced_partitions(lengths, 2, False)) == [14, 16]
    metrics = log_seqlen_unbalance([8, 7, 6, 5], [[0, 3], [1, 2]], "seqlen")
    assert metrics == {
        "seqlen/min": 11,
        "seqlen/max": 15,
        "seqlen/minmax_diff": 4,
        "seqlen/balanced_min": 13,
        "seqlen/balanced_max": 13,
        "seqlen/mean": 13.0,
    }


def test_micro_batches_in_verls_count_and_order_and_back():
    valid = [16, 2, 12, 4, 9, 7, 16, 3]  # 69 tokens
    batch = _batch(valid)
    micros, parts = rearrange_micro_batches(batch, max_token_len=20)
    assert len(micros) == ceildiv(69, 20) == 4  # verl's count, not "the fewest that fit"
    loads = [sum(int(calculate_workload(torch.tensor(valid[i]))) for i in p) for p in parts]
    top = loads.index(max(loads))  # verl's order: rising to the heaviest, then falling
    assert loads[: top + 1] == sorted(loads[: top + 1]) and loads[top:] == sorted(loads[top:], reverse=True), loads
    assert top not in (0, len(loads) - 1), loads
    flat = torch.cat([m["input_ids"] for m in micros])
    assert torch.equal(flat[torch.tensor(get_reverse_idx([i for p in parts for i in p]))], batch["input_ids"])
    assert len(rearrange_micro_batches(batch, 20, min_num_micro_batch=6)[0]) == 6
    assert len(rearrange_micro_batches(batch, 20, num_batches_divided_by=3)[0]) == 6  # 4 rounded up to 3's multiple
    pairs, pair_parts = rearrange_micro_batches(batch, 20, force_group_size=2)
    assert all(p[k] + 1 == p[k + 1] for p in pair_parts for k in range(0, len(p), 2))  # rows 2i, 2i+1 together
    with pytest.raises(InvalidInput, match="max_token_len must be greater than the sequence length"):
        rearrange_micro_batches(batch, max_token_len=8)


def test_a_dataproto_split_and_restored_with_its_non_tensors():
    data = DataProto.from_dict(
        {"input_ids": _batch([5, 16, 1, 9])["input_ids"], "attention_mask": _batch([5, 16, 1, 9])["attention_mask"]},
        {"uid": np.array(["a", "b", "c", "d"], dtype=object)},
        meta_info={"temperature": 0.7},
    )
    micros, parts = prepare_dynamic_batch(data, max_token_len=16)
    for micro, part in zip(micros, parts):
        assert list(micro.non_tensor_batch["uid"]) == [["a", "b", "c", "d"][i] for i in part]
        assert micro.meta_info == {"temperature": 0.7}
    scores = torch.cat([m.batch["attention_mask"].sum(-1) for m in micros])
    assert restore_dynamic_batch(scores, parts).tolist() == [5, 16, 1, 9]
    jagged = torch.nested.as_nested_tensor([torch.ones(n) for n in scores.tolist()], layout=torch.jagged)
    assert [len(t) for t in restore_dynamic_batch(jagged, parts).unbind()] == [5, 16, 1, 9]


def test_uid_runs_stay_in_one_partition():
    lengths = [100] * 4 + [200] * 4 + [150] * 4 + [50] * 4
    uids = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    parts = get_group_balanced_partitions(lengths, uids, 2)
    assert sorted(i for p in parts for i in p) == list(range(16))
    assert [sum(lengths[i] for i in p) for p in parts] == [1000, 1000]
    assert all(len({uids[i] for i in p}) == 2 for p in parts)
    with pytest.raises(InvalidInput, match=r"uid groups \(4\) must be >= k_partitions \(8\)"):
        get_group_balanced_partitions(lengths, uids, 8)


def _rank(rank: int, init_file: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    valid = [16, 16, 16, 16] if rank == 0 else [2, 2, 2, 2]  # rank 0 needs 4 micro-batches of 20, rank 1 one
    counts = [
        len(rearrange_micro_batches(_batch(valid), 20, dp_group=dist.group.WORLD, same_micro_num_in_dp=s)[0])
        for s in (True, False)
    ]
    out.put((rank, counts))
    dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_ranks_agree_on_the_most_micro_batches(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {0: [4, 4], 1: [4, 1]}  # agreed: the most; not agreed: each its own
