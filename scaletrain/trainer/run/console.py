"""The console and the run log (layer 4): what a person sees while a run trains, and the file that keeps the rest.

A run's processes are the driver (``main_ppo`` / ``main_sft``) and its Ray workers. The entry point calls
``setup_console(verbose)`` first and ``start_run_log(run_dir)`` once the run directory is known, before Ray starts
(``main_ppo.init_ray``); ``ray_init_kwargs()`` then hands the setup to every Ray worker process: Ray's
``worker_process_setup_hook`` runs ``setup_worker_process`` in each before its first task. Without
``setup_console`` (the trainer used as a library, tests) nothing here touches the caller's logging.

- ``<run_dir>/run.log`` gets everything at INFO and up: every logger of every process (ours, vLLM, Ray,
  transformers, Python warnings), and each worker's raw output (``print``, progress bars, C/C++ libraries, a
  crash's trace): a worker's stdout and stderr file descriptors point at the file.
- The console shows the driver's own INFO lines (loggers ``scaletrain.*`` and ``backends.*``) and WARNING and up
  from every logger of every process; workers' lines reach it through Ray's log forwarding (``log_to_driver``),
  prefixed ``(pid=N)``, except library warnings this setup causes on purpose (``EXPECTED_WARNINGS``, each with
  its reason; Python deprecation warnings raised inside installed packages). ``verbose``
  (``trainer.verbose=true``) shows everything: INFO from every logger and the expected warnings.
- Libraries that install their own handlers are routed into this setup: vLLM is told not to configure logging
  (``VLLM_CONFIGURE_LOGGING=0``), Ray's and transformers' loggers lose their handlers and propagate.

The driver's console handler looks up ``sys.stderr`` at each record, so lines print above a live progress bar
(rich redirects the streams while one is shown; the bar itself is the ``console`` logger in tracking.py).
"""

from __future__ import annotations

import logging
import os
import sys
from logging.handlers import MemoryHandler
from pathlib import Path
from typing import Any

from scaletrain.utils.gc_tuning import start_process
from scaletrain.utils.secrets import ScrubFilter

RUN_LOG_NAME = "run.log"
RUN_LOG_ENV = "SCALETRAIN_RUN_LOG"  # the run log's absolute path, for the workers
VERBOSE_ENV = "SCALETRAIN_VERBOSE"  # "1": workers show INFO on the console too
OWN_LOGGERS = ("scaletrain", "backends", "__main__")
FILE_FORMAT = "%(asctime)s %(levelname)s [{who}] %(name)s: %(message)s"


FILE_ONLY = {"console": False}  # ``logger.info(..., extra=FILE_ONLY)``: a record for the run log only

