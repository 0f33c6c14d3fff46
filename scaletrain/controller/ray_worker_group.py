"""RayWorkerGroup: one Ray actor per bundle of a resource pool, driven as one SPMD group (layer 3).

Rank r gets WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment
(the address picked on rank 0's node by a small task before any worker starts, so all ranks start at once), so the
workers can form a torch.distributed group. Calls wait with ``ray.wait`` on
all workers at once: the first failing or dead worker fails the call immediately, even while its peers are still
blocked (e.g. in a collective waiting for it); ``call_timeout_s`` bounds a call that never returns: on expiry every
worker's Python stack is written under ``stack_dump_dir`` (stacks.py) and ``WorkerTimeoutError`` names the ranks
still running.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from scaletrain.controller.decorator import concurrency_groups
from scaletrain.controller.resource_pool import RayResourcePool
from scaletrain.controller.stacks import collect_stacks, in_collective
from scaletrain.controller.worker_group import (
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    select_worker_args,
)
from scaletrain.protocol import DataProto
from scaletrain.utils.net import rendezvous_address

logger = logging.getLogger(__name__)
_CALL_TIMEOUT = object()  # _wait's default: the group's call_timeout_s
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unwrap_actor_class(cls: Any) -> type:
    """The plain Python class behind a ``@ray.remote`` class (or the class itself)."""
    meta = getattr(cls, "__ray_metadata__", None)
    return meta.modified_class if meta is not None else cls


class RayClassWithInitArgs:
    """A worker class plus its constructor arguments and Ray options, instantiated once per bundle."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.user_cls = unwrap_actor_class(cls)
        self.args, self.kwargs = args, kwargs
        self._options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        self._options.update(options)

    def create(self, placement_group, bundle_index: int, env: dict[str, str], resources: dict[str, float]):
        options = dict(self._options)
        runtime_env = dict(options.pop("runtime_env", {}))
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
        options.update(
            resources,
            runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            ),
        )
        return self._remote_cls().options(**options).remote(*self.args, **self.kwargs)

    def _remote_cls(self) -> Any:
        """The Ray actor class; with the concurrency groups its methods name (the default group keeps one thread:
        every other call still runs one at a time). Ray takes them only here, not in ``.options()``."""
        if hasattr(self.cls, "remote"):
            return self.cls
        groups = concurrency_groups(self.user_cls)
        if not groups:
            return ray.remote(self.cls)
        # Ray's overloads of remote() leave out the actor option concurrency_groups
        return ray.remote(concurrency_groups=groups)(self.cls)  # pyright: ignore[reportCallIssue]


# the environment a group gives each worker itself: a worker_env may not set these
GROUP_ENV_KEYS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "RAY_LOCAL_RANK",
    "RAY_LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SCALETRAIN_WORKER_GROUP",
)


def _checked_worker_env(worker_env: dict[str, str] | None) -> dict[str, str]:
    env = {str(k): str(v) for k, v in (worker_env or {}).items()}
    clash = sorted(set(env) & set(GROUP_ENV_KEYS))
    if clash:
        raise ValueError(f"worker_env may not set {clash}: the worker group sets them for each worker")
    return env


