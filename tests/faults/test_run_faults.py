"""Faults injected through the real stack, as a user meets them on the command line (main_ppo in a subprocess:
Ray, 2 FSDP ranks, the HF rollout, the scoring processes). Each test names the fault it injects; the README's
"Reliability" table points here.

The runs the faults hit have no Ray auth settings, as a user's environment does: they train with Ray's token
authentication on, each with a token of its own. A run that resumes after a fault's run runs in this process, on
the session's Ray cluster (``main_ppo.run``: the resume is its point, not the process).
"""

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.hang_model import hanging_model
from tests.trainer.runs import ROOT, command, metrics, run_in_process, signalled_when

pytestmark = pytest.mark.slow

FAULT_FNS = Path(__file__).parent / "reward_fns.py"
SECRET = "sk-live-fault-suite-0042"


def user_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):  # the session's token (conftest.py); a user's shell has none
        env.pop(name, None)
    return env


def overridden(task, run_dir, steps, *overrides):
    return command(task, run_dir, steps, overrides)


def wrote_a_row(run_dir) -> bool:
    """The run logged its first metrics row (a step or the first validation)."""
    rows = run_dir / "metrics.jsonl"
    return rows.exists() and bool(rows.read_text().strip())


def run(args, timeout=400):
    return subprocess.run(args, env=user_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def reward(name, *kwargs):
    return [f"custom_reward_function.path={FAULT_FNS}", f"custom_reward_function.name={name}", *kwargs]


SECRETS = {  # a careless user's secrets on the command line, in three shapes the redaction must catch
    "+custom_reward_function.reward_kwargs.api_key": SECRET,  # by its key's name
    "+custom_reward_function.reward_kwargs.credentials": "no-prefix-at-all-1234",  # a name the first version missed
    "+custom_reward_function.reward_kwargs.endpoint": "https://bob:pw-in-url-5678@judge.local/v1",  # by its value
}
LEAKS = (SECRET, "no-prefix-at-all-1234", "pw-in-url-5678")


def assert_nothing_leaked(out, *dirs):
    for leak in LEAKS:
        assert leak not in out.stdout + out.stderr, leak
        for root in dirs:
            for path in root.rglob("*"):
                if path.is_file():
                    assert leak.encode() not in path.read_bytes(), (leak, path)


def test_reward_raising_on_every_sample_stops_the_run_naming_it(task, tmp_path, monkeypatch):
    """Fault: a custom reward function that raises on every sample (before: 3 steps on all-zero rewards). Also:
    the secrets bound to it (custom_reward_function.reward_kwargs) appear nowhere, though the run fails (Hydra
    echoes its overrides then) and names the function (whose repr holds them), and wandb records the command line."""
    run_dir, wandb_home = tmp_path / "raises", tmp_path / "wandb-home"
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(wandb_home))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the logger's default: offline, files in the run directory
    secrets = [f"{key}={value}" for key, value in SECRETS.items()]
    out = run(
        overridden(
            task,
            run_dir,
            6,
            *reward("raises_always", *secrets),
            "reward_model.max_error_steps=2",
            "trainer.val_before_train=false",
            "trainer.logger=[console,jsonl,wandb]",
        )
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    named = f"the reward function functools.partial(CustomRewardFn('{FAULT_FNS}', 'raises_always'), api_key='"
    assert named in text and "failed on more than 50%" in text
    assert "2 steps in a row (up to step 2: 100%, 100%)" in text and "ValueError: scorer bug: cannot parse" in text
    assert "Error executing job with overrides" in text and "***redacted***" in text
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "1"  # step 1's checkpoint is kept
    assert sorted(metrics(run_dir)) == [1]  # step 2 was not trained on its zero rewards
    recorded = b"".join(p.read_bytes() for p in run_dir.glob("wandb/*/run-*.wandb"))
    assert b"reward_kwargs.api_key=***redacted***" in recorded, "wandb recorded no (redacted) command line"
    assert_nothing_leaked(out, run_dir, wandb_home)

    # One run, one directory: auto-resuming that directory with other settings fails before Ray, naming them
    started = "Started a local Ray instance"  # what Ray logs on starting one (verbose: on the console too)
    assert started in (run_dir / "run.log").read_text()
    verbose = "trainer.verbose=true"
    other = run(overridden(task, run_dir, 6, *reward("raises_always", *secrets), "trainer.seed=9", verbose), 120)
    assert other.returncode != 0
    assert f"{run_dir} holds a run with other settings" in other.stderr
    assert "trainer.seed: 1 there, 9 now" in other.stderr
    assert started not in other.stdout + other.stderr
    assert_nothing_leaked(other, run_dir)


def test_reward_hanging_on_half_the_samples_is_bounded_per_step(task, tmp_path):
    """Fault: a reward function hanging on about half of the samples (before: no step finished in 10 minutes).
    Also: the secret in its reward kwargs reaches no logger."""
    run_dir = tmp_path / "hangs"
    start = time.monotonic()
    out = run(
        overridden(
            task,
            run_dir,
            2,
            *reward("hangs_on_odd_answers", f"+custom_reward_function.reward_kwargs.api_key={SECRET}"),
            "reward_model.step_timeout_s=4",
            "reward_model.max_error_rate=1.0",
            "trainer.val_before_train=false",
            "trainer.logger=[console,jsonl,tensorboard]",
        )
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.monotonic() - start < 240
    rows = metrics(run_dir)
    for step in (1, 2):
        # bounded near the 4 s budget (the hang itself never returns); slack for a loaded 2-core machine
        assert rows[step]["reward/timeouts"] > 0 and rows[step]["reward/seconds"] < 20, rows[step]
    assert "not scored within the step's scoring budget of 4s" in out.stdout + out.stderr
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the secret is in {path}"
    assert "***redacted***" in (run_dir / "run_config.json").read_text()


def test_stuck_worker_times_out_naming_it_with_every_stack(task, tmp_path):
    """Fault: a worker alive but stuck outside a collective (user model code sleeping on rank 1; before: the
    driver waited forever)."""
    model = hanging_model(task["model"], tmp_path / "hanging-model")
    run_dir = tmp_path / "stuck"
    out = run(
        overridden(
            task,
            run_dir,
            2,
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.model.trust_remote_code=true",
            "trainer.worker_call_timeout_s=25",
            "trainer.val_before_train=false",
        )
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "WorkerTimeoutError: worker group 'actor_rollout': compute_log_prob() did not finish on ranks [0, 1]" in text
    assert "stuck on ranks [1] (ranks [0] wait in a collective for the others)" in text
    stacks = {p.name: p.read_text() for p in (run_dir / "stacks").iterdir()}
    assert len(stacks) == 2, stacks.keys()
    (stuck,) = [t for name, t in stacks.items() if "-rank1-" in name]
    (peer,) = [t for name, t in stacks.items() if "-rank0-" in name]
    assert "modeling_hang.py" in stuck and "in forward" in stuck  # where rank 1 is stuck
    assert "in compute_log_prob" in peer  # rank 0 waits in the same call (its collective)


def test_sigterm_checkpoints_after_the_step_and_exits_0_then_resumes(ray_cluster, task, tmp_path, caplog):
    """Fault: the job is preempted by a SIGTERM to its whole process group, the private Ray cluster's processes
    started by the driver included (before: they stopped with it, the run lost its step's objects and exited 1
    after Ray's 60 s reconnection deadline). launch/run.sh passes SLURM's warning signal (SIGUSR1) to the driver."""
    run_dir = tmp_path / "preempted"
    once = ("trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false")  # saves at the end only
    steps = 8
    args = overridden(task, run_dir, steps, *once)
    returncode, output = signalled_when(args, lambda: wrote_a_row(run_dir), "step", run_env=user_env())
    assert returncode == 0, output[-3000:]
    stopped = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= stopped < steps
    assert f"preempted by SIGTERM after step {stopped}: checkpoint {run_dir / f'global_step_{stopped}'}" in output
    # the step it finished was scored in full: the reward workers' fork server is not in the group (before: it died,
    # and two of the step's samples scored 0)
    assert "because the scorer failed" not in output and "reward worker died" not in output, output[-3000:]
    assert not (run_dir / "hf").exists()  # the run is not finished: no final export
    caplog.set_level(logging.INFO, logger="scaletrain")
    run_in_process(task, run_dir, steps, once)
    assert f"resumed from {run_dir / f'global_step_{stopped}'} at step {stopped}" in caplog.text
    rows = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert rows == list(range(1, steps + 1)), "each step once, none lost"


def test_sigterm_during_start_up_exits_0_and_the_rerun_trains(ray_cluster, task, tmp_path):
    """Fault: the job is preempted while it starts (before: the signal's default action, or Ray's handler's abort,
    a non-zero exit, so SLURM did not requeue it), at two moments: while its workers are created (after the plan
    line), and once they are up (their set-up, the first validation). Each time: exit 0 saying so, nothing written
    that a rerun trips on. The signal goes to the whole process group, as in the test above."""
    run_dir = tmp_path / "early"
    for marker in ("config.plan: plan: ", "worker group 'colocated'"):  # the run plan's line, not the memory plan's
        log = run_dir / "run.log"
        seen = log.read_text().count(marker) if log.exists() else 0  # the run log is appended to by each run
        args = overridden(task, run_dir, 2)
        ready = lambda: log.exists() and log.read_text().count(marker) > seen  # noqa: E731 (read in this iteration)
        returncode, output = signalled_when(args, ready, repr(marker), run_env=user_env())
        assert returncode == 0, (marker, output[-3000:])
        assert "preempted by SIGTERM before its first checkpoint: run the same command again" in output, marker
        assert not list(run_dir.glob("global_step_*")) and not list(run_dir.glob(".global_step_*")), marker
    run_in_process(task, run_dir, 2)
    assert sorted(metrics(run_dir)) == [0, 1, 2]


def test_restart_before_the_first_checkpoint_logs_each_step_once(ray_cluster, task, tmp_path):
    """Fault: the run dies after validation, before any checkpoint, and is restarted (before: metrics.jsonl got a
    second step-0 row, and the two runs mixed)."""
    run_dir = tmp_path / "restarted"
    no_saves = ("trainer.save_freq=-1", "trainer.test_freq=-1")
    args = overridden(task, run_dir, 2, *no_saves)
    # SIGKILL to the driver and all it started: no checkpoint, no clean-up
    signalled_when(args, lambda: wrote_a_row(run_dir), "validation row", signal.SIGKILL, user_env())
    assert not list(run_dir.glob("global_step_*"))
    run_in_process(task, run_dir, 2, no_saves)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert steps == [0, 1, 2], steps
    (previous,) = (run_dir / "previous").iterdir()
    assert [json.loads(line)["step"] for line in (previous / "metrics.jsonl").read_text().splitlines()] == [0]
