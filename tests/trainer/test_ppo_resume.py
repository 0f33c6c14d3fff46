"""The PPO trainer end to end (subprocesses, like a user runs it): outputs, and exact resume after kill -9."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "actor/grad_norm")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from scaletrain.data import build_embedded_default

    return build_embedded_default(cache_dir=str(tmp_path_factory.mktemp("cache")), n_train=400, n_val=16, n_test=16)


def command(task, run_dir, steps, extra=()):
    return [
        sys.executable,
        "-m",
        "scaletrain.trainer.main_ppo",
        "rollout=hf",
        f"actor_rollout_ref.model.path={task['model']}",
        f"data.train_files={task['train']}",
        f"data.val_files={task['test']}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "data.max_prompt_length=8",
        "data.max_response_length=4",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=2",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console,jsonl]",
        "trainer.max_ckpt_to_keep=3",
        "ray_init.num_cpus=4",
        *extra,
    ]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")


def overridden(task, run_dir, steps, overrides):
    """``command(task, run_dir, steps)`` with ``overrides`` replacing its own values of the same keys."""
    keys = {o.split("=")[0] for o in overrides}
    return [arg for arg in command(task, run_dir, steps) if arg.split("=")[0] not in keys] + list(overrides)


def run_overridden(task, run_dir, steps, overrides):
    """``overridden(...)`` run to the end (asserting exit 0); returns the completed process."""
    args = overridden(task, run_dir, steps, overrides)
    out = subprocess.run(args, env=env(), timeout=400, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {row["step"]: row for row in rows}


def test_uninterrupted_vs_killed_and_resumed(task, tmp_path):
    full = tmp_path / "full"
    subprocess.run(command(task, full, 4), env=env(), check=True, timeout=400, cwd=ROOT, capture_output=True)
    reference = metrics(full)
    assert sorted(reference) == [0, 1, 2, 3, 4]
    assert "val/scaletrain/arithmetic/acc" in reference[0] and "val/scaletrain/arithmetic/acc" in reference[2]
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in full.glob("global_step_*")) == ["global_step_2", "global_step_3", "global_step_4"]
    assert (full / "hf" / "config.json").exists() and (full / "plots" / "summary.png").exists()

    # same run, killed with SIGKILL in the middle of a save (step 2's, or step 3's if step 2's was too quick to
    # catch), then resumed: it continues from the last complete checkpoint
    part = tmp_path / "part"
    proc = subprocess.Popen(
        command(task, part, 4),
        env=env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not any((part / f".global_step_{s}.incomplete").exists() for s in (2, 3)):
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no save within 300 s"
            assert not (part / "global_step_3" / "trainer_state.json").exists(), "no save caught mid-way"
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait()
    caught = 2 if not (part / "global_step_2" / "trainer_state.json").exists() else 3  # the save cut short
    resumed = subprocess.run(command(task, part, 4), env=env(), timeout=400, cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {part / f'global_step_{caught - 1}'}" in resumed.stdout + resumed.stderr
    after = metrics(part)
    for step in (3, 4):
        for key in COMPARED:
            assert after[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert after[4]["val/scaletrain/arithmetic/acc"] == reference[4]["val/scaletrain/arithmetic/acc"]


def test_bad_config_fails_before_ray_naming_the_key(task, tmp_path):
    out = subprocess.run(
        command(task, tmp_path / "bad", 1, ["actor_rollout_ref.actor.ppo_mini_batch_size=3"]),
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


def test_dead_rank_fails_the_step_naming_it_and_checkpoint_stays_loadable(task, tmp_path):
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
    resumed = subprocess.run(
        command(task, run, last + 1), env=env(), timeout=400, cwd=ROOT, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {last}" in resumed.stdout + resumed.stderr
    assert sorted(metrics(run))[-1] == last + 1


def test_gae_path_with_critic_and_kl_in_reward(task, tmp_path):
    run = tmp_path / "gae"
    out = subprocess.run(
        command(
            task,
            run,
            2,
            [
                "algorithm.adv_estimator=gae",
                "actor_rollout_ref.rollout.n=1",
                "algorithm.use_kl_in_reward=true",
                "trainer.val_before_train=false",
                "trainer.critic_warmup=1",
            ],
        ),
        env=env(),
        timeout=400,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run)
    assert sorted(rows) == [1, 2]
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
