"""Partial rollout (async_training.partial_rollout): generations cut into segments, a weight push between two of
them, the rest generated with the new weights. Real HF engine and model: the tokens stay exact across the push,
each token keeps the log-prob of the weights that sampled it, the masks cover exactly the response, and each
trajectory reports the oldest weight version that contributed. Also the rollout role's turn-taking: a waiting
push goes before the next generation call."""

import threading
import time

import numpy as np
import pytest
import torch

from scaletrain.agent.manager import AgentLoopManager
from scaletrain.agent.server import AsyncServerManager, LocalEngineBackend
from scaletrain.protocol import DataProto
from tests.agent.helpers import config, make_agent_tokenizer
from tests.agent.test_async_rollout import make_engine

TOK = make_agent_tokenizer()
SEGMENT, RESPONSE = 3, 12


class PushingBackend(LocalEngineBackend):
    """Stamps each call's outputs with the engine's weight version; after the first call, new weights arrive."""

    def __init__(self, engine, new_weights):
        super().__init__([engine])
        self.engine, self.new_weights, self.version = engine, new_weights, 0
        self.calls = []  # (version, [(prompt_ids, token_ids)])

    def generate(self, per_rank):
        outs = super().generate(per_rank)
        for out in outs[0]:
            out.weight_version = self.version
        self.calls.append((self.version, [(r.prompt_ids, o.token_ids) for r, o in zip(per_rank[0], outs[0])]))
        if self.version == 0:  # the push lands between the first and the second segment
            self.engine.update_weights([list(self.new_weights.items())])
            self.version = 1
        return outs


def perturbed(model):
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def rows(questions):
    raw = np.empty(len(questions), dtype=object)
    for i, q in enumerate(questions):
        raw[i] = [{"role": "user", "content": q}]
    return DataProto.from_dict(non_tensors={"raw_prompt": raw})


def scored_log_probs(model, data):
    R = data.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=data.batch["input_ids"],
            attention_mask=data.batch["attention_mask"],
            position_ids=data.batch["position_ids"],
        ).logits[:, -R - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_partial_rollout_keeps_tokens_and_log_probs_across_a_push(tool_model):
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    new_weights = perturbed(old)
    new = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    new.load_state_dict(new_weights)
    backend = PushingBackend(make_engine("hf", tool_model), new_weights)
    server = AsyncServerManager(backend, max_wait_ms=50, segment_tokens=SEGMENT)
    manager = AgentLoopManager(
        config(enable=False), server, TOK, prompt_length=24, response_length=RESPONSE, pad_token_id=0
    )
    out = manager.generate_sequences(rows(["12+34", "56+21", "70+18"]), {"temperature": 1.0, "seed": 3}, n=2)

    assert len(backend.calls) >= 2 and {v for v, _ in backend.calls} == {0, 1}
    assert list(out.non_tensor_batch["rollout_version"]) == [0] * 6  # the oldest version in each trajectory
    P = out.batch["prompts"].shape[1]
    lp = {0: scored_log_probs(old, out), 1: scored_log_probs(new, out)}
    spanned = 0
    for i in range(6):
        length = int(out.batch["response_mask"][i].sum())
        assert out.batch["response_mask"][i, :length].all() and not out.batch["response_mask"][i, length:].any()
        assert (out.batch["attention_mask"][i, P : P + length] == 1).all()
        prompt = out.batch["prompts"][i][out.batch["attention_mask"][i, :P].bool()].tolist()
        response = out.batch["responses"][i, :length].tolist()
        covered, versions = 0, set()
        for version, requests in backend.calls:  # each segment: prompt + tokens so far in, its tokens out
            for req_prompt, tokens in requests:
                if req_prompt == prompt + response[:covered] and tokens == response[covered : covered + len(tokens)]:
                    got = out.batch["rollout_log_probs"][i, covered : covered + len(tokens)]
                    want = lp[version][i, covered : covered + len(tokens)]
                    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)  # the sampling weights' log-prob
                    covered, versions = covered + len(tokens), versions | {version}
                    break
        assert covered == length, f"trajectory {i}: segments cover {covered} of {length} tokens"
        spanned += versions == {0, 1}
    assert spanned >= 1
    assert out.meta_info["metrics"]["async/partial_rollouts"] == spanned
    # the early segments' log-probs are the old weights': the new weights score them differently
    first = [i for i in range(6) if int(out.batch["response_mask"][i].sum()) > SEGMENT]
    assert first and any(
        (lp[1][i, :SEGMENT] - out.batch["rollout_log_probs"][i, :SEGMENT]).abs().max() > 1e-2 for i in first
    )


class SlowGroup:
    """A stand-in worker group: each call takes 50 ms and is logged in order."""

    def __init__(self):
        self.log = []

    def call(self, method, *args):
        self.log.append(method.__name__)
        time.sleep(0.05)
        return [[]] if method.__name__ == "generate_tokens" else [0]


@pytest.mark.timeout(30)
def test_a_waiting_push_goes_before_the_next_generation_call():
    from scaletrain.controller.weight_transport import WeightBuckets
    from scaletrain.workers.roles import RolloutRole

    role = RolloutRole(SlowGroup())
    stop = threading.Event()

    def rollouter():  # generation calls back to back, as segments are
        while not stop.is_set():
            role.generate_tokens([[]])

    thread = threading.Thread(target=rollouter)
    thread.start()
    time.sleep(0.12)
    started = time.perf_counter()
    role.receive_weights(WeightBuckets(version=1))
    waited = time.perf_counter() - started
    stop.set()
    thread.join()
    assert waited < 0.12, f"the push waited {waited:.2f}s: more than the one call in flight"
    assert role.version == 1 and "receive_weights" in role.group.log
