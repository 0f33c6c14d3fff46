"""The Ray cluster of one run (layer 4): joined or started from verl's ``ray_kwargs``, and left as it was found.

``ray_cluster(ray_kwargs, world_size, device)`` wraps a run:

- this process is already connected to Ray (a caller's cluster, e.g. the test suite's one per session): the run
  uses it and leaves it connected; ``ray_init`` keys that only a new connection could apply are logged as ignored;
- ``ray_init.address`` is set (``auto`` or ``HOST:PORT``): the driver joins that cluster, with Ray's auth token
  from the environment or ``~/.ray`` (launch/run.sh makes one per job), and only disconnects at the end: a cluster
  this run did not start keeps running;
- otherwise a private local cluster (``address="local"``: never a stale or foreign one by accident), shut down at
  the end. Ray's token authentication stays on (since Ray 2.59 its ports listen on every interface, so without it
  anyone reaching them could run code as this user), with a fresh token of the run's own in a 0600 file, not
  Ray's per-user ``~/.ray/auth_token`` (scaletrain/utils/ray_token.py); a token the user exported is used as given.
  Its GCS server, raylet and log monitor lead process groups of their own, so that a preemption signal to the
  run's process group reaches the driver and not them (``children_in_a_process_group_of_their_own``).

Before leaving, ``timeline_json_file`` receives the cluster's Ray timeline (chrome://tracing JSON).
``ray_kwargs.ray_init.runtime_env`` is merged over the run log's (console.py): ``env_vars`` key by key, null
values dropped (verl's ``py_executable: null`` means Ray's default interpreter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from scaletrain.trainer.config.ppo_config import RayInitConfig, RayKwargsConfig
from scaletrain.trainer.memory_plan import STORE_FLOOR
from scaletrain.utils.ray_token import private_cluster_token
from scaletrain.utils.typed_config import ConfigError

logger = logging.getLogger(__name__)

# what only a cluster started here takes: Ray refuses them when connecting to a running one
NEW_CLUSTER_ONLY = (
    "num_cpus",
    "num_gpus",
    "object_store_memory",
    "resources",
    "include_dashboard",
    "dashboard_host",
    "dashboard_port",
)


def check_ray_kwargs(ray_kwargs: RayKwargsConfig, section: str = "ray_kwargs") -> None:
    """Before anything starts: keys a joined cluster cannot take, named (Ray's own error names none)."""
    ri = ray_kwargs.ray_init
    if ri.address and ri.address != "local":
        given = [k for k in NEW_CLUSTER_ONLY if getattr(ri, k) != getattr(RayInitConfig(), k)]
        if given:
            raise ConfigError(
                f"{section}.ray_init.{given[0]}: only a cluster started by this run takes it, and "
                f"{section}.ray_init.address={ri.address} joins a running one (set it on `ray start` there, "
                "or drop the address)"
            )
    if not isinstance(ri.runtime_env.get("env_vars", {}), dict):
        raise ConfigError(f"{section}.ray_init.runtime_env.env_vars: expected a mapping of names to values")


def merged_runtime_env(ours: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """``user`` over ``ours``: env_vars merged by name, null values (and an emptied env_vars) dropped."""
    env = {**ours, **{k: v for k, v in user.items() if v is not None}}
    env_vars = {**ours.get("env_vars", {}), **(user.get("env_vars") or {})}
    env_vars = {k: str(v) for k, v in env_vars.items() if v is not None}
    env.pop("env_vars", None)
    return {**env, "env_vars": env_vars} if env_vars else env


def ray_init_arguments(ri: RayInitConfig, world_size: int, device: str) -> dict[str, Any]:
    """The ``ray.init`` keyword arguments of a new connection (console.py's logging set-up included)."""
    from scaletrain.trainer.run.console import ray_init_kwargs

    kwargs = ray_init_kwargs()
    runtime_env = merged_runtime_env(kwargs.pop("runtime_env", {}), ri.runtime_env)
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if ri.namespace:
        kwargs["namespace"] = ri.namespace
    if ri.address and ri.address != "local":
        return {**kwargs, "address": ri.address}
    kwargs.update(
        address="local",
        num_cpus=ri.num_cpus or max(world_size * 2, os.cpu_count() or 1),
        object_store_memory=ri.object_store_memory or STORE_FLOOR,
        include_dashboard=ri.include_dashboard,
    )
    num_gpus = 0 if device == "cpu" and ri.num_gpus is None else ri.num_gpus
    optional = {"num_gpus": num_gpus, "resources": ri.resources or None}
    optional.update(dashboard_host=ri.dashboard_host, dashboard_port=ri.dashboard_port)
    return {**kwargs, **{k: v for k, v in optional.items() if v is not None}}


@contextlib.contextmanager
def ray_cluster(ray_kwargs: RayKwargsConfig, world_size: int, device: str) -> Iterator[None]:
    """The run's Ray connection for the ``with`` block: reused, joined or started, as the module docstring says."""
    import ray

    connected = ray.is_initialized()
    with contextlib.ExitStack() as stack:
        if connected:
            _log_ignored(ray_kwargs.ray_init)
        else:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            kwargs = ray_init_arguments(ray_kwargs.ray_init, world_size, device)
            if kwargs["address"] == "local":  # a cluster of this run alone: a token of its own, gone with it
                stack.enter_context(private_cluster_token())
                with children_in_a_process_group_of_their_own():
                    ray.init(**kwargs)
            else:
                ray.init(**kwargs)
        try:
            yield
        finally:
            if ray_kwargs.timeline_json_file:
                ray.timeline(filename=ray_kwargs.timeline_json_file)
                logger.info("Ray timeline of the run: %s", ray_kwargs.timeline_json_file)
            if not connected:  # a joined cluster keeps running: shutdown only disconnects this driver from it
                ray.shutdown()


_SEPARATE_CHILDREN = threading.Event()


def _leave_the_parents_process_group() -> None:
    if _SEPARATE_CHILDREN.is_set():
        os.setpgid(0, 0)


@functools.cache
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_leave_the_parents_process_group)


@contextlib.contextmanager
def children_in_a_process_group_of_their_own() -> Iterator[None]:
    """Children started in the block through a Python-level fork (``subprocess.Popen`` with a ``preexec_fn``,
    ``os.fork``) lead a process group of their own.

    ``ray.init`` starts the private cluster's GCS server, raylet and log monitor in the driver's process group, so
    a signal to the group (``kill -TERM -PGID``, systemd's stop) used to stop them along with the driver: the
    step in progress lost its objects and the driver waited out Ray's 60 s reconnection deadline, then exited 1.
    Outside the group they keep serving while the driver finishes its step, checkpoints and exits 0
    (preemption.py); they still die with the driver (Ray sets their parent-death signal) and with its shutdown.
    Ray starts them through ``subprocess.Popen`` with a ``preexec_fn``, so the child runs Python's after-fork
    hooks (``os.register_at_fork``) before exec; that is where each one moves to a group of its own.
    """
    _register_fork_hook()
    _SEPARATE_CHILDREN.set()
    try:
        yield
    finally:
        _SEPARATE_CHILDREN.clear()


def _log_ignored(ri: RayInitConfig) -> None:
    ignored = [f.name for f in dataclasses.fields(RayInitConfig)]
    ignored = [k for k in ignored if getattr(ri, k) != getattr(RayInitConfig(), k)]
    if ignored:
        logger.warning("this process is already connected to Ray: ray_kwargs.ray_init.%s ignored", ", ".join(ignored))
