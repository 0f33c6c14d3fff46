"""``@register``: marks a Worker method as a worker-group method (layer 3).

The decorator records how the group dispatches, executes and collects the call (``RegisteredMethod``), and wraps
the method for the worker side: DataProtoFuture arguments are materialised on arrival, and the padding rows a
data-parallel dispatch appended to this worker's share are trimmed off a row-aligned DataProto result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.controller.dispatch import Dispatch, Execute, get_dispatch_spec
from scaletrain.protocol import PAD_ROWS_KEY, DataProto, DataProtoFuture

REGISTERED_ATTR = "__scaletrain_registered__"
# threads of each concurrency group a worker declares: calls beyond it wait in Ray's queue until one is free
CONCURRENCY_GROUP_THREADS = 256


@dataclass(frozen=True)
class RegisteredMethod:
    dispatch_mode: Dispatch | str | dict  # a registered name, or verl's {"dispatch_fn", "collect_fn"}
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    concurrency_group: str | None = None  # Ray concurrency group: calls run in its threads, beside the others


def get_registration(fn: Any) -> RegisteredMethod | None:
    return getattr(fn, REGISTERED_ATTR, None)


def concurrency_groups(cls: type) -> dict[str, int]:
    """The Ray concurrency groups ``cls``'s registered methods name, with their thread counts."""
    names = {getattr(get_registration(getattr(cls, a, None)), "concurrency_group", None) for a in dir(cls)}
    return {name: CONCURRENCY_GROUP_THREADS for name in sorted(n for n in names if n is not None)}


def _materialize(value: Any) -> Any:
    return value.get() if isinstance(value, DataProtoFuture) else value


def _strip_pad_marker(value: Any, found: list[tuple[int, int]]) -> Any:
    """A share without the pad marker (a new object: in-process groups hand one share to several workers)."""
    if isinstance(value, DataProto) and PAD_ROWS_KEY in value.meta_info:
        meta = {k: v for k, v in value.meta_info.items() if k != PAD_ROWS_KEY}
        found.append((value.meta_info[PAD_ROWS_KEY], len(value)))
        return DataProto(value.batch, value.non_tensor_batch, meta)
    return value


def _arrived(args: tuple, kwargs: dict, materialize_futures: bool) -> tuple[tuple, dict, list[tuple[int, int]]]:
    """A call's arguments as the method sees them: futures fetched (if asked), pad markers taken off (recorded)."""
    if materialize_futures:
        args = tuple(_materialize(a) for a in args)
        kwargs = {k: _materialize(v) for k, v in kwargs.items()}
    found: list[tuple[int, int]] = []
    args = tuple(_strip_pad_marker(a, found) for a in args)
    kwargs = {k: _strip_pad_marker(v, found) for k, v in kwargs.items()}
    return args, kwargs, found


def _trimmed(out: Any, found: list[tuple[int, int]]) -> Any:
    """A row-aligned DataProto result without the rows of the padding its share carried: a result of k rows per
    row of the share (k = 1, or a rollout's n samples of each prompt, interleaved) loses the last pad x k."""
    if found and isinstance(out, DataProto):
        pad, share_len = found[0]
        if pad and len(out) % share_len == 0:  # pad > 0: its share has rows
            return out[: (share_len - pad) * (len(out) // share_len)]
    return out


def register(
    dispatch_mode: Dispatch | str | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    concurrency_group: str | None = None,
) -> Callable:
    """``concurrency_group``: a Ray concurrency group (``CONCURRENCY_GROUP_THREADS`` threads) whose threads run
    this method while the worker's one default thread runs another; reached per rank with
    ``WorkerGroup.submit``."""
    get_dispatch_spec(dispatch_mode)  # fail at class definition on an unknown mode
    execute_mode = Execute(execute_mode)
    info = RegisteredMethod(dispatch_mode, execute_mode, blocking, materialize_futures, concurrency_group)

    def decorator(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):  # an async method stays one: Ray runs it on the actor's event loop

            @functools.wraps(fn)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                args, kwargs, found = _arrived(args, kwargs, materialize_futures)
                return _trimmed(await fn(*args, **kwargs), found)

            setattr(async_inner, REGISTERED_ATTR, info)
            return async_inner

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            args, kwargs, found = _arrived(args, kwargs, materialize_futures)
            return _trimmed(fn(*args, **kwargs), found)

        setattr(inner, REGISTERED_ATTR, info)
        return inner

    return decorator
