"""The async rollout path: batching + sticky routing, DataProto assembly, and token exactness on real engines.

Token exactness: a warmed-up tiny model calls the calculator, answers, and is told by the answer checker that it
is wrong (the ground truth is unreachable) until ``max_assistant_turns``; every trajectory then has 3+ model turns.
We check that the model-token spans (mask 1) are exactly what the engine sampled, that the rest is the chat
template's rendering of the tool / user turns, that the whole sequence decodes to the template's rendering of the
final conversation, and that rollout log-probs sit on the right positions (recomputed by one forward pass).
"""

import asyncio

import pytest
import torch

from backends.rollout.base import RolloutConfig, TokenOutput
from scaletrain.agent.manager import AgentLoopManager
from scaletrain.agent.server import AsyncServerManager, LocalEngineBackend
from scaletrain.protocol import DataProto
from tests.agent.helpers import SpyBackend, config, make_agent_tokenizer
from tests.backends.tiny import EOS_ID

TOK = make_agent_tokenizer()


def batch(questions, agent_name=None, interaction=None):
    import numpy as np

    rows = {
        "raw_prompt": [[{"role": "user", "content": q}] for q in questions],
        "extra_info": [{"interaction_kwargs": interaction} if interaction else {} for _ in questions],
    }
    if agent_name:
        rows["agent_name"] = [agent_name] * len(questions)
    arr = {}
    for k, v in rows.items():
        arr[k] = np.empty(len(v), dtype=object)
        for i, x in enumerate(v):
            arr[k][i] = x
    return DataProto.from_dict(non_tensors=arr)


class FakeEngine:
    """Answers a tool call first, then "5"; records each batch's prompts."""

    def __init__(self):
        self.batches = []

    def generate_tokens(self, requests):
        self.batches.append([r.prompt_ids for r in requests])
        outs = []
        for r in requests:
            text = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
            if "<tool>" in TOK.decode(r.prompt_ids):
                text = "5"
            ids = TOK(text, add_special_tokens=False)["input_ids"] + [EOS_ID]
            outs.append(TokenOutput(ids, [-0.5] * len(ids), "stop"))
        return outs


