"""concat's meta_info merge and the unions (scaletrain/protocol/merge.py): metrics every worker reports reach the
driver; conflicting values are refused, naming the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scaletrain.protocol import DataProto, DataProtoError, union_numpy_dict


def _part(rows: list[int], **meta) -> DataProto:
    return DataProto.from_dict({"x": torch.tensor(rows)}, meta_info=meta)


def test_concat_gathers_every_parts_metrics_into_lists():
    parts = [
        _part([1], metrics={"loss": 0.5}, step=3),
        _part([2], step=3),  # a part that reports none
        _part([3], metrics=[{"loss": 0.7, "acc": 1.0}], step=3),
    ]
    out = DataProto.concat(parts)
    assert out.batch["x"].tolist() == [1, 2, 3]
    assert out.meta_info == {"step": 3, "metrics": {"loss": [0.5, 0.7], "acc": [1.0]}}


def test_concat_keeps_keys_of_any_part_and_refuses_a_conflict():
    out = DataProto.concat([_part([1], a=1), _part([2], b=2)])
    assert out.meta_info == {"a": 1, "b": 2}
    with pytest.raises(DataProtoError, match="Conflicting values for meta_info key 'temperature'"):
        DataProto.concat([_part([1], temperature=1.0), _part([2], temperature=0.7)])
    with pytest.raises(ValueError):  # scaletrain's callers catch ValueError
        DataProto.concat([_part([1], temperature=1.0), _part([2], temperature=0.7)])


def test_union_compares_arrays_deeply_nan_and_self_reference_included():
    nan = np.array([1.0, np.nan])
    union_numpy_dict({"a": nan}, {"a": nan.copy()})
    with pytest.raises(AssertionError):  # verl's code expects AssertionError
        union_numpy_dict({"a": nan}, {"a": np.array([np.nan, 1.0])})
    loop = np.array([None], dtype=object)
    loop[0] = loop
    loop_too = np.array([None], dtype=object)
    loop_too[0] = loop_too
    union_numpy_dict({"a": loop}, {"a": loop_too})
    with pytest.raises(DataProtoError, match="non_tensor_batch key 'a' differs"):
        union_numpy_dict({"a": loop}, {"a": np.array([None], dtype=object)})