# Library warnings this setup causes on purpose, each for a known reason: run.log only. (logger, message start)
EXPECTED_WARNINGS = (
    # vLLM on CPU: no Triton there; eager mode, chunked prefill off, the restored thread count and the engine in
    # the worker's process, seeded, are the engine's choices (backends/rollout/vllm_engine.py)
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
    ("vllm.platforms.cpu", "Triton is not installed"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("vllm.config.vllm", "Enforce eager set"),
    ("vllm.config.vllm", "Inductor compilation was disabled"),
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill"),
    ("vllm.engine.arg_utils", "The global random seed is set to"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`"),
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD"),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD"),
    # token ids in and out: the engine has no tokenizer (EOS ids come from ours)
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized"),
    # every weight update: the rotary cos/sin cache is computed, not a weight, and vLLM keeps it
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights"),
)
LIBRARY_DEPRECATIONS = ("DeprecationWarning: ", "FutureWarning: ")  # a library's own upgrade notes: run.log only


def expected_warning(record: logging.LogRecord) -> bool:
    """A warning listed in EXPECTED_WARNINGS, or a Python deprecation warning raised inside an installed package."""
    message = record.getMessage()
    if record.name == "py.warnings":
        return "site-packages" in message.split(":", 1)[0] and any(kind in message for kind in LIBRARY_DEPRECATIONS)
    return any(record.name == name and message.startswith(start) for name, start in EXPECTED_WARNINGS)


class ConsoleFilter(logging.Filter):
    """Passes WARNING and up from every logger, plus INFO from our own loggers when ``own_info`` (the driver), or
    everything when ``verbose``; never a record logged with ``extra=FILE_ONLY``, nor (unless ``verbose``) an
    expected library warning (``expected_warning``)."""

    def __init__(self, verbose: bool, own_info: bool):
        super().__init__()
        self.verbose, self.own_info = verbose, own_info

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "console", True):
            return False
        if self.verbose:
            return True
        if record.levelno >= logging.WARNING:
            return record.levelno > logging.WARNING or not expected_warning(record)
        return self.own_info and record.name.split(".", 1)[0] in OWN_LOGGERS


class ConsoleFormatter(logging.Formatter):
    """Our INFO lines as plain sentences; everything else says its level and logger."""

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO and record.name.split(".", 1)[0] in OWN_LOGGERS:
            return self.prefix + text
        return f"{self.prefix}{record.levelname} {record.name}: {text}"


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (a live progress bar swaps it for a proxy)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property ignores the stored value
        pass


def route_library_loggers() -> None:
    """Ray and transformers log through their own handlers and do not propagate: send their records to the root
    logger's handlers instead (idempotent; both are imported by every process of a run anyway)."""
    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate, ray_logger.level = True, logging.NOTSET
    try:
        import transformers.utils.logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()


def _file_handler(path: Path, who: str) -> logging.Handler:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT.format(who=who)))
    return handler


def _configure_root(handlers: list[logging.Handler]) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):  # e.g. Hydra's job logging
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.addFilter(ScrubFilter())  # no secret in any log line (scaletrain/utils/secrets.py)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    route_library_loggers()
    logging.captureWarnings(True)  # Python warnings become WARNING records of "py.warnings"


_early_records: MemoryHandler | None = None  # set by setup_console, emptied into the file by start_run_log


def setup_console(verbose: bool = False) -> None:
    """Driver side, first thing in an entry point: the console handler, and the records until the run directory is
    known kept in memory for the run log (``start_run_log``)."""
    global _early_records
    console = CurrentStderrHandler()
    console.addFilter(ConsoleFilter(verbose, own_info=True))
    console.setFormatter(ConsoleFormatter())
    _early_records = MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
    _configure_root([console, _early_records])
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"


def start_run_log(run_dir: str | os.PathLike) -> Path | None:
    """Driver side, once the run directory is known and before Ray starts: ``<run_dir>/run.log`` gets the records
    so far and all that follow; ``ray_init_kwargs`` then hands it to the workers. Returns its path; a no-op
    returning None unless ``setup_console`` ran in this process (library callers keep their own logging)."""
    global _early_records
    if _early_records is None:
        return None
    path = Path(run_dir).resolve() / RUN_LOG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = _file_handler(path, "driver")
    to_file.addFilter(ScrubFilter())
    root = logging.getLogger()
    root.addHandler(to_file)
    _early_records.setTarget(to_file)
    _early_records.flush()
    root.removeHandler(_early_records)
    _early_records = None
    os.environ[RUN_LOG_ENV] = str(path)
    logging.getLogger(__name__).info("the full log of this run: %s", path)
    return path


def ray_init_kwargs() -> dict[str, Any]:
    """``ray.init`` arguments: Ray leaves logging to us; every worker process runs ``setup_worker_process`` (Ray's
    setup hook) and, with a run log set up, has the log's path and the verbosity in its environment."""
    route_library_loggers()
    kwargs: dict[str, Any] = {"configure_logging": False, "log_to_driver": True}
    runtime_env: dict[str, Any] = {"worker_process_setup_hook": f"{__name__}.setup_worker_process"}
    kwargs["runtime_env"] = runtime_env
    if os.environ.get(RUN_LOG_ENV):
        runtime_env["env_vars"] = {
            RUN_LOG_ENV: os.environ[RUN_LOG_ENV],
            VERBOSE_ENV: os.environ.get(VERBOSE_ENV, "0"),
            "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's records propagate to the handlers below
        }
    return kwargs


def setup_worker_process() -> None:
    """Ray's setup hook in each worker process of a run, before its first task: the collector's settings for a
    process about to import the model libraries (utils/gc_tuning.py), then the worker's logging."""
    start_process()
    setup_worker_logging()


def setup_worker_logging() -> None:
    """Worker side (Ray's setup hook): stdout / stderr into the run log; logging records to the run log and, at
    WARNING and up (everything when verbose), to the stream Ray forwards to the driver's console."""
    path = os.environ.get(RUN_LOG_ENV)
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # on another node the directory may not exist yet
    forwarded = os.dup(2)  # Ray tails this file and prints its new lines on the driver's console
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    group = os.environ.get("SCALETRAIN_WORKER_GROUP")  # set by RayWorkerGroup, with the rank
    who = f"{group} rank {os.environ.get('RANK')}" if group else "worker"
    console = logging.StreamHandler(open(forwarded, "w", buffering=1, encoding="utf-8", errors="replace"))  # noqa: SIM115 - lives as long as the process
    console.addFilter(ConsoleFilter(os.environ.get(VERBOSE_ENV) == "1", own_info=False))
    console.setFormatter(ConsoleFormatter(prefix=f"[{who}] "))
    _configure_root([_file_handler(Path(path), f"{who} pid {os.getpid()}"), console])
