"""Experiment tracking: one ``Tracking`` fans each step's metrics out to the logger backends the config names.

    with Tracking("gsm8k-grpo", "qwen-0.5b-run1", ["console", "jsonl", "wandb"], log_dir="outputs/run1",
                  config=config_dict, total_steps=100) as tracking:
        tracking.log({"critic/score/mean": 0.41, "timing_s/step": 3.2}, step=1)

Backends (``trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]``), all writing under ``log_dir``:

- ``console``: a rich progress bar with the ETA over ``total_steps`` (on a terminal) plus a compact line of key
  metrics every few steps (about 20 lines a run) and at each validation. Library logs stay off the console
  (scaletrain/trainer/run/console.py).
- ``jsonl``: ``<log_dir>/metrics.jsonl``, one ``{"step": ..., <metric>: <float>, ...}`` object per line (NaN/inf
  written as Python's json does: ``NaN``/``Infinity``). Appends, so a resumed run continues the file; with
  ``resume_step=N`` the lines with ``step >= N`` are dropped first, so no step appears twice.
- ``tensorboard``: event files in ``<log_dir>/tensorboard`` (``purge_step=resume_step`` on resume).
- ``wandb``: ``wandb.init(dir=log_dir)`` in mode ``$WANDB_MODE``, default ``offline`` (no network needed; sync later
  with ``wandb sync``). ``finish()`` also tears down wandb's service process.
- ``mlflow``: a local SQLite store under ``<log_dir>/mlruns`` or ``$MLFLOW_TRACKING_URI``
  (``scaletrain/trainer/run/mlflow_logger.py``, imported when selected).

Validation samples (``trainer.log_val_generations``): ``Tracking.log_generations(samples, step)`` hands a list of
``{"input", "output", "score"}`` dicts to each backend's ``log_generations`` (a no-op unless the backend defines
it): console prints them, jsonl appends them to ``<log_dir>/val_generations.jsonl``, tensorboard adds a markdown
text ``val/generations``, wandb logs a ``wandb.Table`` ``val/generations`` (rows of every validation so far:
step, input, output, score) and mlflow stores ``val_generations/step_<step>.json`` as an artifact.

wandb, mlflow and tensorboard are imported only when selected (``pip install scaletrain[loggers]``). Add a backend
with ``@register_logger("name")`` on a ``LoggerBackend`` subclass taking one ``RunInfo``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.utils.hydra_compose import plain_dict
from scaletrain.utils.registry import Registry
from scaletrain.utils.secrets import redact_secrets, scrubbed_argv

logger = logging.getLogger(__name__)

LOGGERS = Registry("logger", lazy={"mlflow": "scaletrain.trainer.run.mlflow_logger"})
INSTALL_HINT = "pip install scaletrain[loggers]"


def register_logger(name: str, *, override: bool = False) -> Callable:
    """Decorator: register a ``LoggerBackend`` subclass under ``name`` (then usable in ``trainer.logger``)."""
    return LOGGERS.register(name, override=override)


@dataclass(frozen=True)
class RunInfo:
    """What every backend is built from. ``resume_step``: the first step a resumed run logs (None: fresh run)."""

    project_name: str
    experiment_name: str
    log_dir: Path
    config: dict = field(default_factory=dict)
    total_steps: int | None = None
    resume_step: int | None = None


class LoggerBackend:
    """One destination for metrics. Subclasses take a ``RunInfo`` and implement ``log``; ``finish`` is optional."""

    def __init__(self, run: RunInfo):
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """A few validation samples (``{"input", "output", "score"}`` dicts); backends without a view skip them."""

    def finish(self) -> None:
        pass


class Tracking:
    """Logs each step's metrics to every selected backend; ``finish()`` (or leaving the ``with`` block) closes them."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        backends: Iterable[str] | str,
        log_dir: str | Path,
        config: Mapping | None = None,
        total_steps: int | None = None,
        resume_step: int | None = None,
    ):
        names = [backends] if isinstance(backends, str) else list(backends)
        classes = [LOGGERS.get(name) for name in names]  # every name checked before any backend starts
        self.run = RunInfo(
            project_name, experiment_name, Path(log_dir), _plain_config(config), total_steps, resume_step
        )
        self.run.log_dir.mkdir(parents=True, exist_ok=True)
        self.backends: dict[str, LoggerBackend] = {}
        try:
            for name, cls in zip(names, classes):
                if name not in self.backends:
                    self.backends[name] = cls(self.run)
        except BaseException:
            try:
                self.finish()  # close the backends already started
            except Exception:  # noqa: BLE001 - already logged; the construction error is the one to raise
                pass
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Converts values to floats (numpy / torch scalars too; others are skipped with a warning) and logs them."""
        clean = to_float_metrics(metrics)
        for backend in self.backends.values():
            backend.log(clean, int(step))

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        """Logs validation samples (``input``, ``output``, ``score``) to every backend that shows them."""
        rows = [{"input": str(s["input"]), "output": str(s["output"]), "score": float(s["score"])} for s in samples]
        for backend in self.backends.values():
            backend.log_generations(rows, int(step))

    def finish(self) -> None:
        """Closes every backend (idempotent); one failing to close does not stop the others, its error is re-raised."""
        first_error = None
        for name, backend in list(self.backends.items()):
            try:
                backend.finish()
            except Exception as e:  # noqa: BLE001 - close the rest, then re-raise
                logger.exception("closing logger %r failed", name)
                first_error = first_error or e
        self.backends = {}
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


_warned_keys: set[str] = set()


def to_float_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{name: float}``; numpy / torch scalars and one-element arrays via ``.item()``; non-numbers dropped."""
    out = {}
    for key, value in metrics.items():
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError("a string")
            out[str(key)] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError) as e:
            if key not in _warned_keys:
                _warned_keys.add(key)
                logger.warning("metric %r is not a number (%s: %s); not logged", key, type(value).__name__, e)
    return out


