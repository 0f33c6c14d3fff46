"""Ending a finished command without the interpreter's teardown: the CLI entry points (main_ppo, main_sft) call
``run_and_exit(main)``.

After ``main`` returns, CPython frees every module's objects one by one before the process ends. With torch,
transformers and Ray loaded that is ~3 s of one core per run here (sampled: the process sits active with no Python
frame between Ray's shutdown and its exit), paid by every run and by every test that runs the CLI. ``run_and_exit``
does all of a normal exit that anything can observe, in the same order -- it stops and waits for the non-daemon
threads as the interpreter does, runs the atexit handlers (Ray's shutdown, multiprocessing's child clean-up, the
logging flush) and flushes stdio -- then ends the process with ``os._exit``, skipping only that teardown. An
exception other than SystemExit takes the normal way out (traceback, full teardown).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_status(code: object) -> int:
    """The process status ``sys.exit(code)`` gives: None -> 0, an int as it is, anything else printed -> 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` (its return value ignored, as a script's would be), then exit as described above."""
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = exit_status(stop.code)
    # the interpreter's own first exit step: threading's exit callbacks (a ThreadPoolExecutor's idle workers are
    # told to stop there: joining them without it waits forever), then the non-daemon threads joined
    threading._shutdown()  # pyright: ignore[reportAttributeAccessIssue]  # CPython's, not in typeshed
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
