"""No one gets in: the Ray cluster the trainer starts requires an auth token of its own run, so a process without
it (anyone who reaches its ports) cannot connect and run code, not even with the per-user ``~/.ray/auth_token``
Ray would otherwise share between all of a user's clusters (mode 0644: every local user can read it)."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.trainer.runs import ROOT

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import os, stat, subprocess, sys
    import ray
    from scaletrain.trainer.config.ppo_config import PPOConfig
    from scaletrain.trainer.run.ray_cluster import ray_cluster

    cfg = PPOConfig()
    with ray_cluster(cfg.ray_kwargs, cfg.world_size, "cpu"):  # the trainer's private cluster
        path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
        if path:
            print("token file", path, oct(stat.S_IMODE(os.stat(path).st_mode)), flush=True)
            print("token dir", oct(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)), flush=True)
        gcs = ray.get_runtime_context().gcs_address
        code = f"import ray; ray.init(address='{gcs}', logging_level='ERROR'); print('INTRUDER CONNECTED')"
        user_env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        intruders = {
            "no token": dict(user_env, RAY_AUTH_MODE="disabled", HOME=sys.argv[1]),
            "the per-user token": dict(user_env, RAY_AUTH_MODE="token"),  # HOME's .ray/auth_token, readable by all
        }
        for name, env in intruders.items():
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
            print(f"intruder with {name}: exit", out.returncode, flush=True)
            print(out.stdout[-500:], out.stderr[-1500:], flush=True)
        print("own task", ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    print("shut down", not ray.is_initialized(), flush=True)
    left = bool(path) and os.path.exists(path)
    print("token file left", left, "variable left", "RAY_AUTH_TOKEN_PATH" in os.environ, flush=True)
    with ray_cluster(cfg.ray_kwargs, cfg.world_size, "cpu"):  # a second run of this process: a token of its own
        second = os.environ.get("RAY_AUTH_TOKEN_PATH")
        print("second run", second != path, ray.get(ray.remote(lambda: 41 + 1).remote()), flush=True)
    """
)


def test_a_process_without_the_runs_token_cannot_join_the_trainers_cluster(tmp_path):
    home, empty = tmp_path / "home", tmp_path / "empty"
    (home / ".ray").mkdir(parents=True)
    empty.mkdir()
    user_token = home / ".ray" / "auth_token"  # what `ray start` / a plain ray.init leaves for the user, mode 0644
    user_token.write_text("f" * 64)
    user_token.chmod(0o644)
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", HOME=str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # as in a user's shell
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(empty)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "own task 42" in out.stdout, "the trainer's own processes hold the token"
    assert "INTRUDER CONNECTED" not in out.stdout
    assert "intruder with no token: exit 1" in out.stdout
    assert "intruder with the per-user token: exit 1" in out.stdout
    assert " 0o600\n" in out.stdout and "token dir 0o700" in out.stdout
    assert "shut down True" in out.stdout  # a cluster the run started is stopped at its end
    assert "token file left False variable left False" in out.stdout
    assert "second run True 42" in out.stdout
    assert user_token.read_text() == "f" * 64 and stat.S_IMODE(user_token.stat().st_mode) == 0o644
