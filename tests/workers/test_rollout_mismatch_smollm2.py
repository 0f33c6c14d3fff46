"""Train / inference mismatch on the real SmolLM2-135M-Instruct: vLLM rollout vs the FSDP actor, through the role
worker and ``apply_rollout_correction`` the trainer calls each step.

Generate (vLLM), recompute log-probs (FSDP), one actor update with token-level IS weights in the batch, sync the
weights to vLLM, generate again: after the sync the two sides must agree closely (the figures are printed; see
README "Rollout correction") while the update itself moved the log-probs far more than that.
"""

import numpy as np
import pytest
import torch

from backends.config import ModelConfig, OptimConfig
from backends.rollout.base import SamplingConfig
from scaletrain.algos import get_adv_estimator
from scaletrain.protocol import DataProto
from scaletrain.trainer.config.ppo_config import RolloutCorrectionConfig
from scaletrain.trainer.step.rollout_correction import apply_rollout_correction
from scaletrain.workers import (
    ActorConfig,
    ActorRolloutRefConfig,
    ActorRolloutRefWorker,
    EngineSetup,
    RolloutWorkerConfig,
    reduce_metrics,
)
from tests.controller.workers import started_group

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 7 times 8?", "Name a primary colour.", "Say hello in French.", "What is the capital of Italy?"]
N, RESP = 2, 16
CORRECTION = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)


def chat_prompts(tokenizer) -> DataProto:
    """The questions in SmolLM2's chat template, left-padded, with positions and one uid per prompt."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    uids = np.array([f"q{i}" for i in range(len(rows))], dtype=object)
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"uid": uids},
    )


def rollout_and_log_probs(wg, prompts: DataProto, sampling: SamplingConfig) -> DataProto:
    out = wg.generate_sequences(prompts, sampling)
    out.meta_info["temperature"] = 1.0
    return out.union(wg.compute_log_prob(out).select(batch_keys=["old_log_probs"]))


def figures(m: dict) -> str:
    keys = ("log_prob_abs_diff_mean", "log_prob_abs_diff_max", "kl_k1", "kl_k3", "is_ratio_min", "is_ratio_max")
    return ", ".join(f"{k}={m[f'rollout_corr/{k}']:.7g}" for k in keys)


def assert_close_agreement(m: dict) -> None:
    """fp32 on both sides (measured on CPU: mean 1.7e-5, max 5.8e-5, KL k3 4e-9); bounds ~10x above that."""
    assert m["rollout_corr/log_prob_abs_diff_mean"] < 2e-4, m
    assert m["rollout_corr/log_prob_abs_diff_max"] < 1e-3, m
    assert m["rollout_corr/kl_k3"] < 1e-7 and abs(m["rollout_corr/kl_k1"]) < 2e-4, m


def test_vllm_fsdp_mismatch_is_small_after_update_and_sync(ray_cluster, smollm2_dir):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_dir))
    config = ActorRolloutRefConfig(
        actor=ActorConfig(
            ppo_mini_batch_size=len(QUESTIONS),
            ppo_micro_batch_size_per_gpu=len(QUESTIONS) * N,
            optim=OptimConfig(lr=2e-5, grad_clip=1.0),
        ),
        rollout=RolloutWorkerConfig(
            name="vllm", n=N, response_length=RESP, prompt_length=prompts.batch["input_ids"].shape[1]
        ),
    )
    setup = EngineSetup(model=ModelConfig(path=smollm2_dir), backend="fsdp")
    with started_group(
        ray_cluster,
        1,
        ActorRolloutRefWorker,
        config,
        setup,
        "actor_rollout",
        use_gpu=False,
        name_prefix="smollm2_mismatch",
    ) as wg:
        wg.init_model()
        batch = rollout_and_log_probs(wg, prompts, config.rollout.train_sampling(seed=1))
        before = apply_rollout_correction(batch, CORRECTION)
        print(f"\nSmolLM2 vLLM vs FSDP before the update: {figures(before)}")
        assert_close_agreement(before)

        # one PPO update: GRPO advantages of made-up scores, the IS weights in the batch
        mask = batch.batch["response_mask"].float()
        scores = torch.zeros_like(mask)
        last = mask.sum(-1).long() - 1
        scores[torch.arange(len(batch)), last] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0])
        batch.batch["advantages"], _ = get_adv_estimator("grpo")(scores, mask, index=batch.non_tensor_batch["uid"])
        assert "rollout_is_weights" in batch.batch.keys()
        metrics = reduce_metrics(wg.update_actor(batch))
        assert np.isfinite(metrics["actor/pg_loss"])
        moved = (wg.compute_log_prob(batch).batch["old_log_probs"] - batch.batch["old_log_probs"]).abs()
        moved = float((moved * mask).sum() / mask.sum())

        wg.sync_rollout_weights()
        after_batch = rollout_and_log_probs(wg, prompts, config.rollout.train_sampling(seed=2))
        after = apply_rollout_correction(after_batch, CORRECTION)
        print(f"SmolLM2 vLLM vs FSDP after update + sync: {figures(after)}; the update moved log-probs by {moved:.3g}")
        # the sync reached vLLM: the mismatch is tiny next to what the update changed
        assert_close_agreement(after)
        assert moved > 100 * after["rollout_corr/log_prob_abs_diff_mean"], (moved, after)
        # where the sides agree, the IS weights are 1: exp(diff) untruncated, within 1e-3 of 1
        weights, valid = after_batch.batch["rollout_is_weights"], after_batch.batch["response_mask"].bool()
        diff = after_batch.batch["old_log_probs"] - after_batch.batch["rollout_log_probs"]
        torch.testing.assert_close(weights[valid], torch.exp(diff[valid]))
        assert after["rollout_corr/is_truncated_frac"] == 0 and (weights[valid] - 1).abs().max() < 1e-3

        # the trainer's own log-probs as the rollout's: weights exactly 1 and no mismatch at all
        own = after_batch.select(batch_keys=["old_log_probs", "response_mask"])
        own.batch["rollout_log_probs"] = own.batch["old_log_probs"].clone()
        exact = apply_rollout_correction(own, CORRECTION)
        assert torch.equal(own.batch["rollout_is_weights"], own.batch["response_mask"].float())
        assert exact["rollout_corr/log_prob_abs_diff_max"] == 0 and exact["rollout_corr/kl_k1"] == 0
