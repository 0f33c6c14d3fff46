"""verl command lines (trainer/config/verl_compat.py): strategy keys, ``+`` on known keys, unsupported verl keys
refused before anything starts, and the overrides of verl's GRPO example (Qwen3-8B, FSDP, vLLM, KL loss, 5
samples) running one step on the embedded default with only the model and data paths removed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.trainer.main_ppo import verl_overrides
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.runs import ROOT, env

# verl's examples/grpo_trainer/run_qwen3-8b.sh, its overrides less the model and data paths
VERL_GRPO_EXAMPLE = """
algorithm.adv_estimator=grpo data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen3_8b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
""".split()
# what verl's current examples/grpo_trainer scripts add to every run (the interpreter: Ray's default)
VERL_RAY_KEYS = ["ray_kwargs.ray_init.runtime_env.py_executable=null"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["actor_rollout_ref.actor.strategy=megatron", "x.y=1"],
            ["backend=megatron", "actor_rollout_ref.actor.strategy=megatron", "x.y=1"],
        ),
        (
            ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp", "backend=fsdp"],
            ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp", "backend=fsdp"],
        ),
        (
            ["+trainer.balance_batch=true", "+actor_rollout_ref.rollout.val_kwargs.do_sample=false", "+new.key=1"],
            # an entry of a free-form mapping is added or replaced (Hydra's ++), whether it exists or not
            ["trainer.balance_batch=true", "++actor_rollout_ref.rollout.val_kwargs.do_sample=false", "+new.key=1"],
        ),
        (
            [
                "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
                "+critic.optim.lr_warmup_steps=5",
                "actor_rollout_ref.actor.grad_clip=0.5",
            ],
            [
                "actor_rollout_ref.actor.optim.warmup_steps=0",
                "critic.optim.warmup_steps=5",
                "actor_rollout_ref.actor.optim.grad_clip=0.5",
            ],
        ),
        (  # megatron's router-loss coefficients in verl's TransformerConfig overrides -> the model's keys
            [
                "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
                "+critic.megatron.override_transformer_config.moe_z_loss_coeff=0.001",
            ],
            ["actor_rollout_ref.model.router_aux_loss_coef=0.01", "critic.model.router_z_loss_coef=0.001"],
        ),
        (
            [
                "trainer.use_legacy_worker_impl=auto",
                "actor_rollout_ref.actor.megatron.context_parallel_size=1",
                "actor_rollout_ref.model.use_fused_kernels=False",
            ],
            [],
        ),
        (  # the Ulysses size is a key of its own; verl's newer place for it (the FSDP engine config) is renamed
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2",
                "critic.model.fsdp_config.ulysses_sequence_parallel_size=2",
            ],
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                "critic.ulysses_sequence_parallel_size=2",
            ],
        ),
        (  # verl's newer sections and selectors: checkpoint_engine (megabytes), model_engine, reward.*, tool config
            [
                "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
                "model_engine=megatron",
                "reward.reward_model.model_path=/m",
                "reward.custom_reward_function.path=r.py",
                "actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml",
                "sandbox_fusion.url=http://h:1/run_code",
                "reward_model.sandbox_fusion.max_concurrent=8",
                "reward.sandbox_fusion.memory_limit_mb=512",
                "reward_model.num_workers=2",
                "--config-path=config",
            ],
            [
                "backend=megatron",
                "actor_rollout_ref.rollout.weight_bucket_bytes=4294967296",
                "reward_model.model.path=/m",
                "custom_reward_function.path=r.py",
                "actor_rollout_ref.rollout.multi_turn.tools_config_file=t.yaml",
                "reward.sandbox_fusion.url=http://h:1/run_code",
                "reward.sandbox_fusion.max_concurrent=8",
                "reward.sandbox_fusion.memory_limit_mb=512",
                "reward.num_workers=2",
            ],
        ),
    ],
)
def test_translation(argv, expected):
    assert verl_overrides(argv) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["actor_rollout_ref.actor.strategy=megatron", "backend=fsdp"], "backend=fsdp conflicts with"),
        (["actor_rollout_ref.actor.strategy=megatron", "critic.strategy=fsdp"], "select different backends"),
        (["actor_rollout_ref.actor.strategy=jax"], "unknown strategy 'jax'"),
        (["actor_rollout_ref.actor.megatron.context_parallel_size=2"], "context parallelism is not implemented"),
        (["critic.megatron.context_parallel_size=4"], "use megatron.sequence_parallel=true"),
        (["algorithm.pf_ppo.weight_pow=2.0"], "policy-filtration PPO is not implemented"),
        (["reward.reward_kwargs.x=1"], "verl's reward.\\* keys taken here: .*reward.reward_manager.name"),
        (["actor_rollout_ref.model.use_fused_kernels=true"], "fused log-prob kernels are not implemented"),
        (["model_engine=veomni"], "unknown strategy 'veomni'"),
        (["--config-name=ppo_megatron_trainer", "backend=fsdp"], "backend=fsdp conflicts with --config-name"),
    ],
)
def test_unsupported_and_conflicting_keys_are_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        verl_overrides(argv)


def test_cli_refuses_before_starting():
    out = subprocess.run(
        [sys.executable, "-m", "scaletrain.trainer.main_ppo", "algorithm.use_pf_ppo=True"],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "algorithm.use_pf_ppo=True: not supported" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_verl_grpo_example_runs_one_step(ray_cluster, tmp_path, monkeypatch):
    """The example's keys as they are (with the Ray keys verl's current scripts always pass), then the sizes a 2-core
    machine and the embedded model (64 positions) can run (later overrides win); in this process, from the
    example's working directory, as verl's layout of outputs is relative to it."""
    from scaletrain.trainer.main_ppo import run

    scale = [
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "data.max_prompt_length=8",
        "data.max_response_length=5",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.plot_at_end=false",
        "trainer.balance_batch=True",  # verl's seq-balance examples add this
        'trainer.logger=["console","wandb","jsonl"]',
    ]  # jsonl too, to read the step's metrics here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run([*VERL_GRPO_EXAMPLE, *VERL_RAY_KEYS, *scale])
    run_dir = Path(tmp_path, "checkpoints", "verl_grpo_example_gsm8k", "qwen3_8b_function_rm")  # verl's layout
    assert list(run_dir.glob("wandb/offline-run-*")), "the example's wandb logger ran (offline)"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = [row for row in rows if row["step"] == 1][0]
    assert step["actor/kl_loss"] >= 0 and "rollout_corr/log_prob_abs_diff_mean" in step
    assert step["training/seq_balance/imbalance_after"] <= step["training/seq_balance/imbalance_before"]


def _porting_rows() -> list[tuple[str, str]]:
    """(override, status) of each row of docs/porting.md's table of verl's example keys."""
    text = (ROOT / "docs" / "porting.md").read_text()
    table = text[text.index("<!-- verl-example-keys:start -->") : text.index("<!-- verl-example-keys:end -->")]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    return [(cells[0].removeprefix("| `").removesuffix("`"), cells[2]) for cells in rows]


@pytest.mark.parametrize("override, status", _porting_rows(), ids=[row[0].split("=")[0] for row in _porting_rows()])
def test_every_key_of_verls_examples_has_the_status_this_page_gives(override, status):
    """docs/porting.md's claim, row by row: a refused key fails before anything starts naming itself and what to use
    instead; any other key (as in verl, renamed, accepted and dropped, a backend selector) composes into a config
    that loads."""
    from scaletrain.trainer.config.ppo_config import load_ppo_config
    from scaletrain.utils.hydra_compose import compose_config

    key = override.split("=", 1)[0]
    if status.startswith("refused: "):
        with pytest.raises(ConfigError, match=re.escape(key)) as refused:
            verl_overrides([override])
        assert status.removeprefix("refused: ").rstrip(" |") in str(refused.value)
        return
    hydra_args = verl_overrides([override])
    load_ppo_config(compose_config("ppo_trainer", [a for a in hydra_args if not a.startswith("--config")]))
    if status.startswith("renamed: "):
        target = status.removeprefix("renamed: `").split("`")[0]
        assert any(a.startswith(f"{target}=") for a in hydra_args), hydra_args
    elif status.startswith("accepted"):
        assert not any(a.startswith(f"{key}=") for a in hydra_args), hydra_args
