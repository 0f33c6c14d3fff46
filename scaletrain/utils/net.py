"""Networking helpers shared by every layer: a free TCP port for a torch.distributed rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port no process is listening on at the moment of the call. It binds the wildcard address, so the port
    is free on every interface: the rendezvous may be on the node's own IP (Ray workers) or on 127.0.0.1. Another
    process may still take it before the caller binds it; callers that race retry or accept that."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
