"""A generative judge behind an OpenAI-compatible endpoint (scaletrain/reward/judge.py), against a real server process
on the loopback address (tests/reward/judge_server.py, the stand-in for a remote service): the reply, the API key
sent and never shown, retries of an overloaded server, a slow one bounded by the timeout, garbage and a dead server
failing clearly, the concurrency and rate limits as the server saw them; a reward manager scoring through an
async reward function that awaits the judge (concurrently, its failures counted); CLI runs rewarded by the judge;
and the client against vLLM's own OpenAI-compatible server (``vllm serve``) behind an API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scaletrain.reward.judge import Judge, JudgeError, JudgeSettings

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-test-0123456789abcdef"  # an API key that must reach the server and nothing else


class JudgeServer:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.reward.judge_server"], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def control(self, **settings) -> dict:
        data = json.dumps(settings).encode() if settings else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/control", data=data)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def settings(url: str, **overrides) -> JudgeSettings:
    return JudgeSettings(**{"base_url": url, "timeout_s": 5.0, "backoff_s": 0.05, **overrides})


def ask(judge: Judge, expected: str, answer: str, **params) -> str:
    async def go():
        try:
            return await judge.chat([{"role": "user", "content": f"Expected: {expected}\nAnswer: {answer}"}], **params)
        finally:
            await judge.aclose()

    return asyncio.run(go())


def test_the_reply_the_key_sent_and_the_model_asked_once(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    judge = Judge(settings(server.url, api_key_env="JUDGE_KEY"))
    assert ask(judge, "12", "12") == "yes"
    assert judge._model == "judge-model"  # the endpoint's first served model
    assert server.control()["authorization"] == [f"Bearer {SECRET}"]
    assert SECRET not in repr(judge) and judge.metrics() == {
        "judge/requests": 2.0,  # /models, then the chat
        "judge/retries": 0.0,
        "judge/failures": 0.0,
    }


def test_an_overloaded_server_is_retried_with_backoff(server):
    server.control(mode="flaky", every=3)  # 503, 503, then an answer
    judge = Judge(settings(server.url, model="judge-model", max_retries=3))
    assert ask(judge, "1", "2") == "no"
    assert judge.metrics() == {"judge/requests": 3.0, "judge/retries": 2.0, "judge/failures": 0.0}
    times = server.control()["times"]
    assert times[2] - times[1] >= 0.09 > 0.0 < times[1] - times[0]  # 0.05 s, then 0.1 s: doubled


def test_a_slow_server_fails_after_its_timeouts_and_retries(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    server.control(mode="slow", delay_s=30)
    judge = Judge(settings(server.url, model="judge-model", timeout_s=0.5, max_retries=1, api_key_env="JUDGE_KEY"))
    start = time.monotonic()
    with pytest.raises(JudgeError, match=r"failed \(2 tries\): no answer within reward.judge.timeout_s=0.5s") as info:
        ask(judge, "1", "1")
    assert time.monotonic() - start < 5 and SECRET not in str(info.value)
    assert judge.metrics()["judge/failures"] == 1.0


@pytest.mark.parametrize("mode, message", [("garbage", "not JSON: '<html>502 Bad Gateway"), ("die", "1 tries")])
def test_garbage_and_a_dead_server_fail_naming_the_endpoint(server, mode, message):
    server.control(mode=mode)
    judge = Judge(settings(server.url, model="judge-model", max_retries=0))
    with pytest.raises(JudgeError, match=rf"the judge at {server.url}/chat/completions failed .*{message}"):
        ask(judge, "1", "1")


def test_concurrency_and_rate_limits_as_the_server_saw_them(server):
    async def many(judge: Judge, n: int, **params):
        try:
            question = [{"role": "user", "content": "Expected: 1\nAnswer: 1"}]
            return await asyncio.gather(*(judge.chat(question, **params) for _ in range(n)))
        finally:
            await judge.aclose()

    two_at_once = Judge(settings(server.url, model="judge-model", max_concurrent=2))
    assert asyncio.run(many(two_at_once, 6, hold_s=0.3)) == ["yes"] * 6
    assert server.control()["max_in_flight"] == 2
    start = time.monotonic()
    asyncio.run(many(Judge(settings(server.url, model="judge-model", max_rpm=120)), 6))  # 2 a second, a burst of 2
    assert time.monotonic() - start >= 1.9  # 2 at once, then one every 0.5 s


JUDGED = """
async def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):
    question = f"Expected: {ground_truth}\\nAnswer: {solution_str}"
    reply = await judge.chat([{"role": "user", "content": question}], max_tokens=4, hold_s=0.2)
    if reply not in ("yes", "no"):
        raise ValueError(f"the judge replied {reply!r}")
    return 1.0 if reply == "yes" else 0.0
