"""A discriminative reward model served over HTTP (scaletrain/reward/remote_rm.py, OpenRLHF's remote RM protocol),
against the stand-in service's ``/get_reward`` (tests/reward/judge_server.py, a real process on the loopback
address): the batch scored in requests of ``batch_size`` with the API key sent, each score at its row's last
response token; an overloaded service retried, and garbage, a reply of the wrong length or a dead service failing
naming the URL; a CLI run whose reward adds the remote model's score to the rule's; the config's refusals, and verl's
``limited`` / ``remote`` manager names answered with the settings that do their job here."""

from __future__ import annotations

import re

import pytest

from scaletrain.reward.remote_rm import RemoteRewardModel, RemoteRMError, RemoteRMSettings
from scaletrain.trainer.rollout.rm_reward import RemoteScores
from tests.reward.test_judge import SECRET, JudgeServer

ROWS = [
    {"prompt": "1+1=", "response": "2", "ground_truth": "2"},
    {"prompt": "2+2=", "response": "5", "ground_truth": "4"},
    {"prompt": "3+3=", "response": "6", "ground_truth": "6"},
    {"prompt": "40+2=", "response": "42", "ground_truth": "42"},
    {"prompt": "9+9=", "response": "81", "ground_truth": "18"},
]


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def remote(server, **overrides) -> RemoteRewardModel:
    url = f"http://127.0.0.1:{server.port}/get_reward"
    return RemoteRewardModel(RemoteRMSettings(**{"url": url, "timeout_s": 5.0, "backoff_s": 0.05, **overrides}))


def test_a_batch_is_scored_in_requests_of_batch_size_each_score_at_its_last_token(
    server, tokenizer, make_batch, monkeypatch
):
    monkeypatch.setenv("RM_KEY", SECRET)
    client = remote(server, batch_size=2, api_key_env="RM_KEY")
    batch = make_batch(ROWS, response_width=4)
    rm_scores = RemoteScores(client, tokenizer).compute_rm_score(batch).tensors["rm_scores"]
    assert rm_scores.sum(-1).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    last = batch.tensors["attention_mask"][:, -4:].sum(-1) - 1  # the responses' EOS
    assert all(rm_scores[i, last[i]] == rm_scores[i].sum() for i in range(len(ROWS)))
    seen = server.control()
    assert seen["requests"] == 3 and set(seen["authorization"]) == {f"Bearer {SECRET}"}  # 5 rows, 2 a request
    assert client.metrics() == {"remote_rm/requests": 3.0, "remote_rm/retries": 0.0, "remote_rm/failures": 0.0}


@pytest.mark.parametrize(
    "mode, message",
    [
        ("garbage", r"the reply is not JSON: '<html>"),
        ("short", r"answered \{'rewards': \[1.0\]\} for 5 samples: expected 'rewards', one number each"),
        ("die", r"failed \(2 tries\)"),
    ],
)
def test_a_bad_or_dead_service_fails_naming_its_url(server, tokenizer, make_batch, mode, message):
    server.control(mode=mode)
    client = remote(server, max_retries=1, batch_size=8)
    url = rf"the remote reward model at http://127.0.0.1:{server.port}/get_reward"
    with pytest.raises(RemoteRMError, match=rf"(?s){url}.*{message}"):
        RemoteScores(client, tokenizer).compute_rm_score(make_batch(ROWS))
    assert client.metrics()["remote_rm/failures"] == 1.0


def test_the_rate_limit_as_the_service_saw_it(server, tokenizer, make_batch):
    """max_rpm=60: a token bucket of one request a second (a burst of 1): 3 requests span at least 2 s."""
    client = remote(server, batch_size=2, max_concurrent=3, max_rpm=60)
    RemoteScores(client, tokenizer).compute_rm_score(make_batch(ROWS))
    times = server.control()["times"]
    assert len(times) == 3 and max(times) - min(times) >= 1.9, times


def test_an_overloaded_service_is_retried(server, tokenizer, make_batch):
    server.control(mode="flaky", every=2)  # every other request is refused with 503
    client = remote(server, max_retries=2, batch_size=8)
    assert RemoteScores(client, tokenizer).compute_rm_score(make_batch(ROWS)).tensors["rm_scores"].sum() == 3.0
    assert client.metrics() == {"remote_rm/requests": 2.0, "remote_rm/retries": 1.0, "remote_rm/failures": 0.0}


@pytest.mark.slow
def test_a_run_whose_reward_adds_the_remote_models_score(ray_cluster, task, server, tmp_path):
    from tests.reward.conftest import TEST_SCORERS
    from tests.trainer.runs import metrics, run_in_process

    overrides = [
        f"reward.remote_rm.url=http://127.0.0.1:{server.port}/get_reward",
        f"custom_reward_function.path={TEST_SCORERS}",
        "reward.reward_model_weight=0.5",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.plot_at_end=false",
    ]
    logged = metrics(run_in_process(task, tmp_path / "run", 1, overrides).run_dir)[1]
    assert logged["remote_rm/requests"] == 1.0 and logged["remote_rm/failures"] == 0.0  # 8 samples, one request
    assert "reward_model/score/mean" in logged and server.control()["requests"] == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.remote_rm.url=localhost:9"], r"reward.remote_rm.url must be an http\(s\) URL"),
        (
            ["reward.remote_rm.url=http://h:9/get_reward", "reward.remote_rm.batch_size=0"],
            "batch_size must be positive",
        ),
        (["reward.remote_rm.url=http://h:9/get_reward", "reward_model.enable=true"], "are two reward models"),
    ],
)
def test_bad_remote_rm_settings_are_refused_before_the_run(task, tmp_path, overrides, message):
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.rollout.test_rm_reward import save_embedded_vocab_rm
    from tests.trainer.runs import ppo_overrides

    if "reward_model.enable=true" in overrides:  # a real classifier beside the remote one
        overrides = [*overrides, f"reward_model.model.path={save_embedded_vocab_rm(tmp_path / 'rm')}"]

    with pytest.raises(ConfigError, match=message):
        checked(*ppo_overrides(task, tmp_path / "run", 2, overrides))


@pytest.mark.parametrize(
    "name, instead", [("limited", "reward.judge.max_concurrent / max_rpm"), ("remote", "reward.num_workers=N")]
)
def test_verls_limited_and_remote_managers_name_the_setting_that_does_their_job(name, instead):
    from scaletrain.trainer.main_ppo import run
    from scaletrain.utils.typed_config import ConfigError

    with pytest.raises(ConfigError, match=rf"unknown reward manager '{name}'.*{re.escape(instead)}"):
        run([f"reward.reward_manager.name={name}"])
