"""Experiment tracking: one ``Tracking`` fans each step's metrics out to the logger backends the config names.

    with Tracking("gsm8k-grpo", "qwen-0.5b-run1", ["console", "jsonl", "wandb"], log_dir="outputs/run1",
                  config=config_dict, total_steps=100) as tracking:
        tracking.log({"critic/score/mean": 0.41, "timing_s/step": 3.2}, step=1)

Backends (``trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]``), all writing under ``log_dir``:

- ``console``: a tqdm progress bar over ``total_steps`` plus one compact line of key metrics per step.
- ``jsonl``: ``<log_dir>/metrics.jsonl``, one ``{"step": ..., <metric>: <float>, ...}`` object per line (NaN/inf
  written as Python's json does: ``NaN``/``Infinity``). Appends, so a resumed run continues the file; with
  ``resume_step=N`` the lines with ``step >= N`` are dropped first, so no step appears twice.
- ``tensorboard``: event files in ``<log_dir>/tensorboard`` (``purge_step=resume_step`` on resume).
- ``wandb``: ``wandb.init(dir=log_dir)`` in mode ``$WANDB_MODE``, default ``offline`` (no network needed; sync later
  with ``wandb sync``). ``finish()`` also tears down wandb's service process.
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a local SQLite store ``<log_dir>/mlruns/mlflow.db`` (artifacts in
  ``<log_dir>/mlruns/artifacts``). MLflow experiment = ``project_name``, run = ``experiment_name`` (reused on
  resume); params are the flattened config (``a.b.c``, values cut to 500 chars). MLflow only accepts
  ``[A-Za-z0-9_-. /]`` in names, so metric and param names are sanitized (see ``mlflow_safe_name``):
  ``@`` -> ``_at_``, any other character -> ``_``, ``//``, ``.`` and ``..`` path parts removed/replaced.
  Telemetry is off unless ``MLFLOW_DISABLE_TELEMETRY`` is set otherwise.

wandb, mlflow and tensorboard are imported only when selected (``pip install scaletrain[loggers]``). Add a backend
with ``@register_logger("name")`` on a ``LoggerBackend`` subclass taking one ``RunInfo``.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)

LOGGERS = Registry("logger")
_INSTALL_HINT = "pip install scaletrain[loggers]"


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

    def finish(self) -> None:
        pass


class Tracking:
    """Logs each step's metrics to every selected backend; ``finish()`` (or leaving the ``with`` block) closes them."""

    def __init__(self, project_name: str, experiment_name: str, backends: Iterable[str] | str, log_dir: str | Path,
                 config: Mapping | None = None, total_steps: int | None = None, resume_step: int | None = None):
        names = [backends] if isinstance(backends, str) else list(backends)
        classes = [LOGGERS.get(name) for name in names]  # every name checked before any backend starts
        self.run = RunInfo(project_name, experiment_name, Path(log_dir), _plain_config(config), total_steps,
                           resume_step)
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
    if config is None:
        return {}
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    return dict(config)


def _require(module: str, package: str, backend: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the '{backend}' logger needs the '{package}' package ({e}); install it with "
                          f"`{_INSTALL_HINT}` or `pip install {package}`") from e


# ---------------------------------------------------------------------------------------------------- console

_CONSOLE_KEYS = (("response_length/mean", "resp_len"), ("actor/pg_loss", "pg_loss"), ("actor/entropy", "entropy"),
                 ("timing_s/step", "step_s"), ("perf/throughput", "tput"))


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


