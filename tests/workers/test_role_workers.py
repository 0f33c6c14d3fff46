"""Role workers on real Ray + torch.distributed (gloo, 2 ranks, FSDP2): rollout, log-probs, PPO updates.

One PPO update of the actor and of the critic through the worker groups (2 ranks, 2 micro-batches each, unequal
response lengths) must equal a single-process step on the whole batch (loss_agg_mode token-mean, same optimizer);
the actor's log-probs must equal the rollout engine's on the same weights, before and after a weight sync.
"""

import asyncio

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from backends.config import ModelConfig, OptimConfig
from scaletrain.algos import get_adv_estimator
from scaletrain.protocol import DataProto
from scaletrain.workers import (
    ActorConfig,
    ActorRolloutRefConfig,
    ActorRolloutRefWorker,
    CriticConfig,
    CriticWorker,
    EngineSetup,
    RolloutWorkerConfig,
    reduce_metrics,
)
from scaletrain.workers.losses import actor_loss_fn, critic_loss_fn
from tests.backends.tiny import make_batch, make_tokenizer, save_tiny_qwen2, tiny_qwen2_config
from tests.controller.workers import started_group

pytestmark = pytest.mark.slow

PROMPTS = ["12+34=", "7*8=", "hello ", "abc"]
N, RESP, PLEN = 2, 6, 8


