"""Preemption (layer 4): SIGTERM or SIGUSR1 to the driver ends the run cleanly at the next step boundary.

A cluster that is about to stop a job warns it first (SLURM: ``--signal=B:USR1@<seconds>``, forwarded to the
driver by launch/run.sh; a scheduler's or a user's SIGTERM). ``PreemptionWatch`` notes the signal; ``fit()`` finishes
the step in progress, writes a checkpoint and returns, and the command exits 0 saying where the checkpoint is, so
the same command (or the requeued job) resumes from it. The CLI enters the watch before Ray starts (main_ppo.py),
and takes the signals back from the handler ``ray.init`` installs (Ray's aborts the process): a signal during
start-up, a resume or the first validation ends the run before its first step, exit 0, nothing new written. A
second signal while that checkpoint is written is not
waited for: the default action (termination) applies, and the previous checkpoint stays the latest complete one
(checkpoint.py). The warning's lead time must cover the rest of a step plus a checkpoint save.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from signal import _HANDLER  # typeshed's type of a signal handler, as signal.signal returns it

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """``with PreemptionWatch() as watch: ... if watch.requested: ...``; a no-op outside the main thread."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, _HANDLER] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # a second signal: stop now, as the signal's default does
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning(
            "received %s: finishing the current step, then a checkpoint and exit (a second signal stops at once)",
            self.signal_name,
        )

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in PREEMPTION_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def take_back(self) -> None:
        """Handle the signals again after a library replaced the handlers (``ray.init``: Ray's core worker installs
        one for SIGTERM that prints a stack and aborts the process)."""
        for signum in self._previous:
            signal.signal(signum, self._on_signal)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