@register_logger("console")
class ConsoleLogger(LoggerBackend):
    """A progress bar (on stderr, only on a terminal) and one compact line per step written through ``tqdm.write``."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        start = max((run.resume_step or 1) - 1, 0)
        self.bar = tqdm(total=run.total_steps, initial=start, desc=run.experiment_name, unit="step",
                        dynamic_ncols=True, disable=None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        self._tqdm.write(format_console_line(metrics, step, self.run.total_steps), file=sys.stdout)

    def finish(self) -> None:
        self.bar.close()


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
        if run.resume_step is not None:
            truncate_jsonl(self.path, run.resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------------- tensorboard

@register_logger("tensorboard")
class TensorboardLogger(LoggerBackend):
    """Scalars via ``torch.utils.tensorboard.SummaryWriter`` into ``<log_dir>/tensorboard``; flushed every step."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        writer_cls = _require("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.writer = writer_cls(log_dir=str(run.log_dir / "tensorboard"), purge_step=run.resume_step)
        if run.config:
            self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
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
        self.wandb = _require("wandb", "wandb", "wandb")
        self.wandb_run = self.wandb.init(project=run.project_name, name=run.experiment_name, config=run.config,
                                         dir=str(run.log_dir), mode=mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.wandb_run.log(metrics, step=step)

    def finish(self) -> None:
        try:
            self.wandb_run.finish()
        finally:
            self.wandb.teardown()  # stops the wandb-core service process this run started


# ---------------------------------------------------------------------------------------------------- mlflow

_MLFLOW_PARAM_CHARS = 500
_MLFLOW_KEY_CHARS = 250


def mlflow_safe_name(name: str) -> str:
    """A metric / param name MLflow accepts: ``@`` -> ``_at_``, other disallowed characters -> ``_``, no empty,
    ``.`` or ``..`` path parts (``val/gsm8k/acc@4`` -> ``val/gsm8k/acc_at_4``); at most 250 characters."""
    name = re.sub(r"[^A-Za-z0-9_\-. /]", "_", name.replace("@", "_at_"))
    parts = ["_" if part in (".", "..") else part for part in name.split("/") if part]
    return "/".join(parts)[:_MLFLOW_KEY_CHARS] or "_"


def flatten_config(config: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists and other leaves as ``str``, cut to 500 characters."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, name + "."))
        else:
            text = str(value)
            flat[name] = text if len(text) <= _MLFLOW_PARAM_CHARS else text[:_MLFLOW_PARAM_CHARS - 3] + "..."
    return flat


def _chunks(items: list, size: int) -> Iterable[list]:
    return (items[i:i + size] for i in range(0, len(items), size))


@register_logger("mlflow")
class MlflowLogger(LoggerBackend):
    """One MLflow run named ``experiment_name`` in the experiment ``project_name``; see the module docstring."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = _require("mlflow.tracking", "mlflow", "mlflow")
        self._entities = importlib.import_module("mlflow.entities")
        local_root = None if os.environ.get("MLFLOW_TRACKING_URI") else run.log_dir / "mlruns"
        if local_root is not None:
            local_root.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(local_root / 'mlflow.db').resolve()}"
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        try:
            experiment = self.client.get_experiment_by_name(run.project_name)
        except ImportError as e:
            raise ImportError(f"the 'mlflow' logger's store {self.tracking_uri} needs a package that is missing ({e});"
                              f" install it with `{_INSTALL_HINT}`") from e
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (local_root / "artifacts").resolve().as_uri() if local_root is not None else None
            experiment_id = self.client.create_experiment(run.project_name, artifact_location=artifacts)
        self.run_id = self._resumable_run(experiment_id) if run.resume_step is not None else None
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run.experiment_name).info.run_id
            params = [self._entities.Param(mlflow_safe_name(k), v) for k, v in flatten_config(run.config).items()]
            for chunk in _chunks(params, 100):  # MLflow's limit per batch
                self.client.log_batch(self.run_id, params=chunk)
        logger.info("mlflow run %s at %s", self.run_id, self.tracking_uri)

    def _resumable_run(self, experiment_id: str) -> str | None:
        name = self.run.experiment_name.replace("'", "\\'")
        runs = self.client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{name}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            return None
        self.client.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._entities.Metric(mlflow_safe_name(k), v, now, step) for k, v in metrics.items()]
        for chunk in _chunks(batch, 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=chunk)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
