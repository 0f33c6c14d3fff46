"""WorkerGroup: turns a Worker class's @register methods into methods of a group (layer 3).

Each group method runs dispatch -> execute on the workers -> (if blocking) wait -> collect. It is reachable two
ways, both running the same code: ``group.call(Worker.method, *args)`` names the worker's function itself, so an
editor's "go to definition" lands on the worker method (the typed roles of scaletrain/workers/roles.py call this
way); and, as in verl, ``group.method(*args)``, an attribute bound per @register method when the group is built.
Subclasses say how to execute and wait: ``RayWorkerGroup`` (one Ray actor per worker) and ``LocalWorkerGroup``
below (workers as plain objects in this process, so a debugger can step through worker code with the same API).

A failing worker surfaces as ``WorkerError`` naming the role, rank and method with the worker's traceback; a
worker whose process died surfaces as ``WorkerDiedError``; a call that overruns the group's deadline as
``WorkerTimeoutError`` naming the ranks still running (with their stacks, see stacks.py).
"""

from __future__ import annotations

import asyncio
import os
import traceback
from collections.abc import Callable
from typing import Any

from scaletrain.controller.decorator import RegisteredMethod, get_registration
from scaletrain.controller.dispatch import Dispatch, Execute, MeshPlace, get_dispatch_spec
from scaletrain.utils.net import free_port


class WorkerError(RuntimeError):
    """A worker raised inside a group call."""

    def __init__(self, role: str, rank: int, method: str, detail: str, what: str = "failed in"):
        self.role, self.rank, self.method = role, rank, method
        super().__init__(f"worker '{role}' rank {rank} {what} {method}():\n{detail}")


class WorkerDiedError(WorkerError):
    """A worker's process exited (killed, out of memory, crashed) while a call was pending."""

    def __init__(self, role: str, rank: int, method: str, detail: str):
        super().__init__(role, rank, method, detail, what="died while running")


class WorkerTimeoutError(TimeoutError):
    """A group call did not finish on some ranks within the group's deadline (the workers are alive but stuck)."""

    def __init__(
        self,
        role: str,
        ranks: list[int],
        method: str,
        timeout_s: float,
        stacks: list[str],
        in_collective: tuple[int, ...] | list[int] = (),
    ):
        self.role, self.ranks, self.method, self.stacks = role, ranks, method, stacks
        stuck = [r for r in ranks if r not in in_collective]
        self.stuck = stuck or ranks  # the ranks holding the others up (all of them when none waits on a peer)
        why = f" (ranks {list(in_collective)} wait in a collective for the others)" if in_collective and stuck else ""
        where = f"; every worker's Python stack is in {os.path.dirname(stacks[0])}" if stacks else ""
        super().__init__(
            f"worker group '{role}': {method}() did not finish on ranks {ranks} within {timeout_s:g}s: stuck on "
            f"ranks {self.stuck}{why}{where}"
        )