def tools_file(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n")
    return str(path)


def test_batching_sticky_routing_and_assembly(tmp_path):
    engines = [FakeEngine(), FakeEngine()]
    server = AsyncServerManager(LocalEngineBackend(engines), max_wait_ms=50)
    cfg = config(tools_config_file=tools_file(tmp_path))
    manager = AgentLoopManager(cfg, server, TOK, prompt_length=24, response_length=120)
    out = manager.generate_sequences(batch(["2+3?", "1+4?", "3+2?"]), {"temperature": 1.0, "seed": 1}, n=2)
    # 6 trajectories x 2 turns, split 3/3 over the 2 engines, every flush holding all waiting trajectories
    assert [len(b) for e in engines for b in e.batches] == [3, 3, 3, 3]
    # sticky: an engine's second-turn prompts extend exactly its own first-turn prompts
    for e in engines:
        first, second = e.batches
        assert all(any(s[: len(f)] == f for f in first) for s in second)
    assert len(out) == 6 and out.batch["responses"].shape == (6, 120) and out.batch["prompts"].shape[1] == 24
    mask, attn = out.batch["response_mask"], out.batch["attention_mask"][:, 24:]
    assert ((mask == 1) <= (attn == 1)).all() and (attn.sum(-1) > mask.sum(-1)).all()  # tool tokens: attn only
    assert (out.batch["rollout_log_probs"][mask == 0] == 0).all()
    assert (out.batch["rollout_log_probs"][mask == 1] == -0.5).all()
    assert list(out.non_tensor_batch["num_turns"]) == [4] * 6
    assert list(out.non_tensor_batch["tool_rewards"][0]) == [0.0]
    m = out.meta_info["metrics"]
    assert m["agent/tool_calls"] == 6 and m["agent/tool_errors"] == 0 and m["num_turns/mean"] == 4
    assert m["agent/generate_batches"] == 2 and m["agent/mean_batch_size"] == 6


def test_agent_name_per_row_and_unknown(tmp_path):
    server = AsyncServerManager(LocalEngineBackend([FakeEngine()]))
    manager = AgentLoopManager(
        config(tools_config_file=tools_file(tmp_path)), server, TOK, prompt_length=24, response_length=120
    )
    out = manager.generate_sequences(batch(["2+3?"], agent_name="single_turn_agent"), {"temperature": 1.0})
    assert list(out.non_tensor_batch["num_turns"]) == [2]  # the single-turn loop: no tool turn
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        manager.generate_sequences(batch(["x"], agent_name="nope"), {"temperature": 1.0})


def make_engine(name, model_dir):
    from backends.rollout.base import get_rollout

    cfg = RolloutConfig(model_path=model_dir, max_model_len=512, kv_cache_bytes=32 << 20)
    return get_rollout(name)(cfg, make_agent_tokenizer())


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_token_exactness_multi_turn(engine_name, tool_model, tmp_path):
    if engine_name == "vllm":
        pytest.importorskip("vllm")
    engine = make_engine(engine_name, tool_model)
    interaction = tmp_path / "interaction.yaml"
    interaction.write_text(
        "interaction:\n  - name: checker\n    class_name: answer_checker\n    config: {max_attempts: 10}\n"
    )
    cfg = config(
        tools_config_file=tools_file(tmp_path), interaction_config_file=str(interaction), max_assistant_turns=4
    )
    backend = SpyBackend([engine])
    manager = AgentLoopManager(cfg, AsyncServerManager(backend), TOK, prompt_length=24, response_length=240)
    questions = ["12+34", "56+21", "70+18", "33+44"]
    rows = manager._rows(batch(questions, interaction={"name": "checker", "ground_truth": "never"}), 2, "t")
    outputs = asyncio.run(manager._run_all(rows, {"temperature": 1.0, "seed": 3}))
    sampled = {}  # prompt -> every token list sampled for it (the n samples of a question share turn 1's prompt)
    for p, t in backend.sampled:
        sampled.setdefault(tuple(p), []).append(list(t))
    multi = 0
    for out in outputs:
        full = out.prompt_ids + out.response_ids
        spans, start = [], None
        for i, m in enumerate(out.response_mask + [0]):
            if m and start is None:
                start = i
            if not m and start is not None:
                spans.append((start, i))
                start = None
        for s, e in spans:  # each model span == the tokens sampled for the prompt that preceded it
            prefix = tuple(full[: len(out.prompt_ids) + s])
            assert list(out.response_ids[s:e]) in sampled[prefix]
        text = TOK.apply_chat_template(out.extra_fields["messages"], tokenize=False, add_generation_prompt=False)
        assert TOK.decode(full, skip_special_tokens=False) == text
        multi += len(spans) >= 3
        assert len(out.response_logprobs) == len(out.response_ids)
    assert multi >= len(outputs) // 2, "most trajectories should have 3+ model turns"
    assert sum(o.metrics.get("tool_calls", 0) for o in outputs) >= len(outputs) // 2  # tool turns happened too
    # log-probs on the right positions: one forward pass over the assembled batch (temperature 1, no top-k)
    data = manager._assemble(outputs)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    R = data.batch["responses"].shape[1]
    with torch.no_grad():
        logits = (
            model(
                input_ids=data.batch["input_ids"],
                attention_mask=data.batch["attention_mask"],
                position_ids=data.batch["position_ids"],
            )
            .logits[:, -R - 1 : -1]
            .float()
        )
    lp = torch.log_softmax(logits, -1).gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(lp[mask], data.batch["rollout_log_probs"][mask], atol=2e-3, rtol=1e-3)
    if engine_name == "vllm":
        del engine.llm


def test_overlong_rendered_prompt_fails_naming_the_row(tmp_path):
    server = AsyncServerManager(LocalEngineBackend([FakeEngine()]))
    manager = AgentLoopManager(
        config(tools_config_file=tools_file(tmp_path)), server, TOK, prompt_length=8, response_length=64
    )
    with pytest.raises(ValueError, match="row t-0-0: the rendered prompt has 22 tokens, more than rollout"):
        manager.generate_sequences(batch(["2+3?"]), {"temperature": 1.0}, tag="t")


def test_hf_generate_tokens_cuts_each_request_to_its_limit(tool_model):
    from backends.rollout.base import SamplingConfig, TokenRequest

    engine = make_engine("hf", tool_model)
    prompt = TOK("<user>12+34<eos><assistant>", add_special_tokens=False)["input_ids"]
    greedy = lambda k: SamplingConfig(temperature=0.0, max_new_tokens=k)  # noqa: E731
    short, long, other = engine.generate_tokens(
        [TokenRequest(prompt, greedy(3)), TokenRequest(prompt, greedy(40)), TokenRequest(prompt[:5], greedy(40))]
    )
    assert short.token_ids == long.token_ids[:3] and short.finish_reason == "length"
    assert long.finish_reason == "stop" and long.token_ids[-1] == EOS_ID
    assert len(short.log_probs) == 3 and long.log_probs[:3] == pytest.approx(short.log_probs)
    assert other.token_ids  # a second prompt of another length in the same batch