class RayWorkerGroup(WorkerGroup):
    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        name_prefix: str | None = None,
        call_timeout_s: float | None = None,
        init_timeout_s: float | None = None,
        poll_interval_s: float = 0.5,
        death_grace_s: float = 5.0,
        stack_dump_dir: str | None = None,
        worker_env: dict[str, str] | None = None,
        _from_workers: tuple[list, list[dict], type, str] | None = None,
    ) -> None:
        self.call_timeout_s = call_timeout_s
        self.init_timeout_s = init_timeout_s
        self.poll_interval_s = poll_interval_s
        self.death_grace_s = death_grace_s  # how long a failed call looks for a dead peer to blame
        self.stack_dump_dir = stack_dump_dir  # where a timed-out call writes every worker's stack
        self.resource_pool = resource_pool  # None for a role view (see spawn)
        self.worker_env = _checked_worker_env(worker_env)  # extra environment of every worker
        if _from_workers is not None:  # a role view of colocated workers (see spawn)
            workers, infos, user_cls, prefix = _from_workers
            super().__init__(name_prefix or prefix.rstrip("_"), control_prefix=prefix)
            self._workers, self._infos = workers, infos
            self._bind_worker_methods(user_cls, remote_prefix=prefix)
            return
        if resource_pool is None or ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs a resource_pool and a ray_cls_with_init")
        if isinstance(ray_cls_with_init, type) or hasattr(ray_cls_with_init, "remote"):
            ray_cls_with_init = RayClassWithInitArgs(ray_cls_with_init)
        super().__init__(name_prefix or ray_cls_with_init.user_cls.__name__)
        self._cls_with_init = ray_cls_with_init
        self._workers: list[Any] = []
        self._infos: list[dict] = []
        try:
            self._start_workers(resource_pool, ray_cls_with_init)
        except BaseException:
            self.shutdown()  # a group that failed to start leaves no actor behind on the cluster
            raise
        self._bind_worker_methods(ray_cls_with_init.user_cls)

    def shutdown(self) -> None:
        """Kills this group's actors (the role views of a colocated group share them); the resource pool stays the
        caller's to release: several groups may share one."""
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []

    # ------------------------------------------------------------------------------------------------ start
    def _start_workers(self, pool: RayResourcePool, cls_with_init: RayClassWithInitArgs) -> None:
        world = pool.world_size
        addr, port = self._rendezvous_address(pool.get_placement_groups()[0])
        master = {"MASTER_ADDR": addr, "MASTER_PORT": port}
        rank = 0
        for pg, local_size in zip(pool.get_placement_groups(), pool.local_sizes()):
            for local_rank in range(local_size):
                env = {
                    "WORLD_SIZE": str(world),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_size),
                    "RAY_LOCAL_RANK": str(local_rank),  # verl's names for the same two facts
                    "RAY_LOCAL_WORLD_SIZE": str(local_size),
                    "SCALETRAIN_WORKER_GROUP": self.name,
                    **master,
                    **self.worker_env,
                }
                self._workers.append(cls_with_init.create(pg, local_rank, env, pool.actor_resources()))
                rank += 1
        refs = [w.worker_info.remote() for w in self._workers]
        self._infos = self._wait("__init__", list(range(world)), refs, timeout_s=self.init_timeout_s)
        logger.info(
            "worker group '%s': %d worker(s) on %d node(s): %s",
            self.name,
            world,
            len({i.get("ip") for i in self._infos}),
            ", ".join(f"rank {i.get('rank')} {i.get('host')} ({i.get('ip')}) pid {i.get('pid')}" for i in self._infos),
        )

    def _rendezvous_address(self, placement_group) -> tuple[str, str]:
        """MASTER_ADDR and MASTER_PORT picked on the node of bundle 0 (rank 0's) by a task needing no resource: a
        Ray worker that imports only scaletrain.utils.net, started (or reused) in about a second, where waiting for
        rank 0 to start first would double the group's start (each rank imports torch and the model's libraries)."""
        task = ray.remote(num_cpus=0)(rendezvous_address).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=0
            )
        )
        try:
            return ray.get(task.remote(), timeout=self.init_timeout_s)
        except GetTimeoutError:
            raise WorkerTimeoutError(
                self.name, [0], "rendezvous_address", float(self.init_timeout_s or 0), []
            ) from None

    # ---------------------------------------------------------------------------------------------- execute
    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    @property
    def worker_infos(self) -> list[dict]:
        """rank, pid, host and ip of each worker, as reported at start."""
        return list(self._infos)

    def _execute(self, remote_name: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        shared: dict[int, Any] = {}  # a DataProto sent to several workers is put in the object store once

        def put_once(value: Any) -> Any:
            if isinstance(value, DataProto):
                if id(value) not in shared:
                    shared[id(value)] = (value, ray.put(value))
                return shared[id(value)][1]
            return value

        handles = []
        for rank in ranks:
            a, kw = select_worker_args(self.world_size, rank, args, kwargs)
            if len(ranks) > 1:
                a, kw = tuple(put_once(x) for x in a), {k: put_once(v) for k, v in kw.items()}
            handles.append(getattr(self._workers[rank], remote_name).remote(*a, **kw))
        return handles

    def _wait(
        self, remote_name: str, ranks: list[int], handles: list[Any], timeout_s: Any = _CALL_TIMEOUT
    ) -> list[Any]:
        """Values of all handles; the first failure raises at once. ``timeout_s`` defaults to call_timeout_s."""
        timeout_s = self.call_timeout_s if timeout_s is _CALL_TIMEOUT else timeout_s
        rank_of = {ref: rank for ref, rank in zip(handles, ranks)}
        results: dict[Any, Any] = {}
        pending = list(handles)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_interval_s)
            for ref in ready:
                try:
                    results[ref] = self._get_one(ref, rank_of[ref], remote_name)
                except WorkerDiedError:
                    raise
                except WorkerError as err:  # a peer's death often surfaces first as this rank's collective error
                    others = [r for r in ready if r is not ref and r not in results] + pending
                    dead = self._dead_peer(others, rank_of, remote_name)
                    if dead is not None:
                        raise dead from err
                    raise
            if pending and deadline is not None and time.monotonic() > deadline:
                assert timeout_s is not None  # a deadline comes from a timeout
                self._timed_out(remote_name, sorted(rank_of[r] for r in pending), timeout_s)
        return [results[ref] for ref in handles]

    def _timed_out(self, remote_name: str, late: list[int], timeout_s: float) -> None:
        """Writes every worker's stack (the stuck ones and the peers they may be waiting for), then raises."""
        stacks: list[tuple[str, str]] = []  # (file, text) per worker
        if self.stack_dump_dir:
            try:
                stacks = collect_stacks(self.name, self._infos, self.stack_dump_dir)
            except Exception as err:  # the timeout is the error to report; a failed dump only a warning
                logger.warning("worker group '%s': could not collect the workers' stacks: %s", self.name, err)
        method = remote_name.removeprefix(self._control_prefix)  # a colocated role's method under its own name
        waiting = {int(info["rank"]) for info, (_, text) in zip(self._infos, stacks) if in_collective(text)}
        paths = [path for path, _ in stacks]
        raise WorkerTimeoutError(self.name, late, method, timeout_s, paths, [r for r in late if r in waiting])

    def _dead_peer(self, pending: list[Any], rank_of: dict, remote_name: str) -> WorkerDiedError | None:
        """A WorkerDiedError for a rank whose process died, if one shows within ``death_grace_s``."""
        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.death_grace_s)
        for ref in ready:
            try:
                self._get_one(ref, rank_of[ref], remote_name)
            except WorkerDiedError as died:
                return died
            except WorkerError:
                continue
        return None

    def _get_one(self, ref: Any, rank: int, remote_name: str) -> Any:
        try:
            return ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            raise self._worker_error(exc, rank, remote_name) from (exc.cause if isinstance(exc, RayTaskError) else None)
        except GetTimeoutError:  # pragma: no cover - ray.wait said it was ready
            raise

    def _worker_error(self, exc: Exception, rank: int, remote_name: str) -> WorkerError:
        if isinstance(exc, RayActorError):  # includes ActorDiedError: the process is gone
            info = self._infos[rank] if rank < len(self._infos) else {}
            where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
            return WorkerDiedError(self.name, rank, remote_name, f"{where}: {exc}")
        return WorkerError(self.name, rank, remote_name, _ANSI.sub("", str(exc)))

    async def _submit(self, remote_name: str, rank: int, concurrency_group: str, args: tuple) -> Any:
        ref = getattr(self._workers[rank], remote_name).options(concurrency_group=concurrency_group).remote(*args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.call_timeout_s)
        except (RayActorError, RayTaskError) as exc:
            raise self._worker_error(exc, rank, remote_name) from (exc.cause if isinstance(exc, RayTaskError) else None)
        except asyncio.TimeoutError:
            ray.cancel(ref)
            method = remote_name.removeprefix(self._control_prefix)
            assert self.call_timeout_s is not None  # wait_for times out only with a timeout
            raise WorkerTimeoutError(self.name, [rank], method, self.call_timeout_s, []) from None

    # ------------------------------------------------------------------------------------------- colocation
    def fuse(self, prefix_set) -> None:
        """The role groups of ``spawn`` as this group's attributes: ``group.<role>.<method>(...)`` (verl's)."""
        for role, group in self.spawn(prefix_set).items():
            if hasattr(self, role):
                raise ValueError(f"worker group '{self.name}': role '{role}' collides with a group attribute")
            setattr(self, role, group)

    def spawn(self, prefix_set, call_timeouts: Mapping[str, float | None] | None = None) -> dict[str, RayWorkerGroup]:
        """One worker group per role of a colocated class, all sharing these actors; ``call_timeouts``: a role's
        own call deadline (default this group's)."""
        role_classes = getattr(self._cls_with_init.user_cls, "ROLE_CLASSES", None)
        if role_classes is None:
            raise ValueError(f"worker group '{self.name}' is not colocated; build it with create_colocated_worker_cls")
        groups = {}
        for role in prefix_set:
            if role not in role_classes:
                raise ValueError(f"unknown role '{role}'; this group holds {sorted(role_classes)}")
            groups[role] = RayWorkerGroup(
                call_timeout_s=(call_timeouts or {}).get(role, self.call_timeout_s),
                poll_interval_s=self.poll_interval_s,
                death_grace_s=self.death_grace_s,
                stack_dump_dir=self.stack_dump_dir,
                _from_workers=(self._workers, self._infos, role_classes[role], f"{role}_"),
            )
        return groups
