"""GRPO with LoRA through the real CLI (the first test) and in-process runs of it (fsdp, deepspeed and megatron;
vLLM with the adapter-only sync, colocated and split placement; the hf engine with the merged sync; KL loss): only
the adapters train, the reference log-probs are the actor's with its adapters disabled, the sync moves the adapter's
bytes alone, checkpoints hold the adapter and resume exactly, and the exports load (the PEFT adapter directory with
PEFT, the merged model with transformers)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.runs import COMPARED, metrics, run_in_process, run_subprocess

pytestmark = pytest.mark.slow

# a hash of the response text: samples of one prompt differ, so GRPO's advantages are not all 0
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 97 / 97
"""

LORA = [
    "rollout=vllm",
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one update per step: step 1's runs with B = 0
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "data.val_files=null",
    "trainer.plot_at_end=false",
    "trainer.save_merged=true",
]


def state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_grpo_with_lora_adapters(task, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, reward_file = tmp_path / "lora", tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    run_subprocess(task, run_dir, 2, [*LORA, f"custom_reward_function.path={reward_file}"])
    rows = metrics(run_dir)
    log = (run_dir / "run.log").read_text()  # the CLI's: every process's records, the workers' included
    assert "the actor's base model with its LoRA adapters disabled" in log

    # reference = the actor with adapters off: identical to the policy before the first update (B = 0) ...
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6
    assert rows[2]["actor/kl_loss"] > 1e-6  # ... and no longer after it
    # the vLLM engine serves the synced adapter: its log-probs are the trainer's
    assert rows[2]["rollout_corr/log_prob_abs_diff_mean"] < 1e-3

    hf, merged = run_dir / "hf", run_dir / "hf_merged"
    adapter = state(hf)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert rows[1]["perf/weight_sync_bytes"] == adapter_bytes == rows[2]["perf/weight_sync_bytes"]
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if ".lora_B." in k)  # trained

    base = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert adapter_bytes < full_bytes / 4
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    PeftModel.from_pretrained(base, str(hf))  # the adapter directory loads with PEFT
    merged_state = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).state_dict()
    changed = {k for k, v in merged_state.items() if not torch.equal(v, base_state[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)  # adapted Linears only


def test_grpo_with_lora_on_deepspeed_and_merged_sync_on_the_hf_engine(ray_cluster, task, tmp_path):
    """DeepSpeed ZeRO-3 trains the adapters; the hf rollout engine takes full weights only, so lora_sync falls back
    to merged (the base plus the adapters' update under the base model's names); the reference is still the actor
    with its adapters off."""
    from transformers import AutoModelForCausalLM

    run_dir, reward_file = tmp_path / "merged", tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    overrides = [o for o in LORA if not o.startswith(("rollout=", "trainer.save_merged"))]
    extra = ["backend=deepspeed", "rollout=hf", f"custom_reward_function.path={reward_file}"]
    run_in_process(task, run_dir, 2, [*extra, *overrides])
    rows = metrics(run_dir)
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6 and rows[2]["actor/kl_loss"] > 1e-6
    assert rows[2]["rollout_corr/log_prob_abs_diff_mean"] < 1e-3  # the engine got the merged, trained weights
    base = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert rows[1]["perf/weight_sync_bytes"] >= full_bytes  # every weight, not the adapter alone
    assert (run_dir / "hf" / "adapter_config.json").exists() and not (run_dir / "hf_merged").exists()


def test_grpo_with_lora_on_megatron_tp2_and_the_vllm_adapter_sync(ray_cluster, task, tmp_path):
    """Megatron TP=2 trains the adapters (backends/megatron/lora.py): the reference is the actor with its adapters
    off, vLLM serves the adapter the engine exports (its log-probs are the trainer's), the sync moves the adapter
    alone, and the run's exports load (the PEFT adapter directory with PEFT, the merged model with transformers)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, reward_file = tmp_path / "megatron", tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    megatron = ["backend=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    run_in_process(task, run_dir, 2, [*megatron, *LORA, f"custom_reward_function.path={reward_file}"])
    rows = metrics(run_dir)
    assert abs(rows[1]["actor/kl_loss"]) < 1e-6 and rows[2]["actor/kl_loss"] > 1e-6
    assert rows[2]["rollout_corr/log_prob_abs_diff_mean"] < 1e-3
    adapter = state(run_dir / "hf")
    assert rows[2]["perf/weight_sync_bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if ".lora_B." in k)  # trained
    base = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    PeftModel.from_pretrained(base, str(run_dir / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf_merged"), dtype=torch.float32).state_dict()
    changed = {k for k, v in merged.items() if not torch.equal(v, base_state[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)


def test_lora_on_split_placement_pushes_the_adapter_and_resumes_exactly(ray_cluster, task, tmp_path, caplog):
    """Split placement (one train rank, one rollout rank): the adapter alone goes over the push group (gloo) to the
    rollout pool's vLLM engine, which serves it; the checkpoint holds the adapter and its optimizer state, not the
    frozen base, and a run resumed from step 1 trains step 2 as the uninterrupted run did."""
    run_dir, reward_file = tmp_path / "split", tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    overrides = [
        *[o for o in LORA if not o.startswith(("trainer.save_freq", "trainer.save_merged"))],
        "actor_rollout_ref.hybrid_engine=false",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.save_freq=1",
        f"custom_reward_function.path={reward_file}",
    ]
    run_in_process(task, run_dir, 2, overrides)
    reference, adapter = metrics(run_dir), state(run_dir / "hf")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    for step in (1, 2):
        assert reference[step]["perf/weight_push_bytes"] == adapter_bytes  # the adapter alone, every push
    assert reference[2]["rollout_corr/log_prob_abs_diff_mean"] < 1e-3  # the rollout pool serves the trained adapter

    base_bytes = sum(f.stat().st_size for f in Path(task["model"]).glob("*.safetensors"))
    checkpoint_bytes = sum(f.stat().st_size for f in (run_dir / "global_step_1" / "actor").rglob("*") if f.is_file())
    assert checkpoint_bytes < base_bytes / 2, (checkpoint_bytes, base_bytes)  # adapter + its Adam state

    shutil.rmtree(run_dir / "global_step_2")  # resume from step 1's checkpoint
    (run_dir / "latest_checkpointed_iteration.txt").write_text("1")
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, run_dir, 2, overrides)
    assert f"resumed from {run_dir / 'global_step_1'}" in caplog.text
    resumed = metrics(run_dir)
    for key in COMPARED:
        assert resumed[2][key] == pytest.approx(reference[2][key], rel=1e-6, abs=1e-7), key
    for name, tensor in state(run_dir / "hf").items():
        torch.testing.assert_close(tensor, adapter[name], rtol=1e-6, atol=1e-7)
