"""Every dispatch mode on real Ray worker groups of 2 and 4 workers, including padding, futures and meshes."""

import numpy as np
import pytest
import torch

from scaletrain.protocol import DataProto, DataProtoFuture
from tests.controller.workers import EchoWorker, started_group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 4])
def group(request, ray_cluster):
    n = request.param
    with started_group(ray_cluster, n, EchoWorker, 100, name_prefix=f"echo{n}") as wg:
        yield wg


def rows(n):
    return DataProto.from_dict({"x": torch.arange(n) * 10}, {"s": np.array([f"r{i}" for i in range(n)], dtype=object)})


def test_one_to_all_and_all_to_all(group):
    n = group.world_size
    assert group.one_to_all(1, y=2) == [(r, 103) for r in range(n)]
    assert group.all_to_all([f"a{r}" for r in range(n)]) == [(r, f"a{r}") for r in range(n)]
    # not a per-worker list: every worker gets the same argument
    assert group.all_to_all("same") == [(r, "same") for r in range(n)]


def test_rank_zero_modes_run_only_on_rank_zero(group):
    before = group.count_calls()
    assert group.rank_zero("z") == (0, "z")
    assert group.only_rank_zero_executes("q") == [(0, "q")]
    after = group.count_calls()
    assert after[0] == before[0] + 2 and after[1:] == before[1:]


def test_dp_compute_needs_per_worker_lists(group):
    n = group.world_size
    assert group.dp_compute(list(range(n))) == [(r, r) for r in range(n)]
    with pytest.raises(ValueError, match="one per worker"):
        group.dp_compute(list(range(n + 1)))


@pytest.mark.parametrize("batch", [8, 5, 1])
def test_dp_compute_proto_splits_pads_and_unpads(group, batch):
    n = group.world_size
    out = group.tag_rows(rows(batch), scale=3)
    assert len(out) == batch
    assert out.batch["x"].tolist() == [3 * 10 * i for i in range(batch)]
    assert list(out.non_tensor_batch["s"]) == [f"r{i}" for i in range(batch)]
    share = -(-batch // n)  # padded share size
    assert out.batch["rank"].tolist() == [i // share for i in range(batch)]


@pytest.mark.parametrize("batch", [5, 1])
def test_n_rows_per_row_lose_the_padding_rows_n_times(group, batch):
    """A rollout's n samples per prompt: fewer prompts than workers (1 on 2 or 4) pads shares, and each pad row's n
    samples are dropped, not handed back as data."""
    out = group.sample_rows(rows(batch), n=2)
    assert out.batch["x"].tolist() == [10 * (i // 2) for i in range(2 * batch)]
    assert list(out.non_tensor_batch["s"]) == [f"r{i // 2}" for i in range(2 * batch)]


def test_dp_compute_proto_rejects_mismatched_lengths(group):
    with pytest.raises(ValueError, match="rows"):
        group.tag_rows(rows(4), scale=rows(3))


def test_non_blocking_returns_future_and_futures_chain(group):
    fut = group.tag_rows_async(rows(7))
    assert isinstance(fut, DataProtoFuture)
    # a future passed to another DP method is split lazily on the workers and materialised there
    out = group.tag_rows(fut, scale=2)
    assert out.batch["x"].tolist() == [20 * i for i in range(7)]
    assert fut.get().batch["x"].tolist() == [10 * i for i in range(7)]


def test_with_func_and_metric(group):
    n = group.world_size
    out = group.apply_fn(lambda x: x + 1, rows(6))
    assert out.batch["x"].tolist() == [10 * i + 1 for i in range(6)]
    metrics = group.metric(rows(8))
    assert [m["rank"] for m in metrics] == list(range(n))
    assert sum(m["rows"] for m in metrics) == 8
    assert sum(m["sum"] for m in metrics) == sum(10 * i for i in range(8))


def test_gloo_group_forms_from_worker_env(group):
    n = group.world_size
    out = group.allreduce_rank()
    assert [o[1] for o in out] == [float(sum(range(n)))] * n
    assert [o[0]["RANK"] for o in out] == [str(r) for r in range(n)]
    assert {o[0]["WORLD_SIZE"] for o in out} == {str(n)}
    assert len({o[0]["MASTER_ADDR"] for o in out}) == 1


def test_megatron_modes_tp2_dp2(group):
    if group.world_size != 4:
        pytest.skip("the TP=2 x DP=2 mesh needs 4 workers")
    places = group.set_mesh(tp=2, pp=1, dp=2)
    assert places == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
    # MEGATRON_COMPUTE: one entry per DP rank, sent to every rank of that DP group; collected from TP rank 0
    out = group.mg_compute(["d0", "d1"])
    assert out == [(0, (0, 0, 0), "d0"), (2, (0, 0, 1), "d1")]
    # MEGATRON_COMPUTE_PROTO: split by DP size (5 rows -> padded 6 -> 3 each), collected from TP rank 0
    res = group.mg_proto(rows(5))
    assert res.batch["x"].tolist() == [10 * i for i in range(5)]
    assert res.batch["rank"].tolist() == [0, 0, 0, 2, 2]
    # the role workers' engine routing is the same one
    same = group.engine_proto(rows(5))
    assert same.batch["x"].tolist() == res.batch["x"].tolist() and same.batch["rank"].tolist() == [0, 0, 0, 2, 2]


def test_megatron_pp_modes_tp2_pp2(ray_cluster):
    """TP=2 x PP=2 (DP=1): MEGATRON_COMPUTE_PROTO keeps the last stage; PP-as-DP (the rollout mesh) splits over
    the PP stages."""
    with started_group(ray_cluster, 4, EchoWorker, name_prefix="mesh_pp") as wg:
        wg.set_mesh(tp=2, pp=2, dp=1)
        res = wg.mg_proto(rows(4))
        assert res.batch["rank"].tolist() == [2, 2, 2, 2]
        for res in (wg.mg_pp_as_dp(rows(4)), wg.rollout_proto(rows(4))):
            assert res.batch["x"].tolist() == [0, 10, 20, 30]
            assert res.batch["rank"].tolist() == [0, 0, 2, 2]


def test_megatron_modes_route_by_an_engine_declared_place(ray_cluster):
    """A verl worker naming MEGATRON_COMPUTE(_PROTO), whose place comes from its engine as the role workers declare
    it (declare_engine_mesh), not from set_megatron_mesh."""
    with started_group(ray_cluster, 4, EchoWorker, use_gpu=False, name_prefix="mesh_engine") as wg:
        wg.declare_engine_place(dp=2)  # ranks {0, 1} and {2, 3}; ranks 0 and 2 kept
        res = wg.mg_proto(rows(3))
        assert res.batch["x"].tolist() == [0, 10, 20] and res.batch["rank"].tolist() == [0, 0, 2]
        assert wg.mg_compute(["a", "b"]) == [(0, None, "a"), (2, None, "b")]


def test_mesh_mode_without_declared_mesh_fails_clearly(ray_cluster):
    with started_group(ray_cluster, 2, EchoWorker, use_gpu=False, name_prefix="nomesh") as wg:
        with pytest.raises(ValueError, match="declared no place in mesh 'engine'"):
            wg.mg_proto(rows(4))