def prompt_batch() -> DataProto:
    tok = make_tokenizer()
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    input_ids = torch.full((len(ids), PLEN), tok.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(ids):
        input_ids[i, PLEN - len(row) :] = torch.tensor(row)
        mask[i, PLEN - len(row) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    uids = np.array([f"p{i}" for i in range(len(ids))], dtype=object)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": pos}, {"uid": uids})


def response_log_probs(model, batch: DataProto) -> torch.Tensor:
    resp = batch.batch["responses"]
    logits = model(
        input_ids=batch.batch["input_ids"],
        attention_mask=batch.batch["attention_mask"],
        position_ids=batch.batch["position_ids"],
    ).logits
    logits = logits[:, -resp.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)


def reference_step(model, batch, loss_fn, outputs_fn, optim: OptimConfig):
    """One optimizer step on the whole batch in one process, with its metrics and ``loss``: what 2 FSDP ranks with
    any micro-batch split must take (the loss is the whole mini-batch's loss_agg_mode aggregate)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    loss, metrics = loss_fn(outputs_fn(model, batch), batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
    opt.step()
    return {**metrics, "loss": float(loss.detach())}


def hf_weights(path: str, cls=AutoModelForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in cls.from_pretrained(path).state_dict().items()}


def check_concurrent_requests(wg, model) -> None:
    """Agent-loop requests sent one by one to both ranks' async engines at once (``generate_request``) sample from
    the trained weights: their log-probs equal the reference model's on the same tokens."""
    from backends.rollout.base import SamplingConfig, TokenRequest
    from scaletrain.workers.roles import ActorRolloutRefRole

    tok, role = make_tokenizer(), ActorRolloutRefRole(wg)
    requests = [
        (rank, TokenRequest(tok(p, add_special_tokens=False)["input_ids"], SamplingConfig(max_new_tokens=RESP, seed=i)))
        for i, p in enumerate(PROMPTS * 3)
        for rank in (0, 1)
    ]

    async def run_all():
        return await asyncio.gather(*(role.generate_request(rank, request) for rank, request in requests))

    outputs = asyncio.run(run_all())
    for (_, request), out in zip(requests, outputs):
        ids = torch.tensor([request.prompt_ids + out.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(request.prompt_ids) :, None]).squeeze(-1)
        assert out.token_ids and torch.allclose(torch.tensor(out.log_probs), want, atol=1e-4)


@pytest.mark.parametrize("rollout_name", ["hf", "vllm", "vllm_async"])
def test_actor_rollout_ref_ppo_update_matches_reference(ray_cluster, tmp_path, rollout_name):
    """vllm_async: vLLM's AsyncLLM in each worker (the agent loops' engine, rollout.async_engine)."""
    if rollout_name.startswith("vllm"):
        pytest.importorskip("vllm")
    # head_dim 32: the smallest vLLM's CPU attention kernels take
    path = save_tiny_qwen2(str(tmp_path / "model"), seed=3, num_attention_heads=2, num_key_value_heads=1)
    # a large eps keeps Adam smooth in near-zero gradients, whose float noise would otherwise move them by ~lr
    optim = OptimConfig(lr=5e-3, grad_clip=1.0, eps=1e-3)
    config = ActorRolloutRefConfig(
        actor=ActorConfig(
            ppo_mini_batch_size=len(PROMPTS),
            ppo_micro_batch_size_per_gpu=2,
            optim=optim,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
        ),
        # the engine starts from random weights (load_format=dummy): the actor's are pushed before any generation
        rollout=RolloutWorkerConfig(
            name=rollout_name.removesuffix("_async"),
            mode="async" if rollout_name == "vllm_async" else "sync",
            n=N,
            response_length=RESP,
            prompt_length=PLEN,
            load_format="dummy",
        ),
    )
    setup = EngineSetup(model=ModelConfig(path=path), backend="fsdp")
    with started_group(
        ray_cluster,
        2,
        ActorRolloutRefWorker,
        config,
        setup,
        "actor_rollout_ref",
        use_gpu=False,
        name_prefix="actor_rollout_ref",
    ) as wg:
        wg.init_model()
        prompts = prompt_batch()
        out = wg.generate_sequences(prompts, config.rollout.train_sampling(seed=7))
        assert len(out) == len(PROMPTS) * N and out.batch["responses"].shape == (len(PROMPTS) * N, RESP)
        assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(N)]
        mask = out.batch["response_mask"].float()

        # the actor's log-probs equal the rollout engine's on the same weights (fp32, temperature 1)
        lp = wg.compute_log_prob(out)
        assert torch.allclose(lp.batch["old_log_probs"] * mask, out.batch["rollout_log_probs"] * mask, atol=2e-4)
        ref = wg.compute_ref_log_prob(out)
        assert torch.allclose(ref.batch["ref_log_prob"], lp.batch["old_log_probs"], atol=1e-6)

        # one PPO update with GRPO advantages on random scores
        scores = torch.zeros_like(mask)
        last = mask.sum(-1).long() - 1
        scores[torch.arange(len(out)), last] = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2])
        adv, _ = get_adv_estimator("grpo")(scores, mask, index=out.non_tensor_batch["uid"])
        batch = out.union(lp).union(ref)
        batch.batch["advantages"] = adv
        # perturb old log-probs so the ratio (and clipping) is exercised
        batch.batch["old_log_probs"] = batch.batch["old_log_probs"] + 0.05 * torch.randn_like(mask) * mask
        metrics = reduce_metrics(wg.update_actor(batch))

        model = AutoModelForCausalLM.from_pretrained(path)

        def outputs(m, mb):
            lps = response_log_probs(m, mb)
            logits = (
                m(
                    input_ids=mb.batch["input_ids"],
                    attention_mask=mb.batch["attention_mask"],
                    position_ids=mb.batch["position_ids"],
                )
                .logits[:, -RESP - 1 : -1]
                .float()
            )
            ent = torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)
            return {"log_probs": lps, "entropy": ent}

        expected = reference_step(model, batch, actor_loss_fn(config.actor), outputs, optim)
        expected["actor/loss"] = expected.pop("loss")
        for key in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
        wg.save_hf(str(tmp_path / "hf"))
        trained = hf_weights(str(tmp_path / "hf"))
        for name, value in model.state_dict().items():
            assert torch.allclose(trained[name], value, atol=1e-5), name
        assert not torch.allclose(trained["model.embed_tokens.weight"], hf_weights(path)["model.embed_tokens.weight"])

        # weight sync: after the update the rollout engine samples from the trained weights
        wg.sync_rollout_weights()
        out2 = wg.generate_sequences(prompts, config.rollout.train_sampling(seed=8))
        if rollout_name == "vllm_async":
            check_concurrent_requests(wg, model)
        lp2 = wg.compute_log_prob(out2)
        mask2 = out2.batch["response_mask"].float()
        assert torch.allclose(lp2.batch["old_log_probs"] * mask2, out2.batch["rollout_log_probs"] * mask2, atol=2e-4)
        with torch.no_grad():
            reference_lp = response_log_probs(model, out2)
        assert torch.allclose(lp2.batch["old_log_probs"] * mask2, reference_lp * mask2, atol=1e-4)

        # the engine slept for training and woke for generation, weights before KV cache, in the worker's order:
        # init (sleep), generate, log-probs (sleep), ..., sync (weights, update, KV cache), generate, log-probs
        wake = ["wake_weights", "wake_kv_cache"]
        for rank in wg.rollout_status():
            assert (rank["state"], rank["history"]) == ("sleeping", ["sleep"] + wake + ["sleep"] + wake + ["sleep"])


