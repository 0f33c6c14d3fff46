"""InProcessScorer: scoring in the caller's own process, for a scorer that cannot be sent to worker processes.

A reward manager scores in a ``ScoringPool`` (sandbox.py): worker processes a hung or crashing scorer cannot
take down. That needs the function pickled by reference; a closure, a lambda or a function defined inside a
test or a notebook cell cannot be. verl scores such functions in its own process, and a ported verl user's code
does that, so ``scoring_runner`` falls back to this class then, with a warning naming what is lost: a crash in
the scorer (a segfault, ``os._exit``) ends the run, and a timeout interrupts it only between Python bytecodes.

Timeouts: on the main thread through ``SIGALRM`` (``score_timeout``: the call is interrupted by a TimeoutError, as
verl's naive manager does); on any other thread (the trainer's rollout thread) the call runs in a daemon thread
the caller stops waiting for at the deadline: the call's outcome is "timeout" and the thread is left to finish
on its own (Python cannot stop a thread). Same interface as ScoringPool: ``map``, ``fn_repr``, ``restarts``,
``close``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from scaletrain.reward.async_scorer import AsyncScorer, is_async_scorer
from scaletrain.reward.sandbox import ERROR, OK, TIMEOUT, Outcome, ScoringPool, UnpicklableScorer
from scaletrain.utils.secrets import redact_text

logger = logging.getLogger(__name__)
_MAX_ERROR_CHARS = 4000


@contextmanager
def score_timeout(seconds: float | None) -> Iterator[None]:
    """Raise TimeoutError in the block once it has run ``seconds`` (None or <= 0: no limit). Uses SIGALRM, so it
    works on the main thread only; elsewhere it is a no-op (``InProcessScorer`` uses a thread there)."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise TimeoutError(f"compute_score timed out after {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, _raise)
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:  # someone else's alarm (pytest-timeout's, a caller's) was set: it runs on, less our time
            left = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Outcome:
    try:
        return Outcome(OK, value=fn(*args, **kwargs))
    except TimeoutError as e:
        return Outcome(TIMEOUT, error=str(e))
    except Exception:
        return Outcome(ERROR, error=traceback.format_exc()[-_MAX_ERROR_CHARS:])


class InProcessScorer:
    """Calls ``fn`` in this process, one call at a time, each bounded by ``timeout_s`` (None: unbounded)."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float | None = 30.0):
        self.fn = fn
        self.fn_repr = redact_text(repr(fn))
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.restarts = 0  # nothing to restart: kept for the metrics a pool reports
        self.abandoned = 0  # calls still running in a thread after their deadline (off the main thread)

    def close(self) -> None:
        """Nothing to stop (a ScoringPool's interface)."""

    def __enter__(self) -> InProcessScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def map(self, calls: Sequence[tuple[tuple, dict]], budget_s: float | None = None) -> list[Outcome]:
        """``fn(*args, **kwargs)`` for each call, in order; ``budget_s`` bounds the whole map (calls not started
        when it runs out get "timeout")."""
        end = math.inf if budget_s is None else time.monotonic() + budget_s
        outcomes = []
        for args, kwargs in calls:
            left = end - time.monotonic()
            if left <= 0:
                outcomes.append(Outcome(TIMEOUT, error=f"not scored within the step's scoring budget of {budget_s:g}s"))
                continue
            limit = min(left, self.timeout_s or math.inf)
            outcomes.append(self._one(args, kwargs, None if math.isinf(limit) else limit))
        return outcomes

    def _one(self, args: tuple, kwargs: dict, limit: float | None) -> Outcome:
        if limit is None or threading.current_thread() is threading.main_thread():
            with score_timeout(limit):
                return _call(self.fn, args, kwargs)
        box: list[Outcome] = []
        thread = threading.Thread(target=lambda: box.append(_call(self.fn, args, kwargs)), daemon=True)
        thread.start()
        thread.join(limit)
        if box:
            return box[0]
        self.abandoned += 1
        return Outcome(TIMEOUT, error=f"no result within {limit:g}s; the call is left running in its thread")


def scoring_runner(
    fn: Callable[..., Any],
    num_workers: int,
    timeout_s: float | None,
    mp_context: str | None,
    start_timeout_s: float,
    on_close: Callable[[], Any] | None = None,
) -> ScoringPool | InProcessScorer | AsyncScorer:
    """A ScoringPool for ``fn``; an AsyncScorer for an ``async def`` one (its calls wait on a service: they run
    concurrently on an event loop; ``on_close``: a coroutine function run there when it closes); an
    InProcessScorer (with a warning) when the pool refuses ``fn`` because it cannot be pickled (the pool pickles it
    once, at construction)."""
    if is_async_scorer(fn):
        return AsyncScorer(fn, timeout_s, on_close)
    try:
        return ScoringPool(fn, num_workers, timeout_s, mp_context, start_timeout_s)
    except UnpicklableScorer as e:
        cause = e.__cause__
        logger.warning(
            "reward function %s cannot be sent to reward worker processes (%s: %s); it runs in this process: a "
            "crash in it ends the run and its timeout interrupts it only between Python bytecodes. Define it at "
            "module level (or load it with custom_reward_function.path) to score in worker processes.",
            redact_text(repr(fn)),
            type(cause).__name__,
            cause,
        )
        return InProcessScorer(fn, timeout_s)
