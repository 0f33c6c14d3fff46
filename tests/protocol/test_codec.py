"""DataProtos on disk and tensors as plain records (scaletrain/protocol/codec.py), written as a careless user or
an attacker would hand files over."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from scaletrain.protocol import (
    DataProto,
    DataProtoError,
    deserialize_tensordict,
    serialize_tensordict,
)


def _proto() -> DataProto:
    return DataProto.from_dict(
        {"ids": torch.arange(6).reshape(3, 2), "bf": torch.randn(3, 4).bfloat16()},
        {"raw": [[{"role": "user", "content": "hi"}], [], ["x", 1.5]], "src": np.array(["a", "b", "c"])},
        {"step": 4, "temps": [1.0, 0.5]},
    )


def test_save_then_load_keeps_every_field(tmp_path):
    data = _proto()
    path = str(tmp_path / "batch.dp")
    data.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert back.batch["ids"].equal(data.batch["ids"]) and back.batch["bf"].equal(data.batch["bf"])
    assert back.batch["bf"].dtype == torch.bfloat16
    assert list(back.non_tensor_batch["raw"]) == list(data.non_tensor_batch["raw"])
    assert back.non_tensor_batch["src"].tolist() == ["a", "b", "c"]
    assert back.meta_info == {"step": 4, "temps": [1.0, 0.5]}


class _RunsCode:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_a_file_that_would_run_code_is_refused_before_it_runs(tmp_path):
    canary = tmp_path / "pwned"
    path = tmp_path / "evil.dp"
    state = _proto().__getstate__()
    state["meta"]["note"] = _RunsCode(str(canary))
    path.write_bytes(pickle.dumps(state))
    with pytest.raises(DataProtoError, match=r"evil\.dp: refusing to load (posix|os)\.system"):
        DataProto.load_from_disk(str(path))
    assert not canary.exists()


def test_a_tensordict_travels_as_plain_records_nested_and_bfloat16_included():
    nested = torch.nested.as_nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    td = TensorDict({"n": nested, "b": torch.randn(2, 5).bfloat16(), "i": torch.arange(4).reshape(2, 2)}, [2])
    record = serialize_tensordict(td)
    assert not any(isinstance(v, torch.Tensor) for _, item in record[2].items() for v in item[1][:2])
    back = deserialize_tensordict(pickle.loads(pickle.dumps(record)))
    assert back["b"].equal(td["b"]) and back["i"].equal(td["i"])
    for a, b in zip(back["n"].unbind(), td["n"].unbind()):
        assert a.equal(b)
