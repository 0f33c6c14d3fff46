"""A DP_COMPUTE_PROTO worker-group call against raw Ray actor calls on pre-split data. Target: <= 1.1x.

    python benchmarks/dispatch.py [--quick] [--workers N]

Both sides run the same method body on the same actors' kind: it reads the share and returns a (rows, seq)
float32 "log-prob" DataProto. The raw side gets the shares already split and only calls, waits and
concatenates; the worker-group side also splits (with padding bookkeeping) and checks every worker for failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import batch_bytes, emit_results, make_batch, median_ms, print_table  # noqa: E402
from scaletrain.controller import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register  # noqa: E402
from scaletrain.protocol import DataProto  # noqa: E402


def _log_probs(data: DataProto) -> DataProto:
    return DataProto.from_dict({"old_log_probs": data.batch["advantages"] * 0.5})


class LogProbWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return _log_probs(data)


@ray.remote
class RawActor:
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return _log_probs(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="256 x 512 batch, fewer repeats")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rows, seq = (256, 512) if args.quick else (1024, 2048)
    reps = 5 if args.quick else 9
    n = args.workers
    data = make_batch(rows, seq).select(["input_ids", "attention_mask", "responses", "advantages"])
    ray.init(
        address="local",
        num_cpus=max(2, n),
        include_dashboard=False,
        object_store_memory=1500 * 2**20,
        logging_level="ERROR",
    )

    pool = RayResourcePool([n], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(LogProbWorker))
    raw = [RawActor.options(num_cpus=0).remote() for _ in range(n)]
    shares = data.chunk(n)

    def raw_call() -> DataProto:
        return DataProto.concat(ray.get([a.compute_log_prob.remote(s) for a, s in zip(raw, shares)]))

    def group_call() -> DataProto:
        return group.compute_log_prob(data)

    assert torch.equal(raw_call().batch["old_log_probs"], group_call().batch["old_log_probs"])
    # interleave the two measurements so machine noise hits both alike
    ours, base = [], []
    for _ in range(3):
        base.append(median_ms(raw_call, reps))
        ours.append(median_ms(group_call, reps))
    ours_ms, base_ms = sorted(ours)[1], sorted(base)[1]
    mib = batch_bytes(data) / 2**20
    print_table(
        f"dispatch, {n} workers, {rows} x {seq} batch ({mib:.0f} MiB in, {mib / 4:.0f} MiB out)",
        [("DP_COMPUTE_PROTO group call", ours_ms, base_ms, "raw Ray calls on pre-split data")],
    )
    print(f"target <= 1.10x: {'met' if ours_ms / base_ms <= 1.10 else 'NOT met'}")
    emit_results([("dispatch DP_COMPUTE_PROTO group call", ours_ms, base_ms, "raw Ray calls on pre-split data")])
    ray.shutdown()


if __name__ == "__main__":
    main()