def test_critic_update_matches_reference(ray_cluster, tmp_path):
    torch.manual_seed(0)
    value_model = AutoModelForTokenClassification.from_config(tiny_qwen2_config(num_labels=1))
    path = str(tmp_path / "critic")
    value_model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-3)
    config = CriticConfig(
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1, cliprange_value=0.2, optim=optim
    )
    setup = EngineSetup(model=ModelConfig(path=path, kind="value"), rollout_n=2)
    batch = make_batch(batch_size=8, prompt_len=PLEN, response_len=RESP, seed=5)
    with started_group(ray_cluster, 2, CriticWorker, config, setup, use_gpu=False, name_prefix="critic") as wg:
        wg.init_model()
        values = wg.compute_values(batch).batch["values"]
        model = AutoModelForTokenClassification.from_pretrained(path)

        def outputs(m, mb):
            logits = m(
                input_ids=mb.batch["input_ids"],
                attention_mask=mb.batch["attention_mask"],
                position_ids=mb.batch["position_ids"],
            ).logits
            return {"values": logits[:, -RESP - 1 : -1, 0].float()}

        with torch.no_grad():
            expected_values = outputs(model, batch)["values"]
        mask = batch.batch["response_mask"].float()
        assert torch.allclose(values * mask, expected_values * mask, atol=1e-5)
        batch.batch["values"] = values
        batch.batch["returns"] = values + torch.randn_like(values) * mask
        metrics = reduce_metrics(wg.update_critic(batch))
        expected = reference_step(model, batch, critic_loss_fn(config), outputs, optim)
        assert metrics["critic/vf_loss"] == pytest.approx(expected["critic/vf_loss"], rel=1e-4)
        assert metrics["critic/loss"] == pytest.approx(expected["loss"], rel=1e-4)
        assert metrics["critic/vf_clipfrac"] == pytest.approx(expected["critic/vf_clipfrac"], abs=1e-6)
        after = wg.compute_values(batch).batch["values"]
        with torch.no_grad():
            assert torch.allclose(after * mask, outputs(model, batch)["values"] * mask, atol=1e-5)


def test_reward_model_scores_at_last_response_token(ray_cluster, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from scaletrain.workers import EngineSetup, RewardModelConfig, RewardModelWorker

    torch.manual_seed(1)
    path = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_config(tiny_qwen2_config(num_labels=1)).save_pretrained(path)
    batch = make_batch(batch_size=6, prompt_len=PLEN, response_len=RESP, seed=9)
    config, setup = RewardModelConfig(micro_batch_size_per_gpu=2), EngineSetup(ModelConfig(path=path, kind="reward"))
    with started_group(ray_cluster, 2, RewardModelWorker, config, setup, use_gpu=False, name_prefix="rm") as wg:
        wg.init_model()
        scores = wg.compute_rm_score(batch).batch["rm_scores"]
    model = AutoModelForSequenceClassification.from_pretrained(path)
    mask = batch.batch["response_mask"]
    last = mask.sum(-1) - 1
    with torch.no_grad():
        for i in range(len(batch)):  # reference: one unpadded sequence at a time, score at its last token
            valid = batch.batch["attention_mask"][i].bool()
            ids = batch.batch["input_ids"][i][valid][None]
            expected = model(input_ids=ids).logits[0, 0].item()
            assert scores[i, last[i]].item() == pytest.approx(expected, abs=1e-4)
            assert scores[i].abs().sum().item() == pytest.approx(abs(expected), abs=1e-4)  # nowhere else
