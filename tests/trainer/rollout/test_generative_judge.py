"""A generative reward model served by the run's own engines (scaletrain/workers/generative_rm.py,
scaletrain/trainer/rollout/judge_server.py, judge_engines.py): the judge server in front of a real engine as the
judge client and raw HTTP see it, the colocated engine's lifecycle in a Ray worker, runs rewarded through a
colocated vLLM judge and one on its own pool, and the config's refusals."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

ASKS_THE_JUDGE = """
from scaletrain.reward.scorers.default import default_compute_score

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, judge=None):
    question = f"Is {solution_str!r} the answer {ground_truth}? Say yes or no."
    reply = await judge.chat([{"role": "user", "content": question}], max_tokens=3, temperature=0)
    assert isinstance(reply, str)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""

# verl's GenRM functions post to the router themselves (reward_router_address: HOST:PORT)
POSTS_TO_THE_ROUTER = """
import httpx
from scaletrain.reward.scorers.default import default_compute_score

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_router_address=None):
    body = {"messages": [{"role": "user", "content": f"{ground_truth}={solution_str}"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(f"http://{reward_router_address}/v1/chat/completions", json=body)
    reply.raise_for_status()
    assert isinstance(reply.json()["choices"][0]["message"]["content"], str)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


class LocalRole:
    """One real engine in this process, in the judge role's shape (TokenRole)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def rollout_dp_size(self) -> int:
        return 1

    def generate_tokens(self, per_rank):
        return [self.engine.generate_tokens(requests) for requests in per_rank]


@pytest.fixture(scope="module")
def engine_and_tokenizer(task):
    from transformers import AutoTokenizer

    from backends.rollout.base import RolloutConfig, get_rollout

    tokenizer = AutoTokenizer.from_pretrained(task["model"])
    engine = get_rollout("hf")(RolloutConfig(model_path=task["model"], max_model_len=256), tokenizer)
    return engine, tokenizer


def judge_settings(url: str, **kw):
    from scaletrain.reward.judge import JudgeSettings

    return JudgeSettings(base_url=url, **{"max_retries": 0, "timeout_s": 60.0, **kw})


def test_the_judge_server_answers_chats_from_the_engine(engine_and_tokenizer):
    """Before the engines are attached: 503 (the client's error names it); then concurrent greedy chats through the
    judge client get what the engine itself generates for the rendered prompt, max_tokens is bounded by
    response_length, and the served model is listed."""
    from backends.rollout.base import SamplingConfig, TokenRequest
    from scaletrain.reward.judge import Judge, JudgeError
    from scaletrain.trainer.rollout.judge_server import JudgeServer
    from scaletrain.workers.rm_config import GenerativeRolloutConfig

    engine, tokenizer = engine_and_tokenizer
    server = JudgeServer(
        tokenizer, "tiny-judge", GenerativeRolloutConfig(name="hf", prompt_length=64, response_length=6)
    )
    try:
        with pytest.raises(JudgeError, match="503"):
            asyncio.run(Judge(judge_settings(server.url)).chat([{"role": "user", "content": "hi"}]))
        server.attach(LocalRole(engine))
        questions = [f"Is {i} + {i} = {2 * i}?" for i in range(6)]

        async def ask_all():
            judge = Judge(judge_settings(server.url))
            try:
                chats = [judge.chat([{"role": "user", "content": q}], temperature=0) for q in questions]
                long = judge.chat([{"role": "user", "content": "12+34="}], temperature=0, max_tokens=10**6)
                return await asyncio.gather(*chats, long), await judge.model(), judge.metrics()
            finally:
                await judge.aclose()

        replies, model, counted = asyncio.run(ask_all())
        assert model == "tiny-judge" and counted["judge/requests"] == len(questions) + 2  # + /models once
        for question, reply in zip(questions, replies, strict=False):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out = engine.generate_tokens([TokenRequest(ids, SamplingConfig(temperature=0.0, max_new_tokens=6))])[0]
            assert reply == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert len(tokenizer(replies[-1], add_special_tokens=False)["input_ids"]) <= 6 + 1  # bounded: 6 tokens
    finally:
        server.close()


