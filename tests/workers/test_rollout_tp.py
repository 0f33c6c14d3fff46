"""Rollout tensor parallelism through the trainer's worker: one vLLM engine sharded over 2 trainer ranks (real Ray,
gloo, vLLM's external launcher on CPU), with the actor on fsdp (2 DP ranks) and on megatron (TP=2).

After an update and a weight sync the TP=2 engine samples with log-probs the trainer reproduces, its greedy
generation equals a TP=1 engine's on the exported weights, and each rank received its own shard only (checked
against byte counts worked out here from the tensors' shapes).
"""

from dataclasses import replace

import pytest
import torch

from backends.config import ModelConfig, OptimConfig
from backends.rollout.base import RolloutConfig, SamplingConfig, get_rollout
from scaletrain.algos import get_adv_estimator
from scaletrain.workers import (
    ActorConfig,
    ActorRolloutRefConfig,
    ActorRolloutRefWorker,
    EngineSetup,
    RolloutWorkerConfig,
)
from scaletrain.workers.model_sections import MegatronConfig
from tests.backends.tiny import make_tokenizer, save_tiny_qwen2
from tests.controller.workers import started_group
from tests.workers.test_role_workers import PLEN, prompt_batch

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

N, RESP, TP = 2, 6, 2


def expected_shard_bytes(weights: dict[str, torch.Tensor], rank: int) -> int:
    """What rollout TP rank ``rank`` of 2 should receive: half of each q/k/v/o/gate/up/down tensor (4 heads, 2 KV
    heads), the embedding's rows of vLLM's padded split (99 rows padded to 128: 64 and 35), the rest whole."""
    total = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            total += nbytes // 2
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            total += (64 if rank == 0 else t.shape[0] - 64) * t.shape[1] * t.element_size()
        else:
            total += nbytes
    return total


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_rollout_tp2_through_the_worker(ray_cluster, tmp_path, backend):
    path = save_tiny_qwen2(
        str(tmp_path / "model"),
        seed=5,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=4,
        optim=OptimConfig(lr=5e-3),
        megatron=MegatronConfig(tensor_model_parallel_size=2 if backend == "megatron" else None),
    )
    config = ActorRolloutRefConfig(
        actor=actor,
        rollout=RolloutWorkerConfig(
            name="vllm",
            n=N,
            response_length=RESP,
            prompt_length=PLEN,
            tensor_model_parallel_size=TP,
            load_format="dummy",
        ),
    )
    setup = EngineSetup(model=ModelConfig(path=path), backend=backend)
    with started_group(
        ray_cluster,
        2,
        ActorRolloutRefWorker,
        config,
        setup,
        "actor_rollout",
        use_gpu=False,
        name_prefix=f"rollout_tp_{backend}",
    ) as wg:
        wg.init_model()
        prompts = prompt_batch()
        out = wg.generate_sequences(
            prompts, config.rollout.train_sampling(seed=3)
        )  # one engine, so one copy of each sample comes back
        assert len(out) == len(prompts) * N
        mask = out.batch["response_mask"].float()
        lp = wg.compute_log_prob(out)  # dummy weights were replaced by the actor's, shard by shard
        assert torch.allclose(lp.batch["old_log_probs"] * mask, out.batch["rollout_log_probs"] * mask, atol=2e-4)

        scores = torch.zeros_like(mask)
        scores[torch.arange(len(out)), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0, 0.5, 0, 1, 1, 0, 0.2])
        batch = out.union(lp)
        batch.batch["advantages"], _ = get_adv_estimator("grpo")(scores, mask, index=out.non_tensor_batch["uid"])
        wg.update_actor(batch)
        wg.sync_rollout_weights()
        wg.save_hf(str(tmp_path / "hf"))

        greedy = wg.generate_sequences(prompts, replace(config.rollout.train_sampling(seed=4), temperature=0.0))
        greedy.meta_info["temperature"] = 1.0  # greedy log-probs are of the raw logits
        greedy_lp = wg.compute_log_prob(greedy).batch["old_log_probs"]
        status = wg.rollout_status()

    from safetensors.torch import load_file

    trained = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for rank, s in enumerate(status):
        assert s["last_update_bytes"] == expected_shard_bytes(trained, rank), (rank, s)
    # TP=1 reference on the exported weights: the same greedy tokens (fp32; HF generate stands for TP=1 here and
    # agrees with vLLM's TP=1 engine, tests/backends/rollout/test_rollout_vllm.py)
    reference = get_rollout("hf")(RolloutConfig(model_path=str(tmp_path / "hf")), make_tokenizer())
    ref = reference.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=RESP))
    assert torch.equal(greedy.batch["responses"][::N], ref.batch["responses"])
    gmask = greedy.batch["response_mask"].float()
    assert torch.allclose(greedy_lp * gmask, greedy.batch["rollout_log_probs"] * gmask, atol=2e-4)
