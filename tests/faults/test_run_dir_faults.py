"""One run, one directory: resume_mode=auto resumes only a run with the same result-determining settings (else
fails naming the keys), a fresh start moves an earlier run's outputs aside instead of mixing with them, and keep-N
pruning cannot reach them. The CLI runs of the same faults are in test_run_faults.py."""

import dataclasses
import json

import pytest

from scaletrain.trainer.config.plan import resolve_config
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.run.checkpoint import CheckpointManager
from scaletrain.trainer.run.run_identity import RUN_CONFIG, claim_run_dir, fingerprint, result_keys, result_settings
from scaletrain.utils.typed_config import ConfigError, execution_only, leaf_fields
from tests.trainer.config.test_ppo_config import composed


def config(run_dir, *overrides):
    from scaletrain.trainer.config.ppo_config import load_ppo_config

    return resolve_config(load_ppo_config(composed(f"trainer.default_local_dir={run_dir}", *overrides)))


def save(run_dir, step):
    CheckpointManager(str(run_dir), max_to_keep=2).save(step, lambda path: None, {"dataloader": {}})


def test_auto_resume_refuses_another_runs_directory_naming_the_keys(tmp_path):
    claim_run_dir(config(tmp_path, "actor_rollout_ref.actor.optim.lr=1e-5"))
    stored = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert stored["settings"]["actor_rollout_ref.actor.optim.lr"] == 1e-5
    assert stored["fingerprint"] == fingerprint(stored["settings"])
    save(tmp_path, 1)
    # the same run, extended and with other micro-batches / timeouts: resumes
    claim_run_dir(
        config(
            tmp_path,
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "trainer.total_training_steps=99",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "trainer.worker_call_timeout_s=60",
        )
    )
    with pytest.raises(ConfigError) as info:
        claim_run_dir(config(tmp_path, "actor_rollout_ref.actor.optim.lr=3e-5", "trainer.seed=7"))
    msg = str(info.value)
    assert f"{tmp_path} holds a run with other settings" in msg
    assert "actor_rollout_ref.actor.optim.lr: 1e-05 there, 3e-05 now" in msg and "trainer.seed: 1 there, 7 now" in msg
    assert "trainer.experiment_name" in msg
    assert CheckpointManager(str(tmp_path)).latest() == str(tmp_path / "global_step_1")  # nothing touched


