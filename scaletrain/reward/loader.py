"""Load a user's reward function from a file: ``custom_reward_function.path`` / ``.name``.

``load_custom_reward_fn(path, name)`` imports the file and returns a ``CustomRewardFn``: a callable that
behaves like the function and pickles as just ``(path, name)``. Reward workers are separate processes, so a
function defined in a file that is not an importable module could not be pickled by reference; unpickling a
CustomRewardFn in a worker loads the file again there. Relative imports of neighbouring files from the user's
file are not supported (it is not a package); import from installed packages instead.

The file's top-level code runs in a daemon thread with a time limit (``load_timeout_s``, the trainer's
``reward_model.load_timeout_s``): a file that never finishes importing (a loop, a download that hangs) fails
naming the file instead of freezing the driver, and its thread cannot keep the process from exiting.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

DEFAULT_FN_NAME = "compute_score"
DEFAULT_LOAD_TIMEOUT_S = 120.0  # seconds the file's top-level code may take


class CustomRewardFn:
    """A reward function loaded from ``path``; call it like the function itself."""

    def __init__(self, path: str, name: str, fn: Callable[..., Any], load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S):
        self.path, self.name, self.fn, self.load_timeout_s = path, name, fn, load_timeout_s
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return load_custom_reward_fn, (self.path, self.name, self.load_timeout_s)

    def __repr__(self) -> str:
        return f"CustomRewardFn({self.path!r}, {self.name!r})"


def _import_file(path: str, timeout_s: float) -> Any:
    # A unique, stable module name per file, so two files called reward.py do not collide in sys.modules.
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"scaletrain_custom_reward_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom reward function file {path} cannot be imported (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickle and typing look the module up by name
    failed: list[BaseException] = []
    loader = spec.loader

    def run_top_level() -> None:
        try:
            loader.exec_module(module)
        except BaseException as e:  # SystemExit and KeyboardInterrupt of the file's code too
            failed.append(e)

    thread = threading.Thread(target=run_top_level, name=f"import {os.path.basename(path)}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or failed:
        sys.modules.pop(module_name, None)
    if thread.is_alive():
        raise TimeoutError(
            f"importing custom reward function file {path} took more than {timeout_s:g} s: its top-level code "
            "must finish (reward_model.load_timeout_s sets the limit)"
        )
    if failed:
        e = failed[0]
        raise ImportError(f"importing custom reward function file {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_custom_reward_fn(
    path: str | os.PathLike, name: str | None = DEFAULT_FN_NAME, load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
) -> CustomRewardFn:
    """The function ``name`` (default ``compute_score``) defined in the Python file ``path``.

    Raises FileNotFoundError for a missing file, ImportError when the file fails to import, AttributeError when
    it has no ``name``, TypeError when ``name`` is not callable; each message names the path and the name.
    """
    if not path:
        raise ValueError("custom reward function path is empty")
    name = name or DEFAULT_FN_NAME
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward function file not found: {path} (looking for function {name!r})")
    module = _import_file(path, load_timeout_s)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom reward function {name!r} not found in {path}; callables defined there: {defined}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"custom reward function {name!r} in {path} is a {type(fn).__name__}, not callable")
    return CustomRewardFn(path, name, fn, load_timeout_s)
