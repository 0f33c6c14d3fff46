"""How a data-parallel dispatch splits a TensorDict argument among workers and joins their TensorDict outputs
(verl 0.9's new-engine workers take TensorDicts): torch.chunk's uneven split, no padding, a jagged column kept
ragged both ways, non-tensor columns row by row; too few rows for the workers is refused, naming the argument."""

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from scaletrain.controller.dispatch import concat_outputs, split_proto_args


def _batch() -> TensorDict:
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in (3, 1, 4)], layout=torch.jagged)
    return TensorDict(
        {"input_ids": ids, "score": torch.tensor([0.5, 1.5, 2.5]), "tag": NonTensorStack("a", "b", "c")},
        batch_size=[3],
    )


def test_a_tensordict_splits_unevenly_with_its_jagged_rows_and_joins_back():
    (shares,), _ = split_proto_args(2, (_batch(),), {})
    assert [int(s.batch_size[0]) for s in shares] == [2, 1]  # torch.chunk: the first share one row longer
    assert [len(t) for t in shares[0]["input_ids"].unbind()] == [3, 1] and shares[1]["input_ids"].unbind()[
        0
    ].tolist() == [0, 1, 2, 3]
    assert list(shares[0]["tag"]) == ["a", "b"] and list(shares[1]["tag"]) == ["c"]
    joined = concat_outputs(list(shares))
    assert [t.tolist() for t in joined["input_ids"].unbind()] == [[0, 1, 2], [0], [0, 1, 2, 3]]
    assert joined["score"].tolist() == [0.5, 1.5, 2.5] and list(joined["tag"]) == ["a", "b", "c"]


def test_fewer_rows_than_workers_is_refused_by_name():
    with pytest.raises(ValueError, match="argument 'batch': a TensorDict of 3 rows makes 3 shares for 4 workers"):
        split_proto_args(4, (), {"batch": _batch()})
