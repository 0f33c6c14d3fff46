"""vLLM's AsyncLLM engine (backends/rollout/vllm_async.py) against the synchronous engine, on CPU: the same seeded
samples and log-probs, requests from many threads at once, weight updates through the engine-core process, and no
engine left behind when its owner dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from backends.rollout.base import SamplingConfig, TokenRequest
from tests.backends.conftest import PROMPTS
from tests.backends.rollout.test_rollout_vllm import GREEDY, assert_same_rollout, checkpoint_buckets

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def async_engine(rollout_config, rollout_tokenizer):
    from backends.rollout.vllm_async import VLLMAsyncRolloutEngine

    engine = VLLMAsyncRolloutEngine(rollout_config, rollout_tokenizer)
    yield engine
    engine.close()


def token_requests(tokenizer, seed: int | None, max_new: int = 12) -> list[TokenRequest]:
    sampling = SamplingConfig(n=1, temperature=0.0 if seed is None else 1.0, max_new_tokens=max_new)
    return [
        TokenRequest(
            tokenizer(text)["input_ids"],
            SamplingConfig(**{**vars(sampling), "seed": None if seed is None else seed + i}),
        )
        for i, text in enumerate(PROMPTS)
    ]


def test_same_samples_as_the_sync_engine(async_engine, vllm_engine, rollout_tokenizer, prompts):
    for seed in (None, 7):
        requests = token_requests(rollout_tokenizer, seed)
        want, got = vllm_engine.generate_tokens(requests), async_engine.generate_tokens(requests)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=1e-4)
    sampled = SamplingConfig(n=2, temperature=0.8, max_new_tokens=10, seed=3)
    assert_same_rollout(async_engine.generate(prompts, sampled), vllm_engine.generate(prompts, sampled))


def test_requests_from_many_threads_run_together(async_engine, vllm_engine, rollout_tokenizer):
    """Each thread blocks on its own request (as the rollout worker's request threads do); the engine runs them
    concurrently and each gets its own answer."""
    requests = token_requests(rollout_tokenizer, seed=11, max_new=24) * 4
    want = [o.token_ids for o in vllm_engine.generate_tokens(requests)]
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: async_engine.submit(r).result().token_ids, requests))
    assert got == want


def test_weight_update_through_the_engine_core(async_engine, rollout_model_dir, prompts):
    before = async_engine.generate(prompts, GREEDY)
    scaled = [
        [(name, t * 1.5 if name.endswith("norm.weight") else t) for name, t in b]
        for b in checkpoint_buckets(rollout_model_dir)
    ]
    try:
        async_engine.update_weights(scaled)
        changed = async_engine.generate(prompts, GREEDY)
        assert not torch.equal(changed.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    finally:
        async_engine.update_weights(checkpoint_buckets(rollout_model_dir))
    assert_same_rollout(async_engine.generate(prompts, GREEDY), before, atol=1e-6)


OWNER = """
import os, sys, time
sys.path.insert(0, {root!r})
from backends.rollout.base import RolloutConfig
from backends.rollout.vllm_async import VLLMAsyncRolloutEngine
from transformers import AutoTokenizer
config = RolloutConfig(model_path={model!r}, dtype="float32", max_model_len=256, kv_cache_bytes=32 << 20)
engine = VLLMAsyncRolloutEngine(config, AutoTokenizer.from_pretrained({model!r}))
print("ready", flush=True)
time.sleep(600)
"""


def engine_children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_engine_core_exits_when_its_owner_is_killed(rollout_model_dir):
    root = str(Path(__file__).resolve().parents[3])  # the repository (tests/backends/rollout/this file)
    code = textwrap.dedent(OWNER.format(root=root, model=rollout_model_dir))
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(owner.stdout.readline, "")  # vLLM logs to stdout too
        assert any(line.strip() == "ready" for line in lines), "the engine's owner did not start"
        children = engine_children(owner.pid)
        assert children, "the async engine runs its core in a child process"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(running(p) for p in children):
        time.sleep(0.5)
    alive = [p for p in children if running(p)]
    assert not alive, f"engine-core processes {alive} outlived their owner"
