"""verl's ``ray_kwargs``: how a run gets its Ray cluster (scaletrain/trainer/run/ray_cluster.py).

The arguments a new connection passes to ``ray.init``, the keys a joined cluster cannot take, verl's command-line
forms of the section; then, for real: a run that joins a running, token-protected cluster given by
``ray_kwargs.ray_init.address`` (started here with ``ray start --head``, as launch/run.sh does on SLURM) trains,
writes the Ray timeline, frees its actors and placement groups, and leaves that cluster running.
"""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaletrain.trainer.config.ppo_config import RayInitConfig, RayKwargsConfig
from scaletrain.trainer.main_ppo import verl_overrides
from scaletrain.trainer.run.ray_cluster import check_ray_kwargs, merged_runtime_env, ray_init_arguments
from scaletrain.utils.typed_config import ConfigError
from tests.trainer.runs import ROOT, env, ppo_overrides


def test_a_private_cluster_gets_the_configured_resources_and_runtime_env():
    ri = RayInitConfig(
        num_cpus=6,
        object_store_memory=300 << 20,
        resources={"judge": 2.0},
        namespace="exp1",
        runtime_env={"py_executable": None, "env_vars": {"MY_FLAG": 1}, "working_dir": None},
    )
    kwargs = ray_init_arguments(ri, world_size=2, device="cpu")
    assert kwargs["address"] == "local" and kwargs["num_cpus"] == 6 and kwargs["num_gpus"] == 0
    assert kwargs["object_store_memory"] == 300 << 20 and kwargs["resources"] == {"judge": 2.0}
    assert kwargs["namespace"] == "exp1" and kwargs["include_dashboard"] is False
    hook = "scaletrain.trainer.run.console.setup_worker_process"  # every worker process's set-up (console.py)
    # null values dropped: Ray's defaults
    assert kwargs["runtime_env"] == {"worker_process_setup_hook": hook, "env_vars": {"MY_FLAG": "1"}}
    defaults = ray_init_arguments(RayInitConfig(), world_size=8, device="cuda")
    assert defaults["num_cpus"] >= 16 and "num_gpus" not in defaults  # Ray counts the GPUs


def test_a_joined_cluster_gets_only_the_address_and_the_connection_settings():
    ri = RayInitConfig(address="auto", namespace="exp1", runtime_env={"env_vars": {"A": "1"}})
    kwargs = ray_init_arguments(ri, world_size=2, device="cpu")
    assert kwargs["address"] == "auto" and kwargs["namespace"] == "exp1"
    assert not {"num_cpus", "num_gpus", "object_store_memory", "resources", "include_dashboard"} & set(kwargs)


def test_the_users_runtime_env_goes_over_the_run_logs():
    ours = {"worker_process_setup_hook": "m.hook", "env_vars": {"LOG": "/run.log", "V": "0"}}
    user = {"env_vars": {"V": "1", "X": "y", "LOG": None}, "py_executable": None, "pip": ["six"]}
    assert merged_runtime_env(ours, user) == {
        "worker_process_setup_hook": "m.hook",
        "pip": ["six"],
        "env_vars": {"V": "1", "X": "y"},
    }
    assert merged_runtime_env({}, {"py_executable": None}) == {}


@pytest.mark.parametrize("key, value", [("num_cpus", 8), ("num_gpus", 1), ("resources", {"a": 1.0})])
def test_new_cluster_keys_with_an_address_are_refused_naming_the_key(key, value):
    ri = RayInitConfig(address="10.0.0.1:6379", **{key: value})
    with pytest.raises(ConfigError, match=rf"ray_kwargs\.ray_init\.{key}: only a cluster started by this run"):
        check_ray_kwargs(RayKwargsConfig(ray_init=ri))
    check_ray_kwargs(RayKwargsConfig(ray_init=RayInitConfig(address="local", **{key: value})))  # a new one: fine