class DeadRole(LocalRole):
    def generate_tokens(self, per_rank):
        raise RuntimeError("engine worker died")


def test_an_engine_failure_reaches_the_client_as_a_500_it_retries_and_counts(engine_and_tokenizer):
    from scaletrain.reward.judge import Judge, JudgeError
    from scaletrain.trainer.rollout.judge_server import JudgeServer
    from scaletrain.workers.rm_config import GenerativeRolloutConfig

    _, tokenizer = engine_and_tokenizer
    server = JudgeServer(
        tokenizer, "tiny-judge", GenerativeRolloutConfig(name="hf", prompt_length=64, response_length=6)
    )
    server.attach(DeadRole(None))
    judge = Judge(judge_settings(server.url, max_retries=1, backoff_s=0.01))
    try:
        with pytest.raises(JudgeError, match=r"failed \(2 tries\): HTTP 500.*engine worker died"):
            asyncio.run(judge.chat([{"role": "user", "content": "1+1="}]))
        assert judge.metrics() == {"judge/requests": 3.0, "judge/retries": 1.0, "judge/failures": 1.0}  # + /models
    finally:
        server.close()


@pytest.mark.slow
def test_smollm2_judges_through_the_server(smollm2_dir):
    """SmolLM2-135M-Instruct as the judge (a real chat template, with its default system prompt): the prompt the
    server generates from is the template's rendering, and the greedy verdict is the engine's own, in words."""
    from transformers import AutoTokenizer

    from backends.rollout.base import RolloutConfig, SamplingConfig, TokenRequest, get_rollout
    from scaletrain.trainer.rollout.judge_server import JudgeServer
    from scaletrain.workers.rm_config import GenerativeRolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = get_rollout("hf")(RolloutConfig(model_path=smollm2_dir, max_model_len=512), tokenizer)
    server = JudgeServer(tokenizer, "smollm2", GenerativeRolloutConfig(name="hf", prompt_length=256, response_length=8))
    server.attach(LocalRole(engine))
    try:
        messages = [{"role": "user", "content": "Is 2 + 2 equal to 4? Answer yes or no."}]
        body = {"messages": messages, "temperature": 0, "max_tokens": 8}
        reply = httpx.post(f"{server.url}/chat/completions", json=body, timeout=120).json()
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        assert reply["usage"]["prompt_tokens"] == len(ids) > 20  # the template's system prompt included
        out = engine.generate_tokens([TokenRequest(ids, SamplingConfig(temperature=0.0, max_new_tokens=8))])[0]
        verdict = reply["choices"][0]["message"]["content"]
        assert verdict == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert any(c.isalpha() for c in verdict), verdict
    finally:
        server.close()


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"messages": [{"role": "user", "content": "1+1="}], "stop": ["\n"]}, 400, "unsupported field.*'stop'"),
        ({"messages": [{"role": "user", "content": "1+1="}], "stream": True}, 400, "'stream' false"),
        ({"messages": [{"role": "user", "content": "1+1="}], "n": 2}, 400, "'n' must be 1"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hello"}]}, 400, "rendered to no tokens"),
        ({"messages": [{"role": "user", "content": "1+" * 100}]}, 400, "over reward_model.rollout.prompt_length=64"),
        ({"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 0}, 400, "'max_tokens' must be a positive"),
        (
            {"messages": [{"role": "user", "content": "1+1="}], "temperature": "hot"},
            400,
            "'temperature' must be a number",
        ),
        ({"messages": [{"role": "user", "content": "1+1="}], "model": "gpt-9"}, 404, "'gpt-9' is not served here"),
        ("not an object", 400, "must be a JSON object"),
    ],
)
def test_requests_the_server_does_not_serve_get_an_error_naming_the_field(engine_and_tokenizer, body, status, message):
    import re

    from scaletrain.trainer.rollout.judge_server import JudgeServer
    from scaletrain.workers.rm_config import GenerativeRolloutConfig

    engine, tokenizer = engine_and_tokenizer
    server = JudgeServer(
        tokenizer, "tiny-judge", GenerativeRolloutConfig(name="hf", prompt_length=64, response_length=6)
    )
    server.attach(LocalRole(engine))
    try:
        reply = httpx.post(f"{server.url}/chat/completions", content=json.dumps(body), timeout=30)
        assert reply.status_code == status and re.search(message, reply.json()["error"]["message"]), reply.text
        garbage = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=30)
        assert garbage.status_code == 400 and "not JSON" in garbage.json()["error"]["message"]
    finally:
        server.close()


