"""Split placement's weight push between real worker groups (scaletrain/controller/weight_transport.py): a trainer
group (2 fsdp ranks) pushes to a rollout pool (2 vLLM ranks started from random weights) over the collective group
and through the object store; the pool's greedy tokens must equal a fresh engine's started from the trainer's
exported HF checkpoint (the collective push by both its lanes). A rollout rank killed while a push runs fails the
push naming that rank, never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from backends.config import ModelConfig
from backends.rollout.base import CheckpointEngineSettings, SamplingConfig
from scaletrain.controller import WorkerDiedError
from scaletrain.trainer.rollout.weight_sync import WeightSync
from scaletrain.workers import ActorRolloutRefConfig, ActorRolloutRefWorker, EngineSetup, RolloutWorkerConfig
from scaletrain.workers.roles import ActorRolloutRefRole, RolloutRole
from tests.backends.tiny import save_tiny_qwen2
from tests.controller.workers import started_group
from tests.workers.test_role_workers import prompt_batch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def rollout_config(load_format: str) -> ActorRolloutRefConfig:
    return ActorRolloutRefConfig(
        rollout=RolloutWorkerConfig(
            name="vllm", n=1, response_length=12, prompt_length=8, load_format=load_format, weight_bucket_bytes=1 << 16
        )
    )


def greedy(group) -> tuple[list[list[int]], torch.Tensor]:
    """(each prompt's greedy tokens, their log-probs: 0 past the end)."""
    out = group.generate_sequences(prompt_batch(), GREEDY)
    tokens = [row[mask.bool()].tolist() for row, mask in zip(out.batch["responses"], out.batch["response_mask"])]
    return tokens, out.batch["rollout_log_probs"]


def assert_same(got, want) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def groups(ray_cluster, tmp_path_factory):
    """(trainer group, rollout group, the greedy outputs of a fresh engine on the trainer's exported checkpoint)."""
    tmp = tmp_path_factory.mktemp("push")
    # head_dim 32 (vLLM's CPU kernels); large enough that a push takes many 64 KiB buckets
    shape = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16)
    path = save_tiny_qwen2(str(tmp / "model"), seed=4, num_key_value_heads=4, **shape)
    setup = EngineSetup(model=ModelConfig(path=path), backend="fsdp")
    trainer_args = (ActorRolloutRefWorker, rollout_config("auto"), setup, "actor")
    with started_group(ray_cluster, 2, *trainer_args, use_gpu=False, name_prefix="push_trainer") as trainer:
        trainer.init_model()
        exported = str(tmp / "exported")
        trainer.save_hf(exported)
        fresh_setup = EngineSetup(model=ModelConfig(path=exported), backend="fsdp")
        fresh_args = (ActorRolloutRefWorker, rollout_config("auto"), fresh_setup, "rollout")
        with started_group(ray_cluster, 1, *fresh_args, use_gpu=False, name_prefix="push_fresh") as fresh:
            fresh.init_model()
            want = greedy(fresh)
        pool_args = (ActorRolloutRefWorker, rollout_config("dummy"), setup, "rollout")
        with started_group(ray_cluster, 2, *pool_args, use_gpu=False, name_prefix="push_rollout") as pool:
            pool.init_model()
            before = greedy(pool)
            assert not torch.allclose(before[1], want[1], atol=1e-2)  # the pool starts from random weights
            yield trainer, pool, want


def weight_sync(groups, backend: str, **engine_kwargs) -> WeightSync:
    trainer, pool, _ = groups
    settings = CheckpointEngineSettings(backend, engine_kwargs)
    return WeightSync(ActorRolloutRefRole(trainer), RolloutRole(pool), settings, "cpu")


@pytest.mark.parametrize(
    ("backend", "same_node"),
    [("nccl", "shm"), ("nccl", "broadcast"), ("naive", None)],
    ids=["nccl-shared-memory-lane", "nccl-broadcast-lane", "naive"],
)
def test_a_push_makes_the_pool_generate_as_the_exported_checkpoint_does(groups, backend, same_node):
    """The pool's ranks share the trainer's node: the default lane has them view the sender's slots, the
    broadcast lane (what a rank of another node gets) sends them the bytes."""
    _, pool, want = groups
    sync = weight_sync(groups, backend, **({"nccl": {"same_node": same_node}} if same_node else {}))
    metrics = sync.push()
    assert sync.transport == backend
    assert_same(greedy(pool), want)
    assert metrics["perf/weight_push_bytes"] > 5e7  # hundreds of buckets
    assert (sync.channel is None) if backend == "naive" else (sync.channel.world_size == 3)


def test_a_rollout_rank_killed_mid_push_fails_the_push_naming_it(groups):
    """Last in this module: the pool loses a rank. The push runs in a thread; the rank dies once it is under way."""
    _, pool, _ = groups
    sync = weight_sync(groups, "nccl")
    start = time.monotonic()
    sync.push()  # the group exists: the next push starts broadcasting at once
    undisturbed = time.monotonic() - start
    victim = pool.worker_infos[1]["pid"]
    outcome: dict = {}

    def run() -> None:
        start = time.monotonic()
        try:
            sync.push()
        except BaseException as error:
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - start

    pusher = threading.Thread(target=run)
    pusher.start()
    time.sleep(0.2)
    os.kill(int(victim), signal.SIGKILL)
    pusher.join(timeout=240)
    assert not pusher.is_alive(), "the push hung on a dead rollout rank"
    print(f"the push ran {outcome['seconds']:.2f} s; an undisturbed push took {undisturbed:.2f} s")
    error = outcome.get("error")
    assert isinstance(error, WorkerDiedError), repr(error)
    assert (error.role, error.rank) == (pool.name, 1), str(error)
    assert outcome["seconds"] < 120
