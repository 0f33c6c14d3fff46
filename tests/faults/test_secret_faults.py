"""No secret in the logs: config values under keys that look like credentials never reach tensorboard, wandb,
mlflow or the jsonl / console output (before: the whole config, API keys included, went to every tracker)."""

import pytest

from scaletrain.trainer.tracking import Tracking
from scaletrain.utils.secrets import REDACTED, redact_secrets

SECRET = "sk-live-5e3fd0c4a1b2"
CONFIG = {
    "trainer": {"total_epochs": 2, "logger": ["console", "jsonl"]},
    "data": {"prompt_key": "prompt"},
    "actor_rollout_ref": {"rollout": {"max_num_batched_tokens": 8192}},
    "custom_reward_function": {"reward_kwargs": {"api_key": SECRET, "judge_token": SECRET}},
    "reward_model": {"reward_kwargs": {"password": SECRET, "client_secret": [SECRET]}},
}


def test_redaction_keeps_names_and_numbers():
    out = redact_secrets(CONFIG)
    assert out["custom_reward_function"]["reward_kwargs"] == {"api_key": REDACTED, "judge_token": REDACTED}
    assert out["reward_model"]["reward_kwargs"]["password"] == REDACTED
    assert out["data"]["prompt_key"] == "prompt", "a column name is no secret"
    assert out["actor_rollout_ref"]["rollout"]["max_num_batched_tokens"] == 8192
    assert SECRET in str(CONFIG), "the input is not changed"


def _tree_bytes(root):
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow", "jsonl"])
def test_no_tracker_receives_a_secret(backend, tmp_path, monkeypatch):
    pytest.importorskip({"jsonl": "json"}.get(backend, backend))
    if backend == "wandb":
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
        monkeypatch.delenv("WANDB_MODE", raising=False)
        monkeypatch.setenv("WANDB_SILENT", "true")
    if backend == "mlflow":
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracking("proj", "exp", [backend], tmp_path, config=CONFIG) as tracking:
        tracking.log({"critic/score/mean": 0.5}, step=1)
    data = _tree_bytes(tmp_path)
    assert b"total_epochs" in data or backend == "jsonl", "the config itself was logged"
    assert SECRET.encode() not in data
