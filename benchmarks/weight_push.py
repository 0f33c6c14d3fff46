"""Split placement's weight push: the collective push group against its floor and against the object store.

    python benchmarks/weight_push.py [--quick]     # --quick: 64 MiB, 3 repeats

One sender (the trainer's export rank) and two receivers (rollout ranks), each a Ray actor (its own process), the
same buckets of HF-named tensors in every variant (``--bucket-mib``), medians of the driver-side wall time:
- floor: one gloo broadcast per bucket of the same bytes into preallocated buffers, nothing else;
- collective push (``checkpoint_engine.backend=nccl``, gloo here): ``send_buckets`` / ``ReceivedPush`` of
  scaletrain/controller/weight_transport.py, each receiver copying every tensor into its own preallocated tensor
  (what an engine's load does), the next bucket received while one is copied;
- object store (``naive``): ``put_buckets`` by the sender, then ``read_buckets`` and the same copies by each
  receiver (the trainer's former path: the export first, then the loads).
Also printed: the bytes each push leaves in Ray's object store meanwhile (the whole model for the store, none for
the collective). Target (issue 38): collective <= 1.3x the floor, and faster than the object store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import emit_results, print_table  # noqa: E402


def make_buckets(total_mib: int, bucket_mib: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Buckets of 4 float32 tensors each, ``bucket_mib`` MiB per bucket, ``total_mib`` MiB in all."""
    per_tensor = bucket_mib * 2**20 // 4 // 4
    g = torch.Generator().manual_seed(0)
    count = total_mib // bucket_mib
    return [[(f"layer{b}.w{i}", torch.randn(per_tensor, generator=g)) for i in range(4)] for b in range(count)]


@ray.remote(num_cpus=0)
class Member:
    """Rank ``rank`` of the push group: 0 sends, the others receive."""

    def __init__(self, rank: int, total_mib: int, bucket_mib: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.buckets = rank, make_buckets(total_mib, bucket_mib)
        self.dest = [[torch.empty_like(t) for _, t in bucket] for bucket in self.buckets]
        self.flats = [torch.cat([t.reshape(-1) for _, t in bucket]) for bucket in self.buckets]  # the floor's

    def open(self) -> tuple[str, int]:
        from scaletrain.controller.weight_transport import open_store

        host = ray.util.get_node_ip_address()
        return host, open_store(host, 300.0)

    def join(self, channel) -> None:
        from scaletrain.controller.weight_transport import _group

        _group(channel, self.rank)

    def floor(self, channel) -> None:
        from scaletrain.controller.weight_transport import _broadcast, _group

        group = _group(channel, self.rank)
        for flat in self.flats:  # the sender's bytes, or a receiver's buffer: preallocated, packed already
            _broadcast(group, flat)

    def collective(self, channel) -> int:
        from scaletrain.controller.weight_transport import ReceivedPush, send_buckets

        if self.rank == 0:
            return send_buckets(channel, iter(self.buckets), None)
        push = ReceivedPush(channel, self.rank - 1)
        for bucket, dest in zip(push.buckets, self.dest):
            for (_, tensor), out in zip(bucket, dest):
                out.copy_(tensor)
        return push.nbytes

    def put(self):
        from scaletrain.controller.weight_transport import put_buckets

        return put_buckets(iter(self.buckets), 1)

    def read(self, weights) -> int:
        from scaletrain.controller.weight_transport import read_buckets

        for bucket, dest in zip(read_buckets(weights), self.dest):
            for (_, tensor), out in zip(bucket, dest):
                out.copy_(tensor)
        return weights.nbytes


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--receivers", type=int, default=2)
    args = parser.parse_args()
    total, reps = (64, 3) if args.quick else (256, 5)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    from scaletrain.controller.weight_transport import WeightChannel

    members = [Member.remote(r, total, args.bucket_mib) for r in range(1 + args.receivers)]
    host, port = ray.get(members[0].open.remote())
    channel = WeightChannel(host, port, len(members))
    ray.get([m.join.remote(channel) for m in members])

    def floor() -> None:
        ray.get([m.floor.remote(channel) for m in members])

    def collective() -> None:
        ray.get([m.collective.remote(channel) for m in members])

    def store() -> None:
        weights = ray.get(members[0].put.remote())
        ray.get([m.read.remote(weights) for m in members[1:]])
        for ref in weights.refs:
            ray.internal.free([ref])

    floor_ms, collective_ms, store_ms = timed(floor, reps), timed(collective, reps), timed(store, reps)
    print(
        f"\n{total} MiB in {total // args.bucket_mib} buckets of {args.bucket_mib} MiB, 1 sender -> "
        f"{args.receivers} receivers (gloo, one node); object store bytes during a push: store {total} MiB, "
        "collective 0"
    )
    table = [
        ("raw broadcast of the same bytes", floor_ms, None, ""),
        ("collective push (send_buckets)", collective_ms, floor_ms, "broadcast"),
        ("object store push (put + read)", store_ms, floor_ms, "broadcast"),
        ("collective push vs object store", collective_ms, store_ms, "store push"),
    ]
    print_table(f"split placement's weight push (median of {reps})", table)
    emit_results([(f"weight push {r[0]}", *r[1:]) for r in table])
    ray.shutdown()


if __name__ == "__main__":
    main()