def _plain_config(config: Mapping | None) -> dict:
    """The config as the backends get it: a plain dict, secret-looking values redacted (utils/secrets.py)."""
    if config is None:
        return {}
    if type(config).__module__.startswith("omegaconf"):
        config = plain_dict(config)
    return redact_secrets(dict(config))


def require_module(module: str, package: str, backend: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the '{backend}' logger needs the '{package}' package ({e}); install it with "
            f"`{INSTALL_HINT}` or `pip install {package}`"
        ) from e


# ---------------------------------------------------------------------------------------------------- console

_CONSOLE_KEYS = (
    ("sft/loss", "loss"),
    ("val/loss", "val_loss"),
    ("response_length/mean", "resp_len"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("timing_s/step", "step_s"),
    ("perf/throughput", "tput"),
)


def _is_val_acc(key: str) -> bool:
    """``val/gsm8k/acc``, ``val/gsm8k/acc@4``, ``val-core/gsm8k/acc/mean@1``: a validation accuracy."""
    base = re.sub(r"@\d+$", "", key)
    return key.startswith("val") and (base.endswith("acc") or base.endswith("acc/mean"))


def format_console_line(metrics: Mapping[str, float], step: int, total_steps: int | None = None) -> str:
    """``step 3/10 | score 0.512 | val/gsm8k/acc 0.4 | resp_len 123 | ...``: the metrics worth a glance, if present."""
    picked = [("score", metrics["critic/score/mean"])] if "critic/score/mean" in metrics else []
    picked += [(key, metrics[key]) for key in sorted(metrics) if _is_val_acc(key)]
    picked += [(label, metrics[key]) for key, label in _CONSOLE_KEYS if key in metrics]
    head = f"step {step}/{total_steps}" if total_steps else f"step {step}"
    return " | ".join([head] + [f"{label} {value:.4g}" for label, value in picked])


def step_line_every(total_steps: int | None, lines: int = 20) -> int:
    """Steps between two console step lines: the smallest of 1, 2, 5, 10, 20, 50, 100, ... that keeps a run of
    ``total_steps`` to about ``lines`` lines (1 when the total is unknown)."""
    target = (total_steps or 0) / lines
    return next(n for n in (m * 10**k for k in range(12) for m in (1, 2, 5)) if n >= target)


@register_logger("console")
class ConsoleLogger(LoggerBackend):
    """A progress bar with the ETA (rich, on a terminal only) and a compact step line every
    ``step_line_every(total_steps)`` steps, at the last step and at each step with a validation accuracy. Lines go
    to ``sys.stdout`` as it is at each write (a live bar prints them above itself)."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(soft_wrap=True, markup=False, highlight=False, emoji=False)
        self.every = step_line_every(run.total_steps)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,  # a log file or a pipe gets the step lines only
        )
        start = max((run.resume_step or 1) - 1, 0)
        self.task = self.progress.add_task(run.experiment_name, total=run.total_steps, completed=start)
        self.progress.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.progress.update(self.task, completed=step)
        if step % self.every == 0 or step == self.run.total_steps or any(_is_val_acc(key) for key in metrics):
            self.console.print(format_console_line(metrics, step, self.run.total_steps))

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        lines = [f"validation samples at step {step}:"]
        lines += [f"  [score {s['score']:.4g}] {_shorten(s['input'])!r} -> {_shorten(s['output'])!r}" for s in samples]
        self.console.print("\n".join(lines))

    def finish(self) -> None:
        self.progress.stop()


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------- jsonl


def truncate_jsonl(path: str | Path, resume_step: int) -> int:
    """Drops the lines of a metrics.jsonl with ``step >= resume_step`` (and unreadable ones); returns lines dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            keep = json.loads(line)["step"] < resume_step
        except (ValueError, KeyError, TypeError):
            keep = False  # e.g. a half-written last line from a crash
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
        logger.info("resuming at step %d: dropped %d line(s) from %s", resume_step, dropped, path)
    return dropped


@register_logger("jsonl")
class JsonlLogger(LoggerBackend):
    """Appends one JSON object per ``log`` call to ``<log_dir>/metrics.jsonl``, flushed at once."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        self.path = run.log_dir / "metrics.jsonl"
        self.generations_path = run.log_dir / "val_generations.jsonl"
        if run.resume_step is not None:
            truncate_jsonl(self.path, run.resume_step)
            truncate_jsonl(self.generations_path, run.resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """One line per sample, ``{"step", "input", "output", "score"}``, in ``<log_dir>/val_generations.jsonl``."""
        with open(self.generations_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n" for sample in samples)

    def finish(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------------- tensorboard


@register_logger("tensorboard")
class TensorboardLogger(LoggerBackend):
    """Scalars via ``torch.utils.tensorboard.SummaryWriter`` into ``<log_dir>/tensorboard``; flushed every step."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        writer_cls = require_module("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.writer = writer_cls(log_dir=str(run.log_dir / "tensorboard"), purge_step=run.resume_step)
        if run.config:
            self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        parts = [
            f"### Sample {i + 1} (score {s['score']:.4g})\n\n**Input:** {s['input']}\n\n**Output:** {s['output']}"
            for i, s in enumerate(samples)
        ]
        self.writer.add_text("val/generations", "\n\n---\n\n".join(parts), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------------------------------------------- wandb


@register_logger("wandb")
class WandbLogger(LoggerBackend):
    """A wandb run in ``$WANDB_MODE`` (default ``offline``) under ``<log_dir>/wandb``."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        mode = os.environ.get("WANDB_MODE", "offline")
        if mode != "online":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # no crash reports sent from offline runs
        self.wandb = require_module("wandb", "wandb", "wandb")
        with scrubbed_argv():  # wandb records the command line in its run's metadata
            self.wandb_run = self.wandb.init(
                project=run.project_name, name=run.experiment_name, config=run.config, dir=str(run.log_dir), mode=mode
            )
        self.generation_rows: list[list] = []  # every validation's samples so far: one table shows them all

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.wandb_run.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        self.generation_rows += [[step, s["input"], s["output"], s["score"]] for s in samples]
        # a logged Table is frozen, so each validation logs a new one holding all rows so far
        table = self.wandb.Table(columns=["step", "input", "output", "score"], data=self.generation_rows)
        self.wandb_run.log({"val/generations": table}, step=step)

    def finish(self) -> None:
        try:
            self.wandb_run.finish()
        finally:
            self.wandb.teardown()  # stops the wandb-core service process this run started
