"""No one gets in: the Ray cluster the trainer starts requires Ray's auth token, so a process without it (anyone who
reaches its ports) cannot connect and run code (before: the trainer turned authentication off)."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.trainer.runs import ROOT

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys
    import ray
    from scaletrain.trainer.config import PPOConfig
    from scaletrain.trainer.ray_cluster import ray_cluster

    cfg = PPOConfig()
    with ray_cluster(cfg.ray_kwargs, cfg.world_size, "cpu"):  # the trainer's private cluster
        print("auth mode", os.environ.get("RAY_AUTH_MODE"), flush=True)
        gcs = ray.get_runtime_context().gcs_address
        intruder = dict(os.environ, RAY_AUTH_MODE="disabled", HOME=sys.argv[1])  # no token file, no token variable
        intruder.pop("RAY_AUTH_TOKEN", None)
        code = f"import ray; ray.init(address='{gcs}', logging_level='ERROR'); print('INTRUDER CONNECTED')"
        out = subprocess.run([sys.executable, "-c", code], env=intruder, capture_output=True, text=True, timeout=120)
        print("intruder exit", out.returncode, flush=True)
        print(out.stdout[-500:], out.stderr[-1500:], flush=True)
        print("own task", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    print("shut down", not ray.is_initialized(), flush=True)
    """
)


def test_a_process_without_the_token_cannot_join_the_trainers_cluster(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_MODE", None)  # as in a user's shell
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "own task 42" in out.stdout, "the trainer's own processes hold the token"
    assert "INTRUDER CONNECTED" not in out.stdout
    assert "intruder exit 1" in out.stdout and "token" in out.stdout.lower()
    assert "shut down True" in out.stdout  # a cluster the run started is stopped at its end
