"""Colocated roles in one process per rank, a plain Ray actor next to a worker group (the controller's smallest
example), and the in-process group."""

import pytest
import ray
import torch

from scaletrain.controller import (
    Dispatch,
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerError,
    create_colocated_worker_cls,
    register,
)
from scaletrain.protocol import DataProto
from tests.controller.workers import ActorLike, CriticLike, EchoWorker


@ray.remote
class Accumulator:
    def __init__(self):
        self.value = 0

    def add(self, x):
        self.value += x

    def get_value(self):
        return self.value


@ray.remote
class GPUAccumulator(Worker):
    def __init__(self):
        super().__init__()
        self.value = torch.zeros(1) + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value.cpu()


@pytest.mark.slow
def test_accumulator_actor_and_worker_group(ray_cluster):
    acc = Accumulator.remote()
    assert ray.get(acc.get_value.remote()) == 0
    acc.add.remote(5)
    assert ray.get(acc.get_value.remote()) == 5

    resource_pool = RayResourcePool([2], use_gpu=True)
    worker_group = RayWorkerGroup(resource_pool, RayClassWithInitArgs(cls=GPUAccumulator))
    try:
        assert [t.item() for t in worker_group.add(x=10)] == [10.0, 11.0]
        assert [t.item() for t in worker_group.add(x=1)] == [11.0, 12.0]
    finally:
        for actor in worker_group.workers:
            ray.kill(actor)
        resource_pool.release()


@pytest.mark.slow
def test_colocated_roles_share_processes(ray_cluster):
    pool = RayResourcePool([2], use_gpu=True)
    cls = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ActorLike), "critic": RayClassWithInitArgs(CriticLike, scale=3)}
    )
    wg_dict = RayWorkerGroup(pool, cls)
    try:
        groups = wg_dict.spawn(prefix_set={"actor", "critic"})
        actor, critic = groups["actor"], groups["critic"]
        data = DataProto.from_dict({"x": torch.arange(5)})
        assert actor.log_prob(data).batch["lp"].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0]
        assert critic.values(data).batch["v"].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert actor.pid() == critic.pid()  # the same process per rank
        assert len(set(actor.pid())) == 2
        assert actor.name == "actor" and critic.world_size == 2
        assert not hasattr(actor, "values")
        # the combined group has every role's methods under a prefix
        assert wg_dict.critic_pid() == critic.pid()
        with pytest.raises(ValueError, match="unknown role 'ref'"):
            wg_dict.spawn(prefix_set={"ref"})
    finally:
        for a in wg_dict.workers:
            ray.kill(a)
        pool.release()


def test_local_worker_group_same_api():
    wg = LocalWorkerGroup(EchoWorker, offset=1, world_size=2, name="debug")
    assert wg.one_to_all(1) == [(0, 2), (1, 2)]
    out = wg.tag_rows(DataProto.from_dict({"x": torch.arange(3)}, {"s": ["a", "b", "c"]}))
    assert out.batch["rank"].tolist() == [0, 0, 1] and out.batch["x"].tolist() == [0, 1, 2]
    wg.set_mesh(tp=2, pp=1, dp=1)
    res = wg.mg_proto(DataProto.from_dict({"x": torch.arange(3)}))
    assert res.batch["rank"].tolist() == [0, 0, 0]
    with pytest.raises(WorkerError, match="worker 'debug' rank 1 failed in fail_on"):
        wg.fail_on(1)
    assert [w.rank for w in wg.workers] == [0, 1]


def test_register_rejects_unknown_mode_and_collisions():
    with pytest.raises(ValueError, match="unknown dispatch mode 'NOPE'"):
        register(dispatch_mode="NOPE")

    class Bad(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def world_size(self):  # shadows the group's attribute
            return 0

    with pytest.raises(ValueError, match="collides"):
        LocalWorkerGroup(Bad)


def test_custom_dispatch_mode():
    from scaletrain.controller import register_dispatch_mode

    register_dispatch_mode(
        "TEST_SUM_OF_SQUARES",
        dispatch_fn=lambda wg, xs: (([[x] for x in xs],), {}),
        collect_fn=lambda wg, outs: sum(outs),
    )

    class Squarer(Worker):
        @register(dispatch_mode="TEST_SUM_OF_SQUARES")
        def square(self, xs):
            return sum(x * x for x in xs)

    wg = LocalWorkerGroup(Squarer, world_size=3)
    assert wg.square([1, 2, 3]) == 14
