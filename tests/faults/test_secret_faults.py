"""No secret in the logs: config values under keys that look like credentials never reach tensorboard, wandb,
mlflow or the jsonl / console output (before: the whole config, API keys included, went to every tracker)."""

import pytest

from scaletrain.trainer.run.tracking import Tracking
from scaletrain.utils.secrets import REDACTED, redact_secrets, redact_text, remember_secrets

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


def test_no_default_config_value_is_redacted():
    """The configs' own keys that name columns (data.reward_fn_key, data.image_key, ...) hold no secret: redacting
    their values would scrub a column name such as "images" out of every log line."""
    from scaletrain.trainer.config.ppo_config import PPOConfig
    from scaletrain.trainer.config.sft_config import SFTConfig
    from scaletrain.utils.typed_config import to_dict

    for config in (PPOConfig(), SFTConfig()):
        plain = to_dict(config)
        assert redact_secrets(plain) == plain


def _tree_bytes(root):
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])  # jsonl logs metrics, never the config
def test_no_tracker_receives_a_secret(backend, tmp_path, monkeypatch):
    pytest.importorskip(backend)
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
    assert b"total_epochs" in data, "the config itself was logged"
    assert SECRET.encode() not in data


def test_redaction_by_name_covers_every_credential_word_and_by_value_any_key():
    config = {
        "credentials": {"user": "bob", "pw": "x"},
        "db_passwd": "opensesame",
        "authorization": "Basic Ym9iOng=",
        "bearer": "abc",
        "endpoint": "https://bob:pw-1234@judge.local/v1",  # a URL's password under a plain name
        "note": "uses sk-abcdefgh12345678 and hf_abcdefghijklmnopqrstuvwxyz",
        "author": "bob",  # a name, not a credential
    }
    out = redact_secrets(config)
    assert all(out[k] == REDACTED for k in ("credentials", "db_passwd", "authorization", "bearer"))
    assert out["endpoint"] == f"https://bob:{REDACTED}@judge.local/v1"
    assert "sk-abcdefgh" not in out["note"] and "hf_abcdefgh" not in out["note"] and out["author"] == "bob"


def test_free_text_loses_secrets_but_keeps_the_message():
    import functools

    def score(data_source, solution_str, ground_truth, api_key=None, endpoint=None):
        return 0.0

    bound = functools.partial(score, api_key="plain-looking-value", endpoint="https://u:pw99999@h.local/")
    text = redact_text(f"the reward function {bound!r} failed")
    assert "plain-looking-value" not in text and "pw99999" not in text and "the reward function" in text
    echo = "Error executing job with overrides: ['+custom_reward_function.reward_kwargs.passwd=hunter22', 'a.b=3']"
    assert redact_text(echo) == echo.replace("hunter22", REDACTED)
    plain = ("KeyError: 'prompt'", "max_num_batched_tokens=8192", "data.prompt_key=question", "RAY_AUTH_MODE=disabled")
    for text in (*plain, "token=true"):
        assert redact_text(text) == text
    assert redact_text("{'judge_token': 'abcdef1234', 'n': 3}") == f"{{'judge_token': '{REDACTED}', 'n': 3}}"
    assert redact_text("Authorization: Bearer abcdefghijklmnop") == f"Authorization: Bearer {REDACTED}"


def test_remembered_config_secrets_are_redacted_wherever_they_appear(monkeypatch):
    from scaletrain.utils import secrets

    monkeypatch.setattr(secrets, "_known", set())
    remember_secrets({"reward_model": {"reward_kwargs": {"client_secret": ["no-prefix-value-77"]}}, "x": "visible"})
    assert redact_text("got no-prefix-value-77 from visible") == f"got {REDACTED} from visible"


def test_a_secret_from_the_environment_stays_off_the_command_line_and_out_of_the_output(monkeypatch):
    """The README's way to pass a secret: ``${oc.env:NAME}`` resolves when the config is composed, and the
    resolved value is redacted like any other."""
    from scaletrain.utils import secrets
    from scaletrain.utils.hydra_compose import compose_config

    monkeypatch.setattr(secrets, "_known", set())
    monkeypatch.setenv("JUDGE_API_KEY", "value-from-the-env-42")
    config = compose_config("ppo_trainer", ["+custom_reward_function.reward_kwargs.api_key=${oc.env:JUDGE_API_KEY}"])
    assert config["custom_reward_function"]["reward_kwargs"]["api_key"] == "value-from-the-env-42"
    remember_secrets(config)
    assert redact_text("judge answered value-from-the-env-42") == f"judge answered {REDACTED}"
