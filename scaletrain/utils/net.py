"""Networking helpers shared by every layer: a free TCP port for a torch.distributed rendezvous, and the
environment of one rank of a process group launched on this machine (multi-rank tests and benchmarks)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port no process is listening on at the moment of the call. It binds the wildcard address, so the port
    is free on every interface: the rendezvous may be on the node's own IP (Ray workers) or on 127.0.0.1. Another
    process may still take it before the caller binds it; callers that race retry or accept that."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


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
