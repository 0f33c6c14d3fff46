"""The PPO trainer on the Megatron backend end to end (an in-process run of the CLI's): GAE with a critic, both
roles on pipeline parallelism (2 stages over the 2 ranks: every rank of a stage pair shares DP rank 0), vLLM
rollout fed from the Megatron engine's exported weights, checkpoints and the final HF checkpoint, with megatron's
offload keys on (the engine-level checks of offload: tests/backends/test_megatron_engine.py)."""

import json
from pathlib import Path

import pytest

from tests.trainer.runs import metrics, run_in_process

pytestmark = pytest.mark.slow


def test_gae_on_megatron_pp2_with_vllm(ray_cluster, task, tmp_path):
    pytest.importorskip("vllm")
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    megatron = [
        "backend=megatron",
        "rollout=vllm",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",  # the critic follows the actor's layout
        "trainer.save_freq=2",
        # every state off the device between the calls that use it (backends/megatron/offload.py), and the actor's
        # while vLLM generates: the steps, the weight sync and the checkpoints must still work with it
        "actor_rollout_ref.actor.megatron.param_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true",
        "actor_rollout_ref.actor.megatron.grad_offload=true",
        "critic.megatron.grad_offload=true",
        "actor_rollout_ref.rollout.offload_train_during_rollout=true",
    ]
    run_in_process(task, run, 2, megatron)  # the resume test's run, on megatron
    rows = metrics(run)
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        for key in ("actor/grad_norm", "critic/grad_norm", "actor/entropy"):
            assert key in rows[step] and rows[step][key] == rows[step][key], (step, key, rows[step].get(key))
    assert (run / "global_step_2").is_dir()
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    trained = load_file(str(run / "hf" / "model.safetensors"))
    initial = load_file(str(Path(task["model"]) / "model.safetensors"))
    assert sorted(trained) == sorted(k for k in initial if k != "lm_head.weight" or not config["tie_word_embeddings"])
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "the actor did not train"
