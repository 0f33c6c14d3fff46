"""launch/run.sh under a real 2-node SLURM cluster stood up on this machine (`make test-slurm` runs exactly this).

The cluster (network/UTS/mount/PID namespaces, munge, slurmctld, two slurmd, fake GPUs) and the checks live in
launch/testing/ (slurm_cluster.sh, slurm_grpo_check.sh): a short GRPO run on the embedded default, one rank on
each node, is preempted after its first step as SLURM's time-limit warning does (SIGUSR1), checkpoints, requeues
itself and resumes; it must exit 0, run its workers on both nodes with Ray's token authentication on and write the
last checkpoint; everything is torn down after.

Skipped, with the reason, unless SCALETRAIN_SLURM_TEST=1 (set by `make test-slurm`; plain `make test` deselects
the `slurm` marker via setup.cfg), when the machine cannot create namespaces (not root, unprivileged container),
or when slurm-wlm/munge are missing and apt-get cannot install them (no network).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTING = ROOT / "launch" / "testing"
SKIP_STATUS = 3  # slurm_grpo_check.sh: SLURM could not be installed


def _skip_reason() -> str | None:
    if os.environ.get("SCALETRAIN_SLURM_TEST") != "1":
        return "set SCALETRAIN_SLURM_TEST=1 (or run `make test-slurm`) to stand up the SLURM test cluster"
    if sys.platform != "linux":
        return "needs Linux namespaces"
    probe = subprocess.run([str(TESTING / "probe.sh")], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"this machine cannot host the SLURM test cluster: {probe.stdout.strip() or probe.stderr.strip()}"
    return None


@pytest.mark.slurm
@pytest.mark.slow
def test_run_sh_trains_grpo_on_two_slurm_nodes():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    # not subprocess.run: on Ctrl-C it would SIGKILL the script before its trap tears the cluster down
    proc = subprocess.Popen(
        [str(TESTING / "slurm_grpo_check.sh")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=600)
    except BaseException as exc:  # timeout or Ctrl-C: let the script's trap tear the cluster down first
        if not isinstance(exc, KeyboardInterrupt):  # Ctrl-C already reached the script (same process group)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=90)
        except BaseException:
            proc.kill()
            proc.wait()
            # last resort: deletes the test namespaces, which kills every process left in them
            subprocess.run([str(TESTING / "slurm_cluster.sh"), "down", "/nonexistent"], timeout=60, check=False)
        raise
    print(out)
    if proc.returncode == SKIP_STATUS:
        pytest.skip(f"slurm-wlm/munge not installed and apt-get could not install them:\n{out[-2000:]}")
    assert proc.returncode == 0, f"slurm_grpo_check.sh exited {proc.returncode}:\n{out[-6000:]}"
    assert "PASS:" in out
    assert "on 2 node(s)" in out