def test_another_layout_resumes_where_the_backends_reshard_and_is_refused_elsewhere(tmp_path, caplog):
    """The built-in backends reshard a checkpoint (tests/trainer/test_layout_resume.py runs it): the number of
    training ranks, megatron's sizes and the backend may change on resume, logged; a backend registered without
    that trait, and LoRA adapters anywhere but on fsdp, are refused before Ray, naming the keys."""
    from backends.base import BACKEND_TRAITS, BackendTraits

    fsdp, deepspeed, lora = tmp_path / "fsdp", tmp_path / "deepspeed", tmp_path / "lora"
    lora_run = ("backend=deepspeed", "actor_rollout_ref.model.lora_rank=4")
    for run_dir, overrides in ((fsdp, ("backend=fsdp",)), (deepspeed, ("backend=deepspeed",)), (lora, lora_run)):
        claim_run_dir(config(run_dir, *overrides))
        save(run_dir, 1)
    claim_run_dir(config(fsdp, "backend=fsdp", "trainer.n_gpus_per_node=1"))
    assert "resuming on another layout (trainer.n_gpus_per_node: 2 there, 1 now)" in caplog.text
    claim_run_dir(
        config(deepspeed, "backend=megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    )
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size: None there, 2 now" in caplog.text
    assert "backend.name: 'deepspeed' there, 'megatron' now" in caplog.text
    with pytest.raises(ConfigError, match=r"trainer\.n_gpus_per_node: 2 there, 4 now"):
        claim_run_dir(config(lora, *lora_run, "trainer.n_gpus_per_node=4"))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr"):  # the rest still counts
        claim_run_dir(config(fsdp, "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.optim.lr=3e-5"))
    saved = BACKEND_TRAITS["deepspeed"]
    BACKEND_TRAITS["deepspeed"] = BackendTraits()  # as a backend registered without the trait
    try:
        with pytest.raises(ConfigError, match=r"trainer\.n_gpus_per_node: 2 there, 4 now"):
            claim_run_dir(config(deepspeed, "backend=deepspeed", "trainer.n_gpus_per_node=4"))
    finally:
        BACKEND_TRAITS["deepspeed"] = saved


def test_fresh_start_moves_the_earlier_run_aside_and_pruning_cannot_reach_it(tmp_path):
    claim_run_dir(config(tmp_path))
    for step in (1, 2):
        save(tmp_path, step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    (tmp_path / "notes.txt").write_text("the user's own file")
    claim_run_dir(config(tmp_path, "trainer.resume_mode=disable", "data.seed=5"))
    (previous,) = (tmp_path / "previous").iterdir()
    assert sorted(p.name for p in previous.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert (previous / "metrics.jsonl").read_text().count("step") == 3
    assert not (tmp_path / "metrics.jsonl").exists() and CheckpointManager(str(tmp_path)).latest() is None
    assert (tmp_path / "notes.txt").exists(), "files that are not run outputs stay"
    assert json.loads((tmp_path / RUN_CONFIG).read_text())["settings"]["data.seed"] == 5
    for step in (1, 2, 3):  # the new run's keep-2 pruning sees only its own checkpoints
        save(tmp_path, step)
    assert sorted(p.name for p in previous.glob("global_step_*")) == ["global_step_1", "global_step_2"]


def test_restart_before_the_first_checkpoint_starts_a_clean_metrics_file(tmp_path):
    claim_run_dir(config(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # killed after validation, before any checkpoint
    claim_run_dir(config(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / RUN_CONFIG).exists()


def test_result_settings_leave_out_what_only_changes_execution():
    keys = set(result_settings(config("/tmp/x")))
    assert {"actor_rollout_ref.model.path", "data.train_files", "algorithm.adv_estimator", "trainer.seed"} <= keys
    assert {"actor_rollout_ref.actor.optim.lr", "data.train_batch_size", "actor_rollout_ref.rollout.n"} <= keys
    for key in ("trainer.total_training_steps", "trainer.logger", "trainer.save_freq", "reward_model.timeout_s"):
        assert key not in keys
    assert not any(key.startswith("ray_kwargs.") for key in keys)


def test_result_keys_are_every_key_but_the_marked_ones():
    """Derived, not listed: every leaf counts unless its dataclass marks it execution-only, so the keys a hand list
    once missed are checked, and a key added tomorrow is checked until someone marks it."""
    keys = set(result_keys())
    every = {key for key, _, _ in leaf_fields(PPOConfig)}
    assert keys < every and every - keys == {k for k, o, f in leaf_fields(PPOConfig) if f.name in execution_only(o)}
    for key in ("critic.loss_agg_mode", "trainer.balance_batch", "actor_rollout_ref.rollout.name"):
        assert key in keys

    @dataclasses.dataclass
    class Tomorrow(PPOConfig):
        new_knob: int = 0

    assert "new_knob" in result_keys(Tomorrow)


def test_every_execution_only_mark_names_a_field():
    owners = {owner for _, owner, _ in leaf_fields(PPOConfig)}
    for owner in owners:
        for klass in owner.__mro__:
            marked = set(vars(klass).get("EXECUTION_ONLY", ())) - {"*"}
            names = {f.name for f in dataclasses.fields(klass)} if dataclasses.is_dataclass(klass) else set()
            assert marked <= names, f"{klass.__name__}.EXECUTION_ONLY names no field: {marked - names}"


@pytest.mark.parametrize(
    "override, key",
    [
        ("critic.loss_agg_mode=seq-mean-token-sum", "critic.loss_agg_mode"),
        ("trainer.balance_batch=true", "trainer.balance_batch"),
        ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.name"),
        ("actor_rollout_ref.rollout.multi_turn.max_tool_response_length=7", "multi_turn.max_tool_response_length"),
    ],
)
def test_auto_resume_refuses_a_change_of_a_key_the_old_hand_list_missed(tmp_path, override, key):
    claim_run_dir(config(tmp_path))
    save(tmp_path, 1)
    with pytest.raises(ConfigError) as info:
        claim_run_dir(config(tmp_path, override))
    assert key in str(info.value)


def test_a_run_config_of_another_config_version_is_checked_on_the_keys_both_know(tmp_path, caplog):
    claim_run_dir(config(tmp_path))
    save(tmp_path, 1)
    record = json.loads((tmp_path / RUN_CONFIG).read_text())
    del record["settings"]["trainer.balance_batch"]  # written before the key was checked
    record["settings"]["trainer.retired_key"] = 3  # a key this version no longer has
    (tmp_path / RUN_CONFIG).write_text(json.dumps(record))
    claim_run_dir(config(tmp_path))  # resumes
    assert "trainer.balance_batch, trainer.retired_key" in caplog.text
    record["settings"]["data.seed"] = 99
    (tmp_path / RUN_CONFIG).write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="data.seed: 99 there, 1 now"):
        claim_run_dir(config(tmp_path))