def test_verl_forms_of_the_section():
    assert verl_overrides(
        [
            "ray_kwargs.ray_init.runtime_env.py_executable=null",  # verl's examples, as they are
            "+ray_kwargs.ray_init.num_gpus=8",
            "+ray_kwargs.ray_init.runtime_env.env_vars.FLAG=1",
            "ray_init.num_cpus=4",  # verl's older top-level section
            "ray_init.timeline_json_file=/tmp/t.json",
        ]
    ) == [
        "++ray_kwargs.ray_init.runtime_env.py_executable=null",
        "ray_kwargs.ray_init.num_gpus=8",
        "++ray_kwargs.ray_init.runtime_env.env_vars.FLAG=1",
        "ray_kwargs.ray_init.num_cpus=4",
        "ray_kwargs.timeline_json_file=/tmp/t.json",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def running_cluster(tmp_path):
    """A Ray head started with `ray start --head --block` (token auth, as launch/run.sh does), in its own process
    group, killed at the end with that group only (``ray stop`` would stop every cluster here)."""
    token = secrets.token_hex(32)
    cluster_env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
    cluster_env.pop("RAY_AUTH_TOKEN_PATH", None)  # the session's own token (conftest.py): this cluster's is the job's
    port = free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1"]
        + ["--num-cpus=6", "--num-gpus=0", f"--object-store-memory={400 << 20}", "--include-dashboard=false"],
        env=cluster_env,
        stdout=open(tmp_path / "head.log", "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(
            [str(ray_bin), "health-check", "--address", address], env=cluster_env, capture_output=True
        ).returncode:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(1)
        yield address, cluster_env
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head's GCS, raylet and workers: its process group
        head.wait()


PROBE = """
import json, sys
import ray
from tests.ray_state import alive_actors, placed_groups
ray.init(address=sys.argv[1], logging_level="ERROR")
alive, placed = list(alive_actors().values()), list(placed_groups().values())
print(json.dumps({"task": ray.get(ray.remote(lambda: 41 + 1).remote()), "alive": alive, "placed": placed}))
"""


@pytest.mark.slow
def test_a_run_joins_a_running_cluster_and_leaves_it_running(task, tmp_path, running_cluster):  # noqa: F811
    address, cluster_env = running_cluster
    timeline = tmp_path / "timeline.json"
    # the run's own overrides, without command()'s private-cluster size: the joined cluster has its own resources
    args = [sys.executable, "-m", "scaletrain.trainer.main_ppo"]
    args += ppo_overrides(task, tmp_path / "run", 1, ["trainer.val_before_train=false", "trainer.test_freq=-1"])
    args += [
        f"ray_kwargs.ray_init.address={address}",
        "ray_kwargs.ray_init.runtime_env.py_executable=null",  # verl's examples pass these
        "+ray_kwargs.ray_init.runtime_env.env_vars.SCALETRAIN_TEST=1",
        f"ray_kwargs.timeline_json_file={timeline}",
    ]
    out = subprocess.run(args, env={**env(), **cluster_env}, timeout=400, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "1"
    phases = {e.get("name") for e in json.loads(timeline.read_text())}  # the workers' calls, in chrome's format
    assert {"actor_rollout_generate_sequences", "actor_rollout_update_actor"} <= phases, sorted(phases)[:20]

    probe = subprocess.run(
        [sys.executable, "-c", PROBE, address],
        env={**env(), **cluster_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    state = json.loads(probe.stdout.strip().splitlines()[-1])
    assert state["task"] == 42, "the cluster the run joined still runs"
    # nothing of the run is left there (its driver's exit would free its actors too: test_in_process_runs.py
    # proves a run frees them itself)
    assert state["alive"] == [] and state["placed"] == [], state

    # and without the token, the same address is refused (the run used the one in its environment)
    no_token = {k: v for k, v in cluster_env.items() if k != "RAY_AUTH_TOKEN"}
    refused = subprocess.run(
        [sys.executable, "-c", PROBE, address],
        env={**env(), **no_token, "HOME": str(tmp_path)},
        capture_output=True,
        timeout=120,
    )
    assert refused.returncode != 0
