"""trainer.balance_batch (scaletrain/trainer/step/balance.py): equal row counts per DP rank, token sums evened out."""

import torch

from scaletrain.protocol import DataProto
from scaletrain.trainer.step.balance import balance_batch, equal_count_parts, imbalance


def batch_of(lengths):
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return DataProto.from_dict({"attention_mask": mask, "row": torch.arange(len(lengths))})


def test_parts_have_equal_rows_and_cover_every_row():
    lengths = [50, 3, 7, 40, 2, 2, 9, 31]
    parts = equal_count_parts(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(8)) and {len(p) for p in parts} == {2}
    assert imbalance(lengths, parts) < imbalance(lengths, [[0, 1], [2, 3], [4, 5], [6, 7]])


def test_balance_reorders_rows_and_reports_both_imbalances():
    lengths = [30, 28, 25, 20, 2, 2, 1, 1]  # the long rows all land on rank 0 unbalanced
    batch = batch_of(lengths)
    metrics = balance_batch(batch, 2)
    assert metrics["training/seq_balance/imbalance_before"] > 1.8
    assert metrics["training/seq_balance/imbalance_after"] < 1.05
    rows = batch.batch["row"].tolist()
    assert sorted(rows) == list(range(8))  # a permutation: nothing lost, nothing repeated
    first, second = sum(lengths[r] for r in rows[:4]), sum(lengths[r] for r in rows[4:])
    assert abs(first - second) <= 2
    assert torch.equal(batch.batch["attention_mask"].sum(-1), torch.tensor([lengths[r] for r in rows]))