def select_worker_args(n: int, i: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Worker i gets element i when every argument is a list of length n; otherwise everyone gets all of them."""
    values = [*args, *kwargs.values()]
    if all(isinstance(v, list) and len(v) == n for v in values):
        return tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}
    return args, kwargs


class WorkerGroup:
    """Base class: method binding and the dispatch/execute/collect call; subclasses implement the transport."""

    def __init__(self, name: str, control_prefix: str = "") -> None:
        self.name = name
        self._control_prefix = control_prefix
        self._mesh_cache: dict[str, list[MeshPlace]] = {}
        self._worker_cls: type | None = None
        self._group_methods: dict[str, Callable] = {}  # @register method name -> its dispatch/execute/collect call

    # ------------------------------------------------------------------------------------ transport (abstract)
    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _execute(self, remote_name: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        """Start ``remote_name`` on each rank in ``ranks``; return one handle per rank."""
        raise NotImplementedError

    def _wait(self, remote_name: str, ranks: list[int], handles: list[Any]) -> list[Any]:
        """Block until all handles are done; return their values or raise WorkerError / WorkerDiedError."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ binding
    def call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run the worker group method ``method`` (the worker class's own function, e.g.
        ``ActorRolloutRefWorker.update_actor``) with its @register dispatch, on the workers of this group."""
        return self._bound(method)(*args, **kwargs)

    async def submit(self, rank: int, method: Callable, *args: Any) -> Any:
        """Run ``method`` on worker ``rank`` alone and await its result: the per-request path of a method
        registered with a ``concurrency_group`` (many such calls run at once on one worker, in its group's
        threads). Failures raise as for ``call``."""
        bound = self._bound(method)
        registration = get_registration(method)
        group = registration.concurrency_group if registration is not None else None
        if group is None:
            raise TypeError(f"worker group '{self.name}': {method.__qualname__} has no concurrency_group to submit to")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"worker group '{self.name}': no rank {rank} (world size {self.world_size})")
        return await self._submit(bound.__name__, rank, group, args)

    async def _submit(self, remote_name: str, rank: int, concurrency_group: str, args: tuple) -> Any:
        raise NotImplementedError

    def _bound(self, method: Callable) -> Callable:
        """This group's call of ``method``, which must be one of its worker class's @register methods."""
        name = getattr(method, "__name__", "")  # "": no method of the group
        bound = self._group_methods.get(name)
        owner = self._worker_cls
        if bound is None or owner is None or not any(vars(cls).get(name) is method for cls in owner.__mro__):
            raise TypeError(
                f"worker group '{self.name}': {getattr(method, '__qualname__', method)!r} is not a @register method "
                f"of its worker class {owner.__name__ if owner else None}"
            )
        return bound

    def _bind_worker_methods(self, user_cls: type, remote_prefix: str = "") -> None:
        self._worker_cls = user_cls
        for attr in dir(user_cls):
            info = get_registration(getattr(user_cls, attr, None))
            if info is None:
                continue
            if attr in vars(WorkerGroup) or attr in ("name", "world_size"):
                raise ValueError(f"{user_cls.__name__}.{attr} collides with a WorkerGroup attribute; rename it")
            self._group_methods[attr] = self._make_method(remote_prefix + attr, info, getattr(user_cls, attr))
            setattr(self, attr, self._group_methods[attr])  # verl's style: group.<method>(...)

    def _make_method(self, remote_name: str, info: RegisteredMethod, user_fn: Callable) -> Callable:
        spec = get_dispatch_spec(info.dispatch_mode)
        rank_zero = info.execute_mode == Execute.RANK_ZERO or info.dispatch_mode == Dispatch.RANK_ZERO

        def method(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = spec.dispatch_fn(self, *args, **kwargs)
            ranks = [0] if rank_zero else list(range(self.world_size))
            handles = self._execute(remote_name, ranks, args, kwargs)
            outputs = self._wait(remote_name, ranks, handles) if info.blocking else handles
            return spec.collect_fn(self, outputs)

        method.__name__ = remote_name
        method.__qualname__ = f"{type(self).__name__}.{remote_name}"
        method.__doc__ = user_fn.__doc__
        return method

    # verl's calls of a worker method by name (registered or not), arguments given whole to each worker
    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Starts ``method_name`` on every worker; one handle per worker (``execute_all_sync`` waits)."""
        return self._execute(self._control_prefix + method_name, list(range(self.world_size)), args, kwargs)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        ranks = list(range(self.world_size))
        remote_name = self._control_prefix + method_name
        return self._wait(remote_name, ranks, self._execute(remote_name, ranks, args, kwargs))

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        remote_name = self._control_prefix + method_name
        return self._wait(remote_name, [0], self._execute(remote_name, [0], args, kwargs))[0]

    execute_all = execute_all_async
    execute_rank_zero = execute_rank_zero_sync

    def _control(self, name: str, *args: Any) -> list[Any]:
        """Call a Worker control method on every worker and wait."""
        remote_name = self._control_prefix + name
        ranks = list(range(self.world_size))
        return self._wait(remote_name, ranks, self._execute(remote_name, ranks, args, {}))

    def mesh_dp_size(self, mesh: str) -> int:
        """How many data-parallel ranks mesh ``mesh`` has."""
        size = self.mesh_places(mesh)[0].dp_size
        assert size is not None  # mesh_places fills in a size the workers left to the group
        return size

    def mesh_places(self, mesh: str) -> list[MeshPlace]:
        """Every worker's place in ``mesh`` (asked once, then cached)."""
        if mesh not in self._mesh_cache:
            places = self._control("get_mesh_place", mesh)
            for rank, place in enumerate(places):
                if place is None:
                    raise ValueError(
                        f"worker group '{self.name}': rank {rank} declared no place in mesh '{mesh}'; the worker "
                        f"must call register_mesh('{mesh}', ...) (or set_megatron_mesh(...)) before such calls"
                    )
            if any(p.dp_size is None for p in places):  # verl-style places: the DP size is the ranks seen
                size = 1 + max(p.dp_rank for p in places)
                places = [MeshPlace(p.dp_rank, size, p.is_collect) for p in places]
            sizes = {p.dp_size for p in places}
            if len(sizes) != 1:
                raise ValueError(f"worker group '{self.name}': ranks disagree on mesh '{mesh}' dp size: {sizes}")
            self._mesh_cache[mesh] = places
        return self._mesh_cache[mesh]


class LocalWorkerGroup(WorkerGroup):
    """Same API as RayWorkerGroup, no Ray: the workers are objects in this process, called one after another."""

    def __init__(self, cls: type, *args: Any, world_size: int = 1, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name or cls.__name__)
        self._workers = []
        saved = dict(os.environ)
        port = str(free_port())
        try:
            for rank in range(world_size):
                os.environ.update(
                    WORLD_SIZE=str(world_size),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                )
                try:
                    self._workers.append(cls(*args, **kwargs))
                except Exception as exc:
                    raise WorkerError(self.name, rank, "__init__", traceback.format_exc()) from exc
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self._bind_worker_methods(cls)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    def _execute(self, remote_name: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        outputs = []
        for rank in ranks:
            a, kw = select_worker_args(self.world_size, rank, args, kwargs)
            try:
                outputs.append(getattr(self._workers[rank], remote_name)(*a, **kw))
            except Exception as exc:
                raise WorkerError(self.name, rank, remote_name, traceback.format_exc()) from exc
        return outputs

    def _wait(self, remote_name: str, ranks: list[int], handles: list[Any]) -> list[Any]:
        return handles

    async def _submit(self, remote_name: str, rank: int, concurrency_group: str, args: tuple) -> Any:
        def run() -> Any:
            try:
                return getattr(self._workers[rank], remote_name)(*args)
            except Exception as exc:
                raise WorkerError(self.name, rank, remote_name, traceback.format_exc()) from exc

        return await asyncio.get_running_loop().run_in_executor(None, run)