def test_the_colocated_judge_engine_sleeps_until_a_request_and_after_release(ray_cluster, task, tmp_path):
    """In a Ray worker as the trainer colocates it: built asleep, woken by the first request, asleep after
    ``release`` (the trainer's call before the actor trains); on a pool of its own it never sleeps."""
    from dataclasses import replace

    from backends.rollout.base import SamplingConfig, TokenRequest
    from scaletrain.controller import (
        RayClassWithInitArgs,
        RayResourcePool,
        RayWorkerGroup,
        create_colocated_worker_cls,
    )
    from scaletrain.workers.generative_rm import GenerativeRewardModelWorker
    from scaletrain.workers.rm_config import GenerativeRolloutConfig, RewardModelConfig
    from scaletrain.workers.roles import GenerativeRewardModelRole

    rm = RewardModelConfig(enable=True, rollout=GenerativeRolloutConfig(name="hf", prompt_length=32, response_length=4))
    rm = replace(rm, model=replace(rm.model, path=task["model"]))
    for pooled, after_release in ((False, "sleeping"), (True, "serving")):
        cfg = replace(rm, enable_resource_pool=pooled)
        pool = RayResourcePool([1], use_gpu=False, name_prefix=f"judge{int(pooled)}")
        group = RayWorkerGroup(
            pool, create_colocated_worker_cls({"rm": RayClassWithInitArgs(GenerativeRewardModelWorker, cfg)})
        )
        try:
            judge = GenerativeRewardModelRole(group.spawn(prefix_set=["rm"])["rm"])
            judge.init_model()
            assert judge.engine_states() == [after_release]
            out = judge.generate_tokens([[TokenRequest([1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=2))]])
            assert len(out[0][0].token_ids) >= 1 and judge.engine_states() == ["serving"]
            judge.release()
            assert judge.engine_states() == [after_release]
        finally:
            group.shutdown()
            pool.release()


