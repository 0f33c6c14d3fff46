"""StatefulDataLoader: batch counts, per-epoch shuffling, and exact resume from state_dict across epochs."""

import pytest
import torch

from scaletrain.data.loader import StatefulDataLoader
from scaletrain.protocol import DataProto


class Rows:
    """A map-style dataset whose row i carries its own id, as a tensor and as a non-tensor field."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([i, i]), "row": i}


def ids(batch: DataProto):
    assert batch.batch["x"][:, 0].tolist() == list(batch.non_tensor_batch["row"])
    return list(batch.non_tensor_batch["row"])


def run(loader, epochs):
    out = []
    while loader.epoch < epochs:
        out.extend(ids(b) for b in loader)
    return out


@pytest.mark.parametrize("drop_last,expected", [(True, 3), (False, 4)])
def test_len_and_last_batch(drop_last, expected):
    loader = StatefulDataLoader(Rows(10), batch_size=3, shuffle=False, drop_last=drop_last)
    assert len(loader) == expected
    batches = [ids(b) for b in loader]
    assert len(batches) == expected
    assert batches[0] == [0, 1, 2]
    assert batches[-1] == ([6, 7, 8] if drop_last else [9])
    assert loader.epoch == 1 and loader.batches_in_epoch == 0
    with pytest.raises(ValueError, match="no batch"):
        StatefulDataLoader(Rows(2), batch_size=3)


def test_shuffle_per_epoch_seeded():
    a = run(StatefulDataLoader(Rows(12), batch_size=4, seed=5), epochs=2)
    b = run(StatefulDataLoader(Rows(12), batch_size=4, seed=5), epochs=2)
    c = run(StatefulDataLoader(Rows(12), batch_size=4, seed=6), epochs=2)
    assert a == b and a != c
    epoch0, epoch1 = sum(a[:3], []), sum(a[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1 and epoch0 != list(range(12))
    loader = StatefulDataLoader(Rows(12), batch_size=4, seed=5)
    assert loader.epoch_order(1).tolist() == epoch1


@pytest.mark.parametrize("consumed", [0, 2, 4, 5, 7])
def test_exact_resume_across_epochs(consumed):
    # 11 rows, batch 3, drop_last -> 3 batches an epoch; 3 epochs = 9 batches
    make = lambda: StatefulDataLoader(Rows(11), batch_size=3, seed=3, drop_last=True)  # noqa: E731
    reference = run(make(), epochs=3)
    assert len(reference) == 9

    first, got = make(), []
    while len(got) < consumed:  # stop mid-epoch (or right at an epoch's end), as a crash would
        for batch in first:
            got.append(ids(batch))
            if len(got) == consumed:
                break
    state = first.state_dict()
    assert (state["epoch"], state["batches_in_epoch"]) == divmod(consumed, 3)

    resumed = make()
    resumed.load_state_dict(state)
    rest = run(resumed, epochs=3)
    assert got + rest == reference


def test_state_after_last_batch_points_to_next_epoch():
    loader = StatefulDataLoader(Rows(6), batch_size=3, seed=0)
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches_in_epoch"] == 0
    assert list(it) == []  # the old iterator ends; it does not advance the epoch twice
    assert loader.epoch == 1


def test_load_state_rejects_a_different_setup():
    state = StatefulDataLoader(Rows(10), batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        StatefulDataLoader(Rows(10), batch_size=5, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        StatefulDataLoader(Rows(12), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        StatefulDataLoader(Rows(10), batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid"):
        StatefulDataLoader(Rows(10), batch_size=2, seed=1).load_state_dict(dict(state, batches_in_epoch=9))
