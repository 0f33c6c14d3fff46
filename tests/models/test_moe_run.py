"""Two GRPO steps of a tiny Qwen3-MoE (``python -m scaletrain.models.prepare tiny-qwen3-moe``: the embedded model's
shape, 4 experts, top-2, in every layer) on fsdp, on deepspeed and on megatron with expert parallelism (EP=2, 2
experts per rank), with the vLLM rollout colocated, in-process runs of the CLI: the router losses join the actor
loss by their keys (megatron's own join its gradient only), the router metrics are logged each step, the vLLM
engine serves the synced experts (its log-probs after step 1's update are the trainer's), and the HF export holds
the checkpoint layout (per-expert tensors) and loads with transformers, as does the model merger's conversion of
the run's checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.model_merger.merge import merge
from tests.trainer.runs import metrics, run_in_process
from tests.trainer.test_lora_run import state

pytestmark = pytest.mark.slow

AUX, Z = 0.01, 0.001
# a hash of the response text: samples of one prompt differ, so GRPO's advantages (and the update) are not all 0
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""


@pytest.fixture(scope="module")
def moe_task(task, tmp_path_factory) -> dict:
    from scaletrain.models.prepare import prepare_model

    model = prepare_model("tiny-qwen3-moe", output=tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")
    return {**task, "model": model}


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed", "megatron"])
def test_two_grpo_steps_of_a_tiny_qwen3_moe_with_vllm(backend, moe_task, ray_cluster, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    pytest.importorskip("vllm")
    if backend != "fsdp":
        pytest.importorskip("megatron.core" if backend == "megatron" else backend)
    run_dir, reward_file = tmp_path / "run", tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    megatron = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"] if backend == "megatron" else []
    extra = [
        *megatron,
        "rollout=vllm",
        f"backend={backend}",
        f"actor_rollout_ref.model.router_aux_loss_coef={AUX}",
        f"actor_rollout_ref.model.router_z_loss_coef={Z}",
        f"custom_reward_function.path={reward_file}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "data.val_files=null",
        "trainer.plot_at_end=false",
    ]
    run_in_process(moe_task, run_dir, 2, extra)
    rows = metrics(run_dir)
    for step in (1, 2):
        row = rows[step]
        assert 1.0 <= row["actor/router_load_imbalance"] <= 2.0, row  # 4 experts, top-2
        assert row["actor/router_aux_loss"] > 0 and row["actor/router_z_loss"] > 0, row
        if backend != "megatron":  # megatron adds its router losses to the gradient, not to the reported loss
            # the actor's loss is the policy loss plus the router losses at their coefficients
            expected = row["actor/pg_loss"] + AUX * row["actor/router_aux_loss"] + Z * row["actor/router_z_loss"]
            assert row["actor/loss"] == pytest.approx(expected, abs=1e-6), row
    assert rows[1]["actor/grad_norm"] > 0
    # step 2's rollout ran on step 1's weights, pushed into vLLM: its log-probs are the trainer's
    assert rows[2]["rollout_corr/log_prob_abs_diff_max"] <= 1e-4, rows[2]

    hf = run_dir / "hf"
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names, names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    start = AutoModelForCausalLM.from_pretrained(moe_task["model"], dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert type(trained).__name__ == "Qwen3MoeForCausalLM"
    moved = trained.model.layers[0].mlp.experts.gate_up_proj - start.model.layers[0].mlp.experts.gate_up_proj
    assert moved.abs().max() > 0  # the experts trained, and the export carries them

    # the model merger converts the run's last checkpoint into the same files, per expert too
    merged = merge(str(run_dir / "global_step_2" / "actor"), str(tmp_path / "merged"))
    assert state(Path(merged)).keys() == state(hf).keys()
    assert all(torch.equal(state(Path(merged))[k], v) for k, v in state(hf).items())
