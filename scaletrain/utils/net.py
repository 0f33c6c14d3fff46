"""Networking helpers shared by every layer: a free TCP port for a torch.distributed rendezvous, the address of
one on the calling Ray node, and the environment of one rank of a process group launched on this machine
(multi-rank tests and benchmarks). Imports nothing heavy: a Ray task runs ``rendezvous_address`` before any
worker of a group has imported torch."""

from __future__ import annotations

import os
import random
import socket

# Ray's own listening ports (GCS 6379, its workers 10002-19999 by default) lie below this
LOWEST = 20000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux: ``ip_local_port_range``; elsewhere its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port no process is listening on at the moment of the call, for a torch.distributed rendezvous that
    binds it a little later. Chosen at random below the kernel's ephemeral range: every outgoing connection on the
    machine (Ray's many) takes a port from that range, so a port picked there can be taken before the caller binds
    it (seen: EADDRINUSE in a rank's init_process_group); below it only another explicit bind can. It binds the
    wildcard address, so the port is free on every interface: the rendezvous may be on the node's own IP (Ray
    workers) or on 127.0.0.1. Falls back to any free port when that range is too small or full."""
    low = ephemeral_ports()[0]
    rng = random.SystemRandom()
    if low - LOWEST >= 1000:
        for _ in range(64):
            port = rng.randrange(LOWEST, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def rendezvous_address() -> tuple[str, str]:
    """(this node's IP, a free port on it) for a process group's MASTER_ADDR and MASTER_PORT: a worker group runs it
    as a small Ray task on the node of its rank 0 (controller/ray_worker_group.py), so every rank can be started at
    once, told the address, instead of after rank 0 has started and picked it."""
    import ray

    return ray.util.get_node_ip_address(), str(free_port())


def local_rank_env(rank: int, world: int, port: int, pythonpath: str) -> dict[str, str]:
    """This process's environment plus what rank ``rank`` of a ``world``-process torch.distributed group on this
    machine needs (rendezvous on 127.0.0.1:``port``, one OpenMP thread), with ``pythonpath`` first on the path."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": pythonpath + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