"""


def test_a_manager_scores_through_the_judge_concurrently_and_counts_its_failures(
    server, tokenizer, make_batch, tmp_path
):
    from scaletrain.reward import build_reward_manager

    path = tmp_path / "judged.py"
    path.write_text(JUDGED)
    rows = [{"prompt": "1+1=", "response": r, "ground_truth": "2"} for r in ("2", "3", "2", "5")]
    judge = Judge(settings(server.url, max_retries=0))
    with build_reward_manager(tokenizer, "naive", {"path": str(path)}, judge=judge, step_timeout_s=20) as manager:
        out = manager(make_batch(rows), return_dict=True)
        assert out["reward_extra_info"]["score"] == [1.0, 0.0, 1.0, 0.0]
        assert out["metrics"]["judge/requests"] == 5.0 and out["metrics"]["reward/errors"] == 0  # /models once
        assert server.control()["max_in_flight"] == 4  # the samples' judge calls at once (each held 0.2 s)
        server.control(mode="die")
        start = time.monotonic()
        out = manager(make_batch(rows), return_dict=True)
    assert time.monotonic() - start < 15, "a dead judge must not hang the step"
    assert out["metrics"]["reward/errors"] == 4 and out["reward_extra_info"]["score"] == [0.0] * 4
    assert "the judge at" in (manager.last_error or "")


def test_the_multi_manager_binds_the_judge_to_its_components_that_take_it(server, tokenizer, make_batch, tmp_path):
    """A judge-calling correctness (the custom_reward_function) and a judge-calling component from a file, beside a
    rule component: each sample's components add up with their weights, the samples scored concurrently."""
    from scaletrain.reward import build_reward_manager

    path = tmp_path / "judged.py"
    path.write_text(JUDGED)
    rows = [{"prompt": "1+1=", "response": r, "ground_truth": "2"} for r in ("2", "3", "2", "5")]
    scorers = [
        {"name": "correctness", "weight": 0.5},
        {"path": str(path), "weight": 0.25, "label": "second_opinion"},
        {"name": "length", "weight": 0.25, "kwargs": {"target_chars": 1}},
    ]
    judge = Judge(settings(server.url, model="judge-model"))
    with build_reward_manager(tokenizer, "multi", {"path": str(path)}, judge=judge, scorers=scorers) as manager:
        out = manager(make_batch(rows), return_dict=True)
    info = out["reward_extra_info"]
    assert info["correctness"] == info["second_opinion"] == [1.0, 0.0, 1.0, 0.0]
    assert info["score"] == [0.75 * right + 0.25 * length for right, length in zip(info["correctness"], info["length"])]
    assert out["metrics"]["judge/requests"] == 8 and out["metrics"]["reward/errors"] == 0
    assert server.control()["max_in_flight"] > 1  # samples at once (each judge call held 0.2 s)
    with pytest.raises(ValueError, match=r"no multi component takes one of \['judge', 'reward_router_address'\]"):
        build_reward_manager(tokenizer, "multi", judge=judge, scorers=[{"name": "format", "weight": 1.0}])


def test_a_judge_needs_an_async_function_taking_it(server, tokenizer, tmp_path):
    from scaletrain.reward import build_reward_manager

    sync = tmp_path / "sync.py"
    sync.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):\n  0\n")
    with pytest.raises(ValueError, match=r"is not an async def: it calls the judge with `await judge.chat"):
        build_reward_manager(tokenizer, "naive", {"path": str(sync)}, judge=Judge(settings(server.url)))
    blind = tmp_path / "blind.py"
    blind.write_text("async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n  return 0\n")
    with pytest.raises(ValueError, match=r"takes none of \['judge', 'reward_router_address'\]"):
        build_reward_manager(tokenizer, "naive", {"path": str(blind)}, judge=Judge(settings(server.url)))


