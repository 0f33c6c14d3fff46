"""One run, one directory: resume_mode=auto resumes only a run with the same result-determining settings (else
fails naming the keys), a fresh start moves an earlier run's outputs aside instead of mixing with them, and keep-N
pruning cannot reach them. The CLI runs of the same faults are in test_run_faults.py."""

import json

import pytest

from scaletrain.trainer.checkpoint import CheckpointManager
from scaletrain.trainer.plan import resolve_config
from scaletrain.trainer.run_identity import RUN_CONFIG, claim_run_dir, fingerprint, result_settings
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.test_ppo_config import composed


def config(run_dir, *overrides):
    from scaletrain.trainer.config import load_ppo_config

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
