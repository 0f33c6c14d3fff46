"""PPO runs for the end-to-end tests: the embedded task's small run as a command line, run in a subprocess (for the
tests whose point is the process: exit codes, signals, console output) or in this process against the session's
Ray cluster (``main_ppo.run``: no interpreter, imports or cluster start per run).

``ppo_overrides(task, run_dir, steps, extra)``: the run's overrides (``extra`` replaces the base's values of the
same keys); ``command(...)``: the same as a ``python -m scaletrain.trainer.main_ppo`` argv; ``run_in_process``
and ``run_subprocess`` run them to the end; ``signalled_when(args, ready, ...)`` starts one as a user's job and
signals its process group at a chosen moment; ``metrics(run_dir)``: the run's jsonl rows by step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "actor/grad_norm")


def ppo_overrides(task: dict, run_dir, steps: int, extra: Iterable[str] = ()) -> list[str]:
    base = [
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
    ]
    extra = list(extra)
    keys = {o.split("=")[0] for o in extra}
    return [arg for arg in base if arg.split("=")[0] not in keys] + extra


def command(task: dict, run_dir, steps: int, extra: Iterable[str] = ()) -> list[str]:
    """The run as a command line; its Ray cluster is a private one of 4 CPUs, started and stopped by the run."""
    return [
        sys.executable,
        "-m",
        "scaletrain.trainer.main_ppo",
        *ppo_overrides(task, run_dir, steps, ["ray_kwargs.ray_init.num_cpus=4", *extra]),
    ]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")


def run_subprocess(task: dict, run_dir, steps: int, extra: Iterable[str] = (), timeout: float = 400):
    """``command(...)`` run to the end (asserting exit 0); returns the completed process."""
    out = subprocess.run(
        command(task, run_dir, steps, extra), env=env(), timeout=timeout, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def run_in_process(task: dict, run_dir, steps: int, extra: Iterable[str] = ()):
    """The run in this process, on the Ray cluster this process is connected to (the session's: the caller
    depends on the ``ray_cluster`` fixture); returns its ``RunResult``."""
    import ray

    from scaletrain.trainer.main_ppo import run

    assert ray.is_initialized(), "an in-process run joins the session's cluster: depend on the ray_cluster fixture"
    return run(ppo_overrides(task, run_dir, steps, extra))


def signalled_when(
    args: list[str],
    ready: Callable[[], bool],
    what: str,
    sig: int = signal.SIGTERM,
    run_env: dict[str, str] | None = None,
    output: Path | None = None,
    poll_s: float = 0.02,
) -> tuple[int, str]:
    """Start ``args`` as a user's job (a session and process group of its own: the driver and everything it
    starts there, the private Ray cluster's processes included), send ``sig`` to the whole group once ``ready()``
    holds (as ``kill -SIG -PGID``, systemd's stop or SLURM's preemption do) and wait for the run to end; returns
    (exit code, console output). The console goes to ``output`` (a file, never a pipe nobody reads while polling);
    ``ready()`` may assert on what must not happen first. Fails if the run ends before ``ready()``, or ``what`` is not
    there within 300 s; the group is SIGKILLed if it outlives the 300 s after the signal. Without ``output`` the
    console goes to a temporary file, removed once read (kept, and named in the error, when the run fails first)."""
    temporary = output is None
    if output is None:
        fd, name = tempfile.mkstemp(prefix="run-", suffix=".txt")
        os.close(fd)
        output = Path(name)
    with output.open("w") as out:
        proc = subprocess.Popen(
            args, env=run_env or env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}: {output}"
            assert time.monotonic() < deadline, f"no {what} within 300 s"
            time.sleep(poll_s)
        os.killpg(proc.pid, sig)
        returncode = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    console = output.read_text()
    if temporary:
        output.unlink()
    return returncode, console


def metrics(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {row["step"]: row for row in rows}
