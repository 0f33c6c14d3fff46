"""AsyncScorer: the scoring runner of an ``async def`` reward function (a judge's caller: scaletrain/reward/judge.py).

Such a function spends its time waiting on a service, not computing, so its calls run concurrently on one event
loop (a daemon thread of this process, started with the runner) rather than one at a time in worker processes:
each call bounded by ``timeout_s``, the whole ``map`` by its ``budget_s`` (calls still running then are
cancelled and count as timeouts). A call that raises gives "error" with its traceback. Same interface as
ScoringPool (``map``, ``fn_repr``, ``restarts``, ``close``), so every reward manager scores with it unchanged;
the service's own limits (concurrency, rate, retries) are the judge's.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from scaletrain.reward.sandbox import _MAX_ERROR_CHARS, ERROR, OK, TIMEOUT, Outcome
from scaletrain.utils.secrets import redact_text


def target_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under ``functools.partial`` and loader wrappers (``CustomRewardFn.fn``)."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif callable(getattr(fn, "fn", None)):
            fn = fn.fn  # pyright: ignore[reportAttributeAccessIssue]
        else:
            return fn


def is_async_scorer(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(target_function(fn))


class AsyncScorer:
    """Runs an async ``fn``'s calls concurrently on an event loop of its own (module docstring)."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float | None = 30.0, on_close: Any = None):
        self.fn = fn
        self.fn_repr = redact_text(repr(fn))
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.restarts = 0  # no worker processes: kept for the metrics a pool reports
        self.on_close = on_close  # a coroutine function run on the loop before it stops (the judge's aclose)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="async-scorer", daemon=True)
        self.thread.start()

    def close(self) -> None:
        if not self.loop.is_running():
            return
        if self.on_close is not None:
            asyncio.run_coroutine_threadsafe(self.on_close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def __enter__(self) -> AsyncScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def map(self, calls: Sequence[tuple[tuple, dict]], budget_s: float | None = None) -> list[Outcome]:
        """``fn(*args, **kwargs)`` for each call, all at once; one Outcome per call, in order."""
        return asyncio.run_coroutine_threadsafe(self._run(list(calls), budget_s), self.loop).result()

    async def _run(self, calls: list[tuple[tuple, dict]], budget_s: float | None) -> list[Outcome]:
        tasks = [asyncio.ensure_future(self._one(args, kwargs)) for args, kwargs in calls]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, timeout=budget_s)
        for task in pending:
            task.cancel()
        late = Outcome(TIMEOUT, error=f"not scored within the step's scoring budget of {budget_s}s")
        return [task.result() if task in done else late for task in tasks]

    async def _one(self, args: tuple, kwargs: dict) -> Outcome:
        try:
            return Outcome(OK, value=await asyncio.wait_for(self.fn(*args, **kwargs), self.timeout_s))
        except asyncio.TimeoutError:
            return Outcome(TIMEOUT, error=f"the call took more than {self.timeout_s:g}s")
        except Exception:
            return Outcome(ERROR, error=traceback.format_exc()[-_MAX_ERROR_CHARS:])
