"""``group.call(Worker.method, ...)``: the typed roles' way into a worker group runs exactly what the verl-style
bound attribute runs (dispatch, rank selection, collect, the role prefix of a colocated view), and refuses a
function that is not a group method of the group's worker class."""

import asyncio

import pytest
import ray
import torch

from scaletrain.controller import (
    Dispatch,
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    register,
)
from scaletrain.controller.worker_group import WorkerError
from scaletrain.protocol import DataProto
from tests.controller.workers import ActorLike, CriticLike, EchoWorker, MeetingWorker, RequestWorker, started_group


def rows(n):
    return DataProto.from_dict({"x": torch.arange(n)}, {"s": [f"r{i}" for i in range(n)]})


class Overriding(EchoWorker):
    @register(Dispatch.ONE_TO_ALL)
    def one_to_all(self, x, y=0):  # the group runs this override, whichever class the caller names
        return (self.rank, -x)


def test_call_runs_the_bound_method():
    wg = LocalWorkerGroup(EchoWorker, offset=1, world_size=2)
    assert wg.call(EchoWorker.one_to_all, 1, y=2) == wg.one_to_all(1, y=2) == [(0, 4), (1, 4)]
    out = wg.call(EchoWorker.tag_rows, rows(3), scale=2)  # split with padding, unpadded, concatenated
    assert out.batch["x"].tolist() == [0, 2, 4] and out.batch["rank"].tolist() == [0, 0, 1]
    before = wg.count_calls()
    assert wg.call(EchoWorker.rank_zero, "z") == (0, "z")  # RANK_ZERO: one rank runs it, its value alone
    assert wg.call(EchoWorker.count_calls) == [before[0] + 1, before[1]]


def test_call_takes_a_base_class_method_and_runs_the_override():
    wg = LocalWorkerGroup(Overriding, world_size=2)
    assert wg.call(EchoWorker.one_to_all, 5) == [(0, -5), (1, -5)]
    assert wg.call(EchoWorker.dp_compute, ["a", "b"]) == [(0, "a"), (1, "b")]  # inherited as is


def test_call_refuses_what_is_not_a_group_method_of_the_worker():
    wg = LocalWorkerGroup(EchoWorker, world_size=1, name="echo")
    with pytest.raises(TypeError, match=r"'CriticLike.values' is not a @register method of its worker class"):
        wg.call(CriticLike.values, rows(2))
    with pytest.raises(TypeError, match="EchoWorker._tag' is not a @register method"):
        wg.call(EchoWorker._tag, rows(2))
    with pytest.raises(TypeError, match="is not a @register method"):
        wg.call(lambda: None)


@pytest.mark.slow
def test_call_on_colocated_role_views(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    roles = {"actor": RayClassWithInitArgs(ActorLike), "critic": RayClassWithInitArgs(CriticLike, scale=3)}
    colocated = RayWorkerGroup(pool, create_colocated_worker_cls(roles))
    try:
        groups = colocated.spawn(prefix_set={"actor", "critic"})
        actor, critic = groups["actor"], groups["critic"]
        data = DataProto.from_dict({"x": torch.arange(5)})
        # each view calls its role's methods under the role prefix, in the shared processes
        assert actor.call(ActorLike.log_prob, data).batch["lp"].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0]
        assert critic.call(CriticLike.values, data).batch["v"].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert actor.call(ActorLike.pid) == critic.call(CriticLike.pid)
        with pytest.raises(TypeError, match="not a @register method of its worker class ActorLike"):
            actor.call(CriticLike.values, data)
        with pytest.raises(TypeError, match="WorkerDict_actor_critic"):  # the combined class names them prefixed
            colocated.call(ActorLike.pid)
    finally:
        for worker in colocated.workers:
            ray.kill(worker)
        pool.release()


async def _submit_all(wg, calls):
    return await asyncio.gather(*(wg.submit(rank, RequestWorker.request, x) for rank, x in calls))


def test_submit_runs_requests_together_on_one_rank():
    wg = LocalWorkerGroup(RequestWorker, 3, world_size=2, name="req")
    assert asyncio.run(_submit_all(wg, [(1, "a"), (1, "b"), (1, "c")])) == [(1, "a"), (1, "b"), (1, "c")]
    with pytest.raises(TypeError, match="a DIRECT method runs on one rank: use group.submit"):
        wg.call(RequestWorker.request, "x")
    with pytest.raises(TypeError, match="has no concurrency_group to submit to"):
        asyncio.run(wg.submit(0, RequestWorker.ping))
    with pytest.raises(ValueError, match="no rank 2"):
        asyncio.run(wg.submit(2, RequestWorker.request, "x"))


@pytest.mark.slow
def test_submit_on_ray_runs_in_the_concurrency_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(RequestWorker, 4), name_prefix="req")
    try:
        calls = [(rank, f"{rank}{i}") for rank in (0, 1) for i in range(4)]  # 4 at once per rank: the barrier
        assert asyncio.run(_submit_all(wg, calls)) == [(rank, x) for rank, x in calls]
        assert wg.ping() == [0, 1]  # the default group still answers
        with pytest.raises(WorkerError, match="bad request 7") as err:
            asyncio.run(wg.submit(1, RequestWorker.request, 7, True))
        assert err.value.rank == 1
    finally:
        for worker in wg.workers:
            ray.kill(worker)
        pool.release()


def test_a_groups_ranks_start_together_and_meet_at_the_address_they_were_given(ray_cluster, tmp_path):
    # each constructor waits for every rank's: a group that started rank 0 alone first (to learn the rendezvous
    # address from it) fails here after 60 s, naming the ranks that never started
    with started_group(ray, 3, MeetingWorker, str(tmp_path), use_gpu=False) as group:
        assert group.rank_sum() == [3, 3, 3]