@pytest.mark.slow
def test_runs_rewarded_through_a_colocated_vllm_judge_and_one_on_its_own_pool(ray_cluster, task, tmp_path):
    """The embedded task, its reward function asking a generative judge (the tiny model) served by the run's own
    engine: vLLM colocated with the actor (asleep from its start until the step's rewards ask it, put to sleep
    again before the step trains), and the hf engine on a pool of its own, reached by a reward worker through
    verl's reward_router_address; a step each."""
    from tests.trainer.runs import metrics, run_in_process

    asks, posts = tmp_path / "asks.py", tmp_path / "posts.py"
    asks.write_text(ASKS_THE_JUDGE)
    posts.write_text(POSTS_TO_THE_ROUTER)
    judge = [
        "reward_model.enable=true",
        f"reward_model.model.path={task['model']}",
        "reward_model.rollout.name=vllm",
        "reward_model.rollout.prompt_length=48",
        "reward_model.rollout.response_length=4",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.n_gpus_per_node=1",  # one rank: the judge's engine beside it (colocated) or on a rank of its own
        "trainer.plot_at_end=false",
    ]
    result = run_in_process(task, tmp_path / "colocated", 1, [*judge, f"custom_reward_function.path={asks}"])
    logged = metrics(result.run_dir)[1]
    assert logged["judge/requests"] >= 8 and logged["judge/failures"] == 0  # 4 prompts x 2 (+ /models once)
    assert logged["reward/errors"] == 0 and "timing_s/judge_sleep" in logged
    pooled = [
        "reward_model.rollout.name=hf",
        "reward_model.enable_resource_pool=true",
        "reward.num_workers=1",
        f"custom_reward_function.path={posts}",
    ]
    logged = metrics(run_in_process(task, tmp_path / "pooled", 1, [*judge, *pooled]).run_dir)[1]
    assert logged["reward/errors"] == 0 and "timing_s/judge_sleep" not in logged


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], None),
        (["reward_model.rollout.name=sglang"], "reward_model.rollout.name must be one of vllm, hf"),
        (["custom_reward_function.path=null"], "needs custom_reward_function.path"),
        (["reward.judge.base_url=http://h:1/v1"], "are two judges"),
        (
            ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false"],
            "set reward_model.enable_resource_pool=true",
        ),
        (["reward_model.rollout.name=hf", "reward_model.rollout.tensor_model_parallel_size=2"], "only the vllm"),
        (["reward_model.rollout.prompt_length=100000"], "exceeds the model's max_position_embeddings"),
        (["reward_model.nnodes=0", "reward_model.enable_resource_pool=true"], "reward_model.nnodes must be >= 1"),
    ],
)
def test_a_generative_judge_config_is_checked_before_the_run(task, tmp_path, overrides, message):
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    fn = tmp_path / "asks.py"
    fn.write_text(ASKS_THE_JUDGE)
    base = [
        "reward_model.enable=true",
        f"reward_model.model.path={task['model']}",
        "reward_model.rollout.name=vllm",
        "reward_model.rollout.prompt_length=48",  # + response_length within the tiny model's 64 positions
        "reward_model.rollout.response_length=4",
        f"custom_reward_function.path={fn}",
    ]
    extra = [o for o in base if o.split("=")[0] not in {x.split("=")[0] for x in overrides}] + overrides
    args = ppo_overrides(task, tmp_path / "run", 2, extra)
    if message is None:
        checked(*args)
    else:
        with pytest.raises(ConfigError, match=message):
            checked(*args)


def test_verl_reward_model_rollout_keys_port(task, tmp_path):
    """verl's reward.reward_model.rollout.* and pool keys land on reward_model.*; its sampling keys are dropped (a
    judge request carries its own); a sequence classifier with them set stays on the training backend."""
    from scaletrain.trainer.config.verl_compat import translate_overrides
    from scaletrain.workers.rm_config import RewardModelConfig, serves_judge

    known = {
        "reward_model.rollout.name",
        "reward_model.rollout.gpu_memory_utilization",
        "reward_model.enable_resource_pool",
        "reward_model.nnodes",
    }
    verl = [
        "reward.reward_model.rollout.name=vllm",
        "reward.reward_model.rollout.gpu_memory_utilization=0.4",
        "reward.reward_model.rollout.temperature=0.7",
        "reward.reward_model.enable_resource_pool=true",
        "reward.reward_model.nnodes=1",
    ]
    assert translate_overrides(verl, known) == [
        "reward_model.rollout.name=vllm",
        "reward_model.rollout.gpu_memory_utilization=0.4",
        "reward_model.enable_resource_pool=true",
        "reward_model.nnodes=1",
    ]
    from tests.trainer.rollout.test_rm_reward import save_embedded_vocab_rm

    rm = RewardModelConfig(enable=True)
    rm.rollout.name = "vllm"
    rm.model.path = task["model"]
    assert serves_judge(rm)
    rm.model.path = save_embedded_vocab_rm(tmp_path / "classifier")
    assert not serves_judge(rm)
    checked_ok = [
        f"reward_model.model.path={rm.model.path}",
        "reward_model.enable=true",
        "reward_model.rollout.name=vllm",
    ]
    from tests.trainer.config.test_ppo_config import checked

    checked(*checked_ok)  # a classifier with verl's serving keys: scored on the training backend, no judge checks
