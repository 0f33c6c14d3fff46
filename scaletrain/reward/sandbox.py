"""ScoringPool: a small pool of worker processes that calls one function with a deadline per call.

Why not ``multiprocessing.Pool`` / ``concurrent.futures``: neither can stop one hung call. Here each worker
runs one call at a time; the parent sends a call only to an idle, started worker and notes its deadline. A
call that overruns gets status "timeout" and its worker is killed (with the process group it leads, so
subprocesses a scorer started die too) and replaced; a call that raises gets status "error"; a worker that
dies mid-call (segfault, ``os._exit``) gives "error" and is replaced. Nothing a scorer does can stop or hang
``map`` beyond ``timeout_s`` per call, nor (with ``budget_s``) the whole map beyond its budget.

The function is pickled once and sent to each worker at start; it must be picklable by reference (a
module-level function, a ``functools.partial`` of one, or a ``CustomRewardFn`` from ``loader.py``, which
reloads its file in the worker). Workers stay alive across ``map`` calls; ``close()`` (or the context manager,
or interpreter exit) stops them.

Start method: "forkserver" by default (POSIX), with this module preloaded in the fork server so that each
worker is a cheap fork of a process that already imported scaletrain.reward (torch, math-verify); never a
fork of the caller, whose threads (torch, Ray) make ``fork`` unsafe. "spawn" works everywhere but each worker
then pays the imports itself.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for_ready
from typing import Any

from scaletrain.utils.secrets import redact_text

logger = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
_MAX_ERROR_CHARS = 4000
PROGRESS_EVERY_S = 10.0  # a map running longer logs how far it got at this interval
_PR_SET_PDEATHSIG = 1
_GROUP_STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}  # the preemption signals (trainer/run/preemption.py)


class UnpicklableScorer(TypeError):
    """The function cannot be pickled, so it cannot be sent to worker processes (``__cause__``: pickle's error)."""


@dataclass
class Outcome:
    """Result of one call: status "ok" (``value`` holds the return value), "error" or "timeout" (``error``
    says what happened)."""

    status: str
    value: Any = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------ worker side
def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent process exits, so a hung scorer never outlives the run."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Any, fn_bytes: bytes) -> None:
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # lead a process group: the parent kills the whole group on timeout; no terminal SIGINT
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_STOP_SIGNALS)  # blocked at start (_Worker), out of the group now
    _die_with_parent()
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException:
        conn.send(("init_error", traceback.format_exc()[-_MAX_ERROR_CHARS:]))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if message is None:
            return
        task_id, args, kwargs = message
        try:
            reply = (OK, task_id, fn(*args, **kwargs))
        except BaseException:  # includes SystemExit from user code: report it, keep serving
            reply = (ERROR, task_id, traceback.format_exc()[-_MAX_ERROR_CHARS:])
        try:
            conn.send(reply)  # pickles before writing: a failure here writes nothing
        except Exception as e:
            conn.send((ERROR, task_id, f"scorer result could not be sent back: {type(e).__name__}: {e}"))


