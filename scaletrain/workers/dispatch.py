"""Dispatch modes of the role workers (layer 2): route calls by the place each engine declares.

After building its engine a role worker declares its place in mesh "engine" (DP rank, DP size, whether its
output is kept: every rank for FSDP / ZeRO-3; TP rank 0 of the last PP stage for Megatron), and the rollout
engine its place in mesh "rollout". The modes below split batches over those DP ranks, so one worker class
serves every backend without knowing which it runs.
"""

from __future__ import annotations

from scaletrain.controller import (
    ENGINE_MESH,
    ROLLOUT_MESH,
    make_mesh_collect,
    make_mesh_dispatch,
    register_dispatch_mode,
)

ENGINE_PROTO = "ENGINE_COMPUTE_PROTO"  # DataProto in, DataProto out (log-probs, values)
ENGINE_METRIC = "ENGINE_COMPUTE_METRIC"  # DataProto in, one metrics dict per kept rank out (updates)
ROLLOUT_PROTO = "ROLLOUT_COMPUTE_PROTO"  # prompts in, sequences out
ROLLOUT_TOKENS = "ROLLOUT_TOKENS"  # one list of token requests per rollout DP rank in, one list out each

register_dispatch_mode(
    ENGINE_PROTO, make_mesh_dispatch(ENGINE_MESH, proto=True), make_mesh_collect(ENGINE_MESH, proto=True)
)
register_dispatch_mode(
    ENGINE_METRIC, make_mesh_dispatch(ENGINE_MESH, proto=True), make_mesh_collect(ENGINE_MESH, proto=False)
)
register_dispatch_mode(
    ROLLOUT_PROTO, make_mesh_dispatch(ROLLOUT_MESH, proto=True), make_mesh_collect(ROLLOUT_MESH, proto=True)
)

register_dispatch_mode(
    ROLLOUT_TOKENS, make_mesh_dispatch(ROLLOUT_MESH, proto=False), make_mesh_collect(ROLLOUT_MESH, proto=False)
)


PEAK_METRICS = "perf/max_memory"  # peaks (backends.dist.peak_memory_metrics): the largest rank's, not the mean


def reduce_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the ranks that reported it (the maximum for the peak-memory ones)."""
    keys = {k for m in per_rank for k in m}
    reduced = {}
    for k in sorted(keys):
        values = [m[k] for m in per_rank if k in m]
        reduced[k] = max(values) if k.startswith(PEAK_METRICS) else sum(values) / len(values)
    return reduced


def declare_engine_mesh(worker, engine) -> None:
    """Declare ``worker``'s place in mesh "engine" from its training engine (the ENGINE_* modes route by it)."""
    worker.register_mesh(ENGINE_MESH, engine.dp_rank, engine.dp_size, engine.collects_output)