@pytest.mark.slow
def test_a_run_rewarded_by_a_remote_judge_and_one_whose_judge_dies(ray_cluster, task, server, tmp_path, monkeypatch):
    """The embedded default, 2 steps, its reward the judge's verdict (the remote-judge recipe's async
    custom_reward_function, launch/recipes/arithmetic_judge.py, awaiting it);
    the API key reaches the server and no file of the run; then the judge dies: the samples fail, counted, and
    the reward guard stops the run naming the judge instead of training on zeros."""
    from scaletrain.trainer.rollout.reward_guard import RewardFailureError
    from tests.trainer.runs import metrics, run_in_process

    monkeypatch.setenv("JUDGE_KEY", SECRET)
    path = ROOT / "launch" / "recipes" / "arithmetic_judge.py"  # the remote-judge recipe's reward function
    judge = [f"reward.judge.base_url={server.url}", "reward.judge.api_key_env=JUDGE_KEY", "reward.judge.max_retries=1"]
    overrides = [f"custom_reward_function.path={path}", *judge, "trainer.save_freq=-1", "trainer.test_freq=-1"]
    result = run_in_process(task, tmp_path / "run", 2, overrides)
    logged = metrics(result.run_dir)
    for step in (1, 2):
        assert logged[step]["judge/requests"] > 0 and logged[step]["judge/failures"] == 0
        assert logged[step]["reward/errors"] == 0
    assert set(server.control()["authorization"]) == {f"Bearer {SECRET}"}
    for file in Path(result.run_dir).rglob("*"):
        if file.is_file() and file.stat().st_size < 10_000_000:
            assert SECRET.encode() not in file.read_bytes(), file
    server.control(mode="die")
    asking = tmp_path / "judged.py"  # asks about every sample (the recipe's skips those cut off before EOS)
    asking.write_text(JUDGED)
    overrides[0] = f"custom_reward_function.path={asking}"
    guard = ["reward_model.max_error_steps=1", "reward.judge.backoff_s=0.01"]
    with pytest.raises(
        RewardFailureError, match=r"(?s)failed on more than 50% of the samples.*the judge at .* failed \(2 tries\)"
    ):
        run_in_process(task, tmp_path / "dead", 2, [*overrides, *guard])


@pytest.mark.slow
def test_the_judge_against_vllm_serve(task, tmp_path, monkeypatch):
    """vLLM's own OpenAI-compatible server (``vllm serve``, a real one) with the embedded default's model behind an
    API key: the served model is found at /models, concurrent chats get text back, and a wrong key fails naming
    HTTP 401 without showing either key."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    # ``vllm serve``'s server module (the ``vllm`` script asks for the package "vllm"; installed here as vllm-cpu)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", task["model"], "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--dtype", "float32", "--max-model-len", "64", "--enforce-eager"]
    argv += ["--served-model-name", "judge", "--api-key", SECRET]
    log = tmp_path / "vllm_serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(url, process, log)
        monkeypatch.setenv("JUDGE_KEY", SECRET)
        judge = Judge(settings(url, api_key_env="JUDGE_KEY", timeout_s=60.0))

        async def four():
            try:
                question = [{"role": "user", "content": "1+1="}]
                return await asyncio.gather(*(judge.chat(question, max_tokens=4, temperature=0.0) for _ in range(4)))
            finally:
                await judge.aclose()

        replies = asyncio.run(four())
        assert all(isinstance(r, str) for r in replies) and len(set(replies)) == 1  # greedy: one reply
        assert judge._model == "judge" and judge.metrics()["judge/failures"] == 0
        monkeypatch.setenv("JUDGE_KEY", "sk-wrong-key")
        with pytest.raises(JudgeError, match=r"HTTP 401") as info:
            ask(Judge(settings(url, api_key_env="JUDGE_KEY", model="judge", max_retries=0)), "1", "1")
        assert SECRET not in str(info.value) and "sk-wrong-key" not in str(info.value)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def wait_until_serving(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> None:
    """Until ``url``/models answers (401 counts: the server is up); fails with the log's end if it exits first."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/models", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(1.0)
    pytest.fail(f"vllm serve did not answer within {timeout_s:g}s:\n{log.read_text()[-3000:]}")