# ------------------------------------------------------------------------------------------------ parent side
def _start_blocking_group_signals(process: Any) -> None:
    """Start ``process`` so that a preemption signal to the caller's process group (``kill -TERM -PGID``) does not
    stop the scoring of the step being finished: the fork server (started by the first worker's start, in the
    caller's group) and a spawned worker inherit the signals blocked, through exec. In this thread they stay
    pending and arrive once unblocked (another thread may take them first): the caller loses none. The resource
    tracker is started first because starting it unblocks SIGTERM in the calling thread (it ignores SIGTERM)."""
    resource_tracker.ensure_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class _Worker:
    def __init__(self, ctx: Any, fn_bytes: bytes):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, fn_bytes), name="scaletrain-reward-worker")
        _start_blocking_group_signals(self.process)
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False
        self.task: tuple[int, int] | None = None  # (generation, index) of the call in progress
        self.deadline = 0.0

    def kill(self) -> None:
        pid = self.process.pid
        try:
            os.killpg(pid, signal.SIGKILL)  # the worker leads its own group once started
        except (ProcessLookupError, PermissionError, AttributeError, OSError):
            pass
        try:
            self.process.kill()
        except (ProcessLookupError, OSError, ValueError):
            pass
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it does not within a moment."""
        try:
            if self.ready and self.task is None:
                self.conn.send(None)
                self.process.join(timeout=1)
        except (OSError, ValueError):
            pass
        if self.process.is_alive() or self.task is not None:
            self.kill()
        else:
            self.process.join(timeout=1)
            self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().stop()


_LIVE_POOLS: weakref.WeakSet[ScoringPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    # Registered after multiprocessing's own exit hook (imported above), so it runs first: workers are stopped
    # before multiprocessing would join them.
    for pool in list(_LIVE_POOLS):
        pool.close()


def _forkserver_preload() -> list[str]:
    """Modules the fork server imports once (a hint, used if it is not running yet): the main module and this
    module (so scaletrain.reward, torch, math-verify). multiprocessing re-runs the main module in every worker;
    with its imports already loaded that is cheap. (Preloading ``python -m pkg.main`` under its real name as well
    made runpy warn that the module was imported twice.)"""
    return ["__main__", __name__]


def _default_context() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class ScoringPool:
    """``num_workers`` processes calling ``fn``; ``map`` runs a list of calls with ``timeout_s`` each.

    ``start_timeout_s`` bounds how long a worker may take to start (import, unpickle ``fn``); a worker that
    fails to start raises RuntimeError from ``map`` (a configuration problem, not a per-sample failure).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int = 1,
        timeout_s: float | None = 30.0,
        mp_context: str | None = None,
        start_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be positive (or None / 0: no limit per call), got {timeout_s}")
        try:
            self._fn_bytes = pickle.dumps(fn)
        except Exception as e:
            raise UnpicklableScorer(
                f"reward function {fn!r} cannot be sent to reward worker processes ({type(e).__name__}: {e}); use "
                "a module-level function, or load it with load_custom_reward_fn(path, name)"
            ) from e
        self.fn_repr = redact_text(repr(fn))  # named in errors: without the secrets bound to it (an API key)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s) if timeout_s else math.inf  # verl's compute_score_timeout=None: no limit
        self.start_timeout_s = float(start_timeout_s)
        self.mp_context = mp_context or _default_context()
        self.restarts = 0  # workers replaced after a timeout or death, over the pool's life
        self._ctx: Any = None
        self._workers: list[_Worker] = []
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # --------------------------------------------------------------------------------------------- lifecycle
    def _start_worker(self) -> _Worker:
        if self._ctx is None:
            self._ctx = mp.get_context(self.mp_context)
            if self.mp_context == "forkserver":
                self._ctx.set_forkserver_preload(_forkserver_preload())
            _LIVE_POOLS.add(self)
        worker = _Worker(self._ctx, self._fn_bytes)
        self._workers.append(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self.restarts += 1
        self._start_worker()

    def close(self) -> None:
        """Stop all workers. The pool cannot be used afterwards."""
        self._closed = True
        _stop_workers(self._workers)

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------------- map
    def map(self, calls: Sequence[tuple[tuple, dict]], budget_s: float | None = None) -> list[Outcome]:
        """Run ``fn(*args, **kwargs)`` for each ``(args, kwargs)``; outcomes in input order. ``budget_s`` bounds the
        whole map: calls still running or not started when it runs out get "timeout" (their workers replaced).
        A map running longer than ``PROGRESS_EVERY_S`` logs its progress at that interval."""
        if self._closed:
            raise RuntimeError("ScoringPool is closed")
        with self._lock:
            self._generation += 1
            try:
                return self._run(list(calls), budget_s)
            except BaseException:
                # A worker that failed to start, or a KeyboardInterrupt: drop busy and unstarted workers, so no
                # stale result leaks into the next map; the next map starts fresh ones.
                for worker in [w for w in self._workers if w.task is not None or not w.ready]:
                    worker.kill()
                    self._workers.remove(worker)
                raise

    def _run(self, calls: list[tuple[tuple, dict]], budget_s: float | None) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        for worker in [w for w in self._workers if not w.process.is_alive()]:
            self._replace(worker)  # died while idle since the last map
        while len(self._workers) < self.num_workers:
            self._start_worker()
        start = time.monotonic()
        end = math.inf if budget_s is None else start + budget_s
        next_report = start + PROGRESS_EVERY_S

        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(calls, pending)
            by_conn = {w.conn: w for w in self._workers}
            now = time.monotonic()
            if now >= end:
                self._abandon(results, pending, budget_s)
                break
            if now >= next_report:
                self._report(results, now - start)
                next_report = now + PROGRESS_EVERY_S
            deadlines = [
                w.deadline if w.task is not None else w.started_at + self.start_timeout_s
                for w in self._workers
                if w.task is not None or not w.ready
            ]
            wait_s = max(0.0, min(deadlines + [end, next_report]) - now) if deadlines else 0.0
            for conn in wait_for_ready(list(by_conn), timeout=wait_s):
                self._receive(by_conn[conn], results, pending)
            self._enforce_deadlines(results)
        return results  # type: ignore[return-value]

    def _abandon(self, results: list[Outcome | None], pending: collections.deque, budget_s: float | None) -> None:
        """The map's budget ran out: running calls are killed, calls not started are not run; all get "timeout"."""
        why = f"not scored within the step's scoring budget of {budget_s:g}s"
        for worker, task in [(w, w.task) for w in self._workers if w.task is not None]:
            results[task[1]] = Outcome(TIMEOUT, error=f"{why}; worker killed")
            worker.task = None
            self._replace(worker)
        while pending:
            results[pending.popleft()] = Outcome(TIMEOUT, error=why)

    def _report(self, results: list[Outcome | None], elapsed_s: float) -> None:
        done = [r for r in results if r is not None]
        timeouts = sum(r.status == TIMEOUT for r in done)
        errors = sum(r.status == ERROR for r in done)
        logger.info(
            "reward: %d of %d samples scored after %.0f s (%d errors, %d timeouts so far)",
            len(done),
            len(results),
            elapsed_s,
            errors,
            timeouts,
        )

    def _dispatch(self, calls: list[tuple[tuple, dict]], pending: collections.deque) -> None:
        for worker in list(self._workers):
            if not pending:
                return
            if not worker.ready or worker.task is not None:
                continue
            index = pending.popleft()
            args, kwargs = calls[index]
            task_id = (self._generation, index)
            try:
                worker.conn.send((task_id, args, kwargs))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pending.appendleft(index)  # the call never reached the worker: retry it on a fresh one
                self._replace(worker)
                continue
            worker.task = task_id
            worker.deadline = time.monotonic() + self.timeout_s

    def _receive(self, worker: _Worker, results: list[Outcome | None], pending: collections.deque) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1)
            code = worker.process.exitcode
            if worker.task is not None:
                _, index = worker.task
                results[index] = Outcome(ERROR, error=f"reward worker died during the call (exit code {code})")
                worker.task = None
            elif not worker.ready:
                raise RuntimeError(
                    f"reward worker for {self.fn_repr} exited while starting (exit code {code})"
                ) from None
            self._replace(worker)
            return
        kind = message[0]
        if kind == "ready":
            worker.ready = True
        elif kind == "init_error":
            raise RuntimeError(f"reward worker could not load {self.fn_repr}:\n{message[1]}")
        else:
            _, task_id, payload = message
            if task_id == worker.task:  # anything else is a stale reply from an interrupted map: dropped
                index = task_id[1]
                results[index] = Outcome(OK, value=payload) if kind == OK else Outcome(ERROR, error=payload)
                worker.task = None

    def _enforce_deadlines(self, results: list[Outcome | None]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                _, index = worker.task
                results[index] = Outcome(TIMEOUT, error=f"no result within {self.timeout_s:g}s; worker killed")
                worker.task = None
                self._replace(worker)
            elif not worker.ready and now >= worker.started_at + self.start_timeout_s:
                raise RuntimeError(
                    f"reward worker for {self.fn_repr} did not start within {self.start_timeout_s:g}s "
                    f"(context {self.mp_context!r})"
                )
