"""DataProto / DataProtoFuture: construction, row ops, padding, errors and transport."""

import pickle

import numpy as np
import pytest
import torch

from scaletrain.protocol import PAD_ROWS_KEY, DataProto, DataProtoFuture, padded_shares


def make(n=6):
    return DataProto.from_dict(
        {"ids": torch.arange(n * 3).view(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        {"src": np.array([f"s{i}" for i in range(n)], dtype=object), "gt": [{"a": i} for i in range(n)]},
        {"temperature": 1.0},
    )


def test_construction_and_errors():
    d = make()
    assert len(d) == 6 and d.keys() == ["ids", "score", "src", "gt"]
    with pytest.raises(ValueError, match="tensor field 'b' has batch size"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="non-tensor field 'x' has 2 rows, expected 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"x": np.array(["p", "q"], dtype=object)})
    with pytest.raises(ValueError, match="non-tensor field 'x' must be a numpy array or list"):
        DataProto.from_single_dict({"a": torch.zeros(3), "x": 5})
    s = DataProto.from_single_dict({"a": torch.zeros(2), "b": np.array([1, 2])}, meta_info={"k": 1})
    assert list(s.batch.keys()) == ["a"] and list(s.non_tensor_batch) == ["b"] and s.meta_info == {"k": 1}


def test_indexing():
    d = make()
    item = d[2]
    assert item.batch["ids"].tolist() == [6, 7, 8] and item.non_tensor_batch["src"] == "s2"
    assert d[1:3].batch["score"].tolist() == [1.0, 2.0]
    assert list(d[np.array([5, 0])].non_tensor_batch["src"]) == ["s5", "s0"]
    assert d[torch.tensor([True, False, True, False, False, False])].batch["score"].tolist() == [0.0, 2.0]
    assert list(d.select_idxs([1, 1]).non_tensor_batch["src"]) == ["s1", "s1"]
    with pytest.raises(IndexError):
        d[6]
    with pytest.raises(IndexError):
        d.select_idxs([7])
    with pytest.raises(IndexError):
        d.select_idxs([-7])
    # negative rows count from the end, in tensors and non-tensors alike; a gather keeps dtypes and row shapes
    back = d.select_idxs(torch.tensor([-1, 0, -6]))
    assert back.batch["ids"].tolist() == [[15, 16, 17], [0, 1, 2], [0, 1, 2]]
    assert back.batch["score"].dtype == torch.float32
    assert list(back.non_tensor_batch["src"]) == ["s5", "s0", "s0"]
    assert len(d.select_idxs([])) == 0 and d.select_idxs([]).batch["ids"].shape == (0, 3)
    # a slice's meta_info is its own
    part = d[:2]
    part.meta_info["x"] = 1
    assert "x" not in d.meta_info


def test_select_pop_union():
    d = make()
    s = d.select(["ids"], ["src"], ["temperature"])
    assert s.keys() == ["ids", "src"] and s.meta_info == {"temperature": 1.0}
    with pytest.raises(ValueError, match="unknown batch key 'nope'"):
        d.select(["nope"])
    with pytest.raises(ValueError, match="unknown non_tensor_batch key 'zz'"):
        d.pop(non_tensor_batch_keys=["zz"])
    popped = d.pop(["score"], ["gt"])
    assert popped.keys() == ["score", "gt"] and d.keys() == ["ids", "src"]
    d.union(popped)
    assert set(d.keys()) == {"ids", "src", "score", "gt"}
    clash = DataProto.from_dict({"score": torch.ones(6)})
    with pytest.raises(ValueError, match="batch key 'score' differs"):
        d.union(clash)
    with pytest.raises(ValueError, match="non_tensor_batch key 'src' differs"):
        d.union(DataProto.from_dict(non_tensors={"src": ["x"] * 6}))
    with pytest.raises(ValueError, match="meta_info key 'temperature' differs"):
        d.union(DataProto(meta_info={"temperature": 2.0}))
    with pytest.raises(ValueError, match="6 and 2 rows"):
        d.union(make(2))
    same = make()
    assert same.union(make()).batch["score"].tolist() == make().batch["score"].tolist()


def test_concat_chunk_split_repeat_reorder():
    d = make()
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert DataProto.concat(parts).batch["ids"].equal(d.batch["ids"])
    with pytest.raises(ValueError, match="cannot chunk 6 rows into 4"):
        d.chunk(4)
    assert [len(p) for p in d.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="differs from part 0 in keys"):
        DataProto.concat([d, d.select(["ids"], ["src"])])
    d.batch["cube"] = torch.arange(6 * 2 * 3).view(6, 2, 3)
    r = d.repeat(2, interleave=True)
    assert list(r.non_tensor_batch["src"][:4]) == ["s0", "s0", "s1", "s1"]
    for key in ("ids", "score", "cube"):
        assert r.batch[key].equal(d.batch[key].repeat_interleave(2, dim=0)), key
    r = d.repeat(3, interleave=False)
    assert list(r.non_tensor_batch["src"][5:8]) == ["s5", "s0", "s1"] and len(r) == 18
    for key in ("ids", "score", "cube"):
        assert r.batch[key].equal(torch.cat([d.batch[key]] * 3)), key
    r.batch["ids"] += 1  # its own memory, not a view of d's
    assert r.batch["ids"][:6].equal(d.batch["ids"] + 1)
    with pytest.raises(ValueError, match="repeat_times"):
        d.repeat(0)
    del d.batch["cube"]
    d.reorder(torch.tensor([5, 4, 3, 2, 1, 0]))
    assert d.batch["score"].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    assert list(d.non_tensor_batch["src"]) == ["s5", "s4", "s3", "s2", "s1", "s0"]


def test_make_iterator_is_seeded_and_covers_rows():
    d = make(8)
    a = [m.batch["score"].tolist() for m in d.make_iterator(4, epochs=2, seed=3)]
    b = [m.batch["score"].tolist() for m in d.make_iterator(4, epochs=2, seed=3)]
    assert a == b and len(a) == 4
    assert sorted(a[0] + a[1]) == [float(i) for i in range(8)]
    assert a[:2] != a[2:]  # reshuffled per epoch
    plain = [m.batch["score"].tolist() for m in d.make_iterator(4)]
    assert plain == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    with pytest.raises(ValueError, match="does not divide"):
        next(d.make_iterator(3))


@pytest.mark.parametrize("n,shares", [(5, 2), (5, 4), (1, 4), (8, 4)])
def test_padding_round_trip(n, shares):
    d = make(n)
    parts = padded_shares(d, shares)
    assert len({len(p) for p in parts}) == 1 and len(parts) == shares
    total_pad = sum(p.meta_info[PAD_ROWS_KEY] for p in parts)
    assert total_pad == (-n) % shares
    # the worker-side wrapper pops each share's marker (shares differ in it; concat refuses conflicting meta_info)
    kept = DataProto.concat([p[: len(p) - p.meta_info.pop(PAD_ROWS_KEY)] for p in parts])
    assert kept.batch["ids"].equal(d.batch["ids"]) and list(kept.non_tensor_batch["src"]) == list(
        d.non_tensor_batch["src"]
    )
    padded, pad = d.pad_to_divisor(shares)
    assert padded.unpad(pad).batch["score"].equal(d.batch["score"])


def test_pickle_ships_tensors_out_of_band_and_copies_on_receive():
    d = make(4)
    d.batch["bf"] = torch.randn(4, 2).bfloat16()
    d.batch["strided"] = torch.arange(16).view(4, 4)[:, ::2]
    buffers = []
    payload = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4  # one buffer per tensor, none pickled in-band
    back = pickle.loads(payload, buffers=buffers)
    for key in ("ids", "score", "bf", "strided"):
        assert back.batch[key].dtype == d.batch[key].dtype and back.batch[key].equal(d.batch[key])
    assert list(back.non_tensor_batch["gt"]) == list(d.non_tensor_batch["gt"]) and back.meta_info == d.meta_info
    back.batch["ids"] += 1  # writable, and not aliasing the sender's memory
    assert not back.batch["ids"].equal(d.batch["ids"])


def test_in_band_pickle_keeps_the_unpicklers_buffer():
    """In-band, each tensor arrives in a bytearray of its own: it becomes the tensor without another copy."""
    from scaletrain.protocol.transport import _private

    d = make(4)
    d.batch["bf"] = torch.randn(4, 2).bfloat16()
    back = pickle.loads(pickle.dumps(d, protocol=5))
    for key in ("ids", "score", "bf"):
        assert back.batch[key].dtype == d.batch[key].dtype and back.batch[key].equal(d.batch[key])
    back.batch["ids"] += 1
    assert not back.batch["ids"].equal(d.batch["ids"])
    arr = d.batch["score"].numpy()
    assert _private(pickle.loads(pickle.dumps(arr, protocol=5)))  # in-band: the unpickler's bytearray
    assert not _private(arr)  # the sender's memory
    buffers = []
    payload = pickle.dumps(arr, protocol=5, buffer_callback=buffers.append)
    assert not _private(pickle.loads(payload, buffers=buffers))  # out-of-band: still the sender's memory


def test_future_chunks_pad_lazily():
    d = make(5)  # no Ray here: apply each share's dispatch function by hand
    shares = [f.dispatch_fn(d) for f in DataProtoFuture(collect_fn=DataProto.concat, futures=[]).chunk(2)]
    assert [len(s) for s in shares] == [3, 3] and shares[1].meta_info[PAD_ROWS_KEY] == 1


@pytest.mark.slow
def test_ray_round_trip(ray_cluster):
    ray = ray_cluster
    d = make(16)
    back = ray.get(ray.put(d))
    assert back.batch["ids"].equal(d.batch["ids"]) and list(back.non_tensor_batch["src"]) == list(
        d.non_tensor_batch["src"]
    )
    ref = ray.put(d)
    fut = DataProtoFuture.concat([ref, ref])
    assert len(fut.get()) == 32
    assert [len(x.get()) for x in fut.chunk(3)] == [11, 11, 11]
