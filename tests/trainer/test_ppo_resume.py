"""The PPO trainer end to end: outputs, exact resume after kill -9 and a dead rank (subprocesses, like a user runs
it: the process is the point), the GAE path (in this process, on the session's Ray cluster)."""

import json
import logging
import os
import signal
import subprocess
import time

import pytest

from tests.trainer.runs import COMPARED, ROOT, command, env, metrics, run_in_process, signalled_when

pytestmark = pytest.mark.slow


def test_uninterrupted_vs_killed_and_resumed(ray_cluster, task, tmp_path, caplog):
    full = tmp_path / "full"
    run_in_process(task, full, 4)
    reference = metrics(full)
    assert sorted(reference) == [0, 1, 2, 3, 4]
    assert "val/scaletrain/arithmetic/acc" in reference[0] and "val/scaletrain/arithmetic/acc" in reference[2]
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in full.glob("global_step_*")) == ["global_step_2", "global_step_3", "global_step_4"]
    assert (full / "hf" / "config.json").exists() and (full / "plots" / "summary.png").exists()

    # same run on the command line, killed with SIGKILL in the middle of a save (step 2's, or step 3's if step 2's
    # was too quick to catch), then resumed: it continues from the last complete checkpoint
    part = tmp_path / "part"
    caught = killed_in_a_save(command(task, part, 4), part)
    # the step being saved was logged before its save began: a kill in the save loses no metrics line
    assert sorted(metrics(part)) == list(range(caught + 1))
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, part, 4)
    assert f"resumed from {part / f'global_step_{caught - 1}'}" in caplog.text
    after = metrics(part)
    lines = (part / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]  # the re-run step once, not twice
    for step in (3, 4):
        for key in COMPARED:
            assert after[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert after[4]["val/scaletrain/arithmetic/acc"] == reference[4]["val/scaletrain/arithmetic/acc"]


def killed_in_a_save(args, run) -> int:
    """Run ``args`` (a CLI run saving every step) and SIGKILL its whole process group while the engines write step
    2's checkpoint (or step 3's if step 2's was too quick to catch): the save marker is there, the checkpoint's
    last file is not. Returns the step whose save was cut short."""

    def saving() -> bool:
        assert not (run / "global_step_3" / "trainer_state.json").exists(), "no save caught mid-way"
        return any((run / f".global_step_{s}.incomplete").exists() for s in (2, 3))

    signalled_when(args, saving, "save", signal.SIGKILL, poll_s=0.002)
    return 2 if not (run / "global_step_2" / "trainer_state.json").exists() else 3


def test_bad_config_fails_before_ray_naming_the_key(task, tmp_path):
    # verbose: Ray's start line would reach the console (the default console hides the libraries' INFO lines)
    out = subprocess.run(
        command(task, tmp_path / "bad", 1, ["actor_rollout_ref.actor.ppo_mini_batch_size=3", "trainer.verbose=true"]),
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (3) must divide data.train_batch_size (4)" in out.stderr
    assert "Started a local Ray instance" not in out.stderr + out.stdout
    typo = subprocess.run(
        command(task, tmp_path / "bad", 1, ["+trainer.totl_steps=3"]),
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typo.returncode != 0 and "unknown config key 'trainer.totl_steps'" in typo.stderr


def test_dead_rank_fails_the_step_naming_it_and_checkpoint_stays_loadable(ray_cluster, task, tmp_path, caplog):
    import psutil

    run = tmp_path / "dies"
    proc = subprocess.Popen(
        command(task, run, 50),
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "global_step_2" / "trainer_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        workers = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "WorkerDict" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2, [p.cmdline() for p in workers]
        victim = workers[1]
        victim.kill()
        output, _ = proc.communicate(timeout=120)  # fails fast: no hang in the peer's collective
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "WorkerDiedError" in output and "rank" in output and f"pid {victim.pid}" in output
    # the last complete checkpoint loads: a resumed run continues from it and finishes
    last = int((run / "latest_checkpointed_iteration.txt").read_text())
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, run, last + 1)  # in this process, on the session's cluster
    assert f"at step {last}" in caplog.text
    assert sorted(metrics(run))[-1] == last + 1


def test_gae_path_with_critic_and_kl_in_reward(ray_cluster, task, tmp_path):
    run = tmp_path / "gae"
    gae = [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.n=1",
        "algorithm.use_kl_in_reward=true",
        "trainer.val_before_train=false",
        "trainer.critic_warmup=1",
    ]
    with_hf = "checkpoint.save_contents=[model,optimizer,extra,hf_model]"
    run_in_process(task, run, 2, [*gae, f"actor_rollout_ref.actor.{with_hf}", f"critic.{with_hf}"])
    rows = metrics(run)
    assert sorted(rows) == [1, 2]
    # hf_model: each checkpoint holds the role's HF export; step 2's actor is the run's final export
    from scaletrain.model_merger import compare

    assert compare(str(run / "global_step_2" / "actor" / "huggingface"), str(run / "hf"))
    for role in ("actor", "critic"):
        assert (run / "global_step_1" / role / "huggingface" / "model.safetensors").is_file(), role
    for key in (
        "critic/vf_loss",
        "critic/values/mean",
        "actor/reward_kl_penalty",
        "actor/pg_loss",
        "timing_s/values",
        "timing_s/ref",
        "timing_s/update_critic",
        "perf/mfu/actor",
    ):
        assert key in rows[2], key
    assert (run / "global_step_2" / "critic").is_dir()
    # trainer.critic_warmup=1: step 1 trained only the critic (no actor update, no weight sync)
    assert "critic/vf_loss" in rows[1] and "actor/pg_loss" not in rows[1] and "timing_s/sync_weights" not in rows[1]


def test_time_based_checkpoints_bound_what_a_crash_loses(ray_cluster, task, tmp_path):
    """``trainer.save_freq=-1`` (verl's "only at the end") with ``save_freq_minutes`` elapsed at every step: each
    step is checkpointed; a run shorter than the default 30 minutes saves at the end only
    (tests/trainer/test_dapo_remax_run.py)."""
    run = tmp_path / "timed"
    quiet = ["trainer.val_before_train=false", "data.val_files=null", "trainer.save_hf_at_end=false"]
    timed = ["trainer.save_freq=-1", "trainer.save_freq_minutes=1e-9", "trainer.max_ckpt_to_keep=null"]
    run_in_process(task, run, 3, [*quiet, "trainer.plot_at_end=false", *timed])
    assert sorted(p.name for p in run.glob("global_step_*")) == [f"global_step_{s}" for s in (1, 2, 3)]
    rows = metrics(run)
    assert sorted(rows) == [1, 2, 3]
    # a save's seconds and bytes reach the next step's line (a step is logged before its save)
    assert "checkpoint/save_s" not in rows[1]
    for step in (2, 3):
        assert rows[step]["checkpoint/save_s"] > 0 and rows[step]["checkpoint/save_bytes"] > 10_000, rows[step]


# a run killed with SIGKILL while its engines write a checkpoint (step 2's or step 3's), resumed: it continues from
# the previous complete one, with every engine's state (the critic's too), and its steps equal the uninterrupted run's
RESUMED = {
    "megatron_critic": ["backend=megatron", "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"],
    "deepspeed_vllm": ["backend=deepspeed", "rollout=vllm"],
}


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_equals_the_uninterrupted_run(ray_cluster, task, tmp_path, caplog, name):
    extra = [*RESUMED[name], "trainer.val_before_train=false", "trainer.save_hf_at_end=false"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_in_process(task, full, 3, extra)
    caught = killed_in_a_save(command(task, part, 3, extra), part)  # the engines' own writers, cut short
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, part, 3, extra)
    assert f"resumed from {part / f'global_step_{caught - 1}'}" in caplog.text
    reference, resumed = metrics(full), metrics(part)
    assert sorted(resumed) == [1, 2, 3]
    compared = [*COMPARED, *(["critic/vf_loss", "critic/values/mean"] if "critic" in name else [])]
    for step in range(caught, 4):
        for key in compared:
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)
