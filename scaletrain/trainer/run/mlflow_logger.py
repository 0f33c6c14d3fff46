"""The ``mlflow`` logger backend (layer 4; registered lazily in ``tracking.LOGGERS``, see ``tracking.py``).

``$MLFLOW_TRACKING_URI`` if set, else a local SQLite store ``<log_dir>/mlruns/mlflow.db`` (artifacts in
``<log_dir>/mlruns/artifacts``). MLflow experiment = ``project_name``, run = ``experiment_name`` (reused on
resume); params are the flattened config (``a.b.c``, values cut to 500 chars). MLflow only accepts
``[A-Za-z0-9_-. /]`` in names, so metric and param names are sanitized (see ``mlflow_safe_name``):
``@`` -> ``_at_``, any other character -> ``_``, ``//``, ``.`` and ``..`` path parts removed/replaced.
Telemetry is off unless ``MLFLOW_DISABLE_TELEMETRY`` is set otherwise. Validation samples go to the artifact
``val_generations/step_<step>.json``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from scaletrain.trainer.run.tracking import INSTALL_HINT, LoggerBackend, RunInfo, register_logger, require_module

logger = logging.getLogger(__name__)

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
            flat[name] = text if len(text) <= _MLFLOW_PARAM_CHARS else text[: _MLFLOW_PARAM_CHARS - 3] + "..."
    return flat


def _chunks(items: list, size: int) -> Iterable[list]:
    return (items[i : i + size] for i in range(0, len(items), size))


@register_logger("mlflow")
class MlflowLogger(LoggerBackend):
    """One MLflow run named ``experiment_name`` in the experiment ``project_name``; see the module docstring."""

    def __init__(self, run: RunInfo):
        super().__init__(run)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = require_module("mlflow.tracking", "mlflow", "mlflow")
        self._entities = importlib.import_module("mlflow.entities")
        local_root = None if os.environ.get("MLFLOW_TRACKING_URI") else run.log_dir / "mlruns"
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if local_root is not None:
            local_root.mkdir(parents=True, exist_ok=True)
            self.tracking_uri = f"sqlite:///{(local_root / 'mlflow.db').resolve()}"
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        try:
            experiment = self.client.get_experiment_by_name(run.project_name)
        except ImportError as e:
            raise ImportError(
                f"the 'mlflow' logger's store {self.tracking_uri} needs a package that is missing ({e});"
                f" install it with `{INSTALL_HINT}`"
            ) from e
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
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"attributes.run_name = '{name}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs:
            return None
        self.client.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._entities.Metric(mlflow_safe_name(k), v, now, step) for k, v in metrics.items()]
        for chunk in _chunks(batch, 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        self.client.log_text(
            self.run_id, json.dumps(samples, ensure_ascii=False, indent=1), f"val_generations/step_{step}.json"
        )

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
