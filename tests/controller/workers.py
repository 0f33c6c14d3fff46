"""Worker classes the controller tests drive (importable by Ray worker processes)."""

import contextlib
import os
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from scaletrain.controller import (
    Dispatch,
    Execute,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)
from scaletrain.protocol import DataProto
from scaletrain.workers.dispatch import ENGINE_PROTO, ROLLOUT_PROTO, declare_engine_mesh


class EchoWorker(Worker):
    """One method per dispatch mode; each output says which rank produced it."""

    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset
        self.calls = 0
        self.place = None  # (tp, pp, dp) once set_mesh lays the ranks out

    @register(Dispatch.ONE_TO_ALL)
    def one_to_all(self, x, y=0):
        return (self.rank, x + y + self.offset)

    @register(Dispatch.ALL_TO_ALL)
    def all_to_all(self, x):
        return (self.rank, x)

    @register(Dispatch.RANK_ZERO)
    def rank_zero(self, x):
        self.calls += 1
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL)
    def count_calls(self):
        return self.calls

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero_executes(self, x):
        self.calls += 1
        return (self.rank, x)

    @register(Dispatch.DP_COMPUTE)
    def dp_compute(self, x):
        return (self.rank, x)

    def _tag(self, data: DataProto, scale=1) -> DataProto:
        """The rows it got, each tagged with this rank, values scaled."""
        out = DataProto.from_dict(
            {"x": data.batch["x"] * scale, "rank": torch.full((len(data),), self.rank)},
            {"s": data.non_tensor_batch["s"]},
        )
        out.meta_info["seen_rows"] = len(data)
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data: DataProto, scale=1):
        return self._tag(data, scale)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def sample_rows(self, data: DataProto, n: int):
        """n rows per row, interleaved (a rollout's n samples of each prompt), tagged with this rank."""
        return self._tag(data.repeat(n, interleave=True))

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_rows_async(self, data: DataProto):
        return self._tag(data)

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply_fn(self, fn, data: DataProto):
        return DataProto.from_dict({"x": fn(data.batch["x"])})

    @register(Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto):
        return {"rank": self.rank, "rows": len(data), "sum": int(data.batch["x"].sum())}

    @register(Dispatch.ONE_TO_ALL)
    def set_mesh(self, tp: int, pp: int, dp: int):
        """Lay ranks out as Megatron does: TP fastest, then DP, then PP."""
        tp_rank = self.rank % tp
        dp_rank = (self.rank // tp) % dp
        pp_rank = self.rank // (tp * dp)
        self.place = (tp_rank, pp_rank, dp_rank)
        self.set_megatron_mesh(tp_rank, tp, pp_rank, pp, dp_rank, dp)
        return self.place

    @register(Dispatch.MEGATRON_COMPUTE)
    def mg_compute(self, x):
        return (self.rank, self.place, x)

    def _ranked(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"], "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def mg_proto(self, data: DataProto):
        return self._ranked(data)

    @register(Dispatch.MEGATRON_PP_AS_DP_PROTO)
    def mg_pp_as_dp(self, data: DataProto):
        return self._ranked(data)

    # the role workers' names for the same routing (scaletrain/workers/dispatch.py)
    @register(ENGINE_PROTO)
    def engine_proto(self, data: DataProto):
        return self._ranked(data)

    @register(ROLLOUT_PROTO)
    def rollout_proto(self, data: DataProto):
        return self._ranked(data)

    @register(Dispatch.ONE_TO_ALL)
    def declare_engine_place(self, dp: int):
        """Declare the engine mesh as a role worker does, from an engine's place: ranks split evenly over ``dp``
        DP groups, the first rank of each kept (as Megatron keeps TP rank 0)."""
        group = self.world_size // dp
        engine = SimpleNamespace(dp_rank=self.rank // group, dp_size=dp, collects_output=self.rank % group == 0)
        declare_engine_mesh(self, engine)

    @register(Dispatch.ONE_TO_ALL)
    def allreduce_rank(self):
        """Forms a gloo group from the env the group set and sums the ranks."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}, t.item()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int):
        if self.rank == bad_rank:
            raise KeyError(f"boom on rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_or_sleep(self, bad_rank: int, seconds: float):
        if self.rank == bad_rank:
            raise ValueError(f"rank {self.rank} gives up")
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float):
        time.sleep(seconds)
        return self.rank


class CriticLike(Worker):
    def __init__(self, scale: int):
        super().__init__()
        self.scale = scale

    @register(Dispatch.DP_COMPUTE_PROTO)
    def values(self, data: DataProto):
        return DataProto.from_dict({"v": data.batch["x"].float() * self.scale})

    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class ActorLike(Worker):
    def __init__(self):
        super().__init__()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def log_prob(self, data: DataProto):
        return DataProto.from_dict({"lp": -data.batch["x"].float()})

    @register(Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class RequestWorker(Worker):
    """Per-request calls in a concurrency group (``submit``), beside one-at-a-time group calls."""

    def __init__(self, parties: int):
        super().__init__()
        self.barrier = threading.Barrier(parties)

    @register(Dispatch.DIRECT, concurrency_group="requests")
    def request(self, x, fail: bool = False):
        """Returns only once ``parties`` calls wait here together: sequential calls would time out."""
        if fail:
            raise ValueError(f"bad request {x}")
        self.barrier.wait(timeout=30)
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL)
    def ping(self):
        return self.rank


class BrokenInit(Worker):
    def __init__(self):
        super().__init__()
        if self.rank == 1:
            raise RuntimeError("cannot build the model on rank 1")

    @register(Dispatch.ONE_TO_ALL)
    def ping(self):
        return self.rank


class MeetingWorker(Worker):
    """Each rank's constructor leaves a mark in ``meeting_dir`` and waits (up to 60 s) for every rank's: it finishes
    only when all ranks were started together; then the ranks form a gloo group at the address they were given."""

    def __init__(self, meeting_dir: str):
        super().__init__()
        with open(os.path.join(meeting_dir, str(self.rank)), "w"):
            pass
        deadline = time.monotonic() + 60
        while len(os.listdir(meeting_dir)) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: only {sorted(os.listdir(meeting_dir))} started within 60 s")
            time.sleep(0.05)
        dist.init_process_group("gloo")

    @register(Dispatch.ONE_TO_ALL)
    def rank_sum(self):
        total = torch.tensor([self.rank])
        dist.all_reduce(total)
        return int(total)


@contextlib.contextmanager
def started_group(ray, workers: int, cls, *args, use_gpu=True, **group_kwargs):
    """A RayWorkerGroup of ``cls`` on a fresh pool; its actors and placement group are freed on exit."""
    pool = RayResourcePool([workers], use_gpu=use_gpu)
    group = None
    try:
        group = RayWorkerGroup(
            pool, cls if isinstance(cls, RayClassWithInitArgs) else RayClassWithInitArgs(cls, *args), **group_kwargs
        )
        yield group
    finally:
        for actor in group.workers if group is not None else []:
            ray.kill(actor)
        pool.release()


class PushMember:
    """Rank ``rank`` of a weight push group (scaletrain/controller/weight_transport.py: 0 sends, the others
    receive), as a plain Ray actor. ``other_node``: this receiver passes for a process of another node (its node
    key differs; a second node cannot exist here), so the sender's lanes split."""

    def __init__(self, rank: int, other_node: bool = False) -> None:
        self.rank = rank
        if other_node:
            import hashlib

            from scaletrain.controller import push_lanes

            push_lanes.node_key = lambda: hashlib.sha256(b"another node").digest()

    def pid(self) -> int:
        return os.getpid()

    def open(self) -> tuple[str, int]:
        import ray

        from scaletrain.controller.weight_transport import open_store

        host = ray.util.get_node_ip_address()
        return host, open_store(host, 60.0)

    def send(self, channel, buckets, file_size_limit: int | None = None, fail_at: int = -1) -> tuple[int, bool]:
        """(bytes sent, whether the slots ran out of room); ``file_size_limit``: no file of this process may grow
        past it while it sends (as a full /dev/shm: the slots cannot be made); ``fail_at``: the export fails
        producing that bucket."""
        import resource
        import signal

        from scaletrain.controller import weight_transport

        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if file_size_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from the call instead of the signal's kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, limits[1]))
        try:
            sent = weight_transport.send_buckets(channel, _failing(buckets, fail_at), None)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        ring = weight_transport._RINGS.get(channel.key)
        return sent, bool(ring and ring.warned)

    def receive(self, channel, load_s: float = 0.0, fail_at: int = -1) -> tuple[list, bool, int]:
        """(every (name, tensor) received, copied out; whether this rank read the sender's slots; its receive
        buffers). ``load_s``: a slow engine's time per bucket, before it copies the bucket out; ``fail_at``: the
        engine's load fails at that bucket (raised once the push is read to its end)."""
        from scaletrain.controller import weight_transport

        push = weight_transport.ReceivedPush(channel, self.rank - 1)
        out = []
        try:
            for index, bucket in enumerate(push.buckets):
                if index == fail_at:
                    raise ValueError(f"the engine cannot load bucket {index}")
                time.sleep(load_s)
                out.extend((name, tensor.clone()) for name, tensor in bucket)
        finally:
            push.finish()
        local = self.rank in weight_transport._LANES[channel.key].local
        return out, local, sum(a is not None for a in weight_transport._ARENAS.get(channel.key, []))


def _failing(buckets: list, fail_at: int):
    for index, bucket in enumerate(buckets):
        if index == fail_at:
            raise RuntimeError(f"export failed at bucket {index}")
        yield bucket
