"""Split placement's weight push: the collective push group against its floor and against the object store.

    python benchmarks/weight_push.py [--quick]     # --quick: 160 MiB, 3 repeats

One sender (the trainer's export rank) and two receivers (rollout ranks), each a Ray actor (its own process), the
same buckets of HF-named tensors in every variant (``--bucket-mib``), medians of the driver-side wall time:
- floor: one gloo broadcast per bucket of the same bytes, packed already, into preallocated buffers;
- collective push (``checkpoint_engine.backend=nccl``, gloo here): ``send_buckets`` / ``ReceivedPush`` of
  scaletrain/controller/weight_transport.py, by each lane: shared memory (the receivers share the sender's node,
  as here: the default) and broadcast (``engine_kwargs.nccl.same_node=broadcast``: what a receiver on another
  node gets); the transport alone (the receivers drain the buckets), then with the receivers copying every tensor
  into their own preallocated tensors (what an engine's load does; the next bucket is received while one is
  copied);
- object store (``naive``): ``put_buckets`` by the sender, then ``read_buckets`` and the same copies by each
  receiver (the export first, then the loads).
Also printed: the bytes each push leaves in Ray's object store meanwhile (the whole model for the store, none for
the collective). Measured twice, each on a fresh private cluster: with a store the model fits in (on one node the
store is shared memory: a put is one copy, a read none), and with a store half the model's size (a trainer's
private cluster has 1 GiB: any larger model spills to disk on every push). Targets: the collective's transport
<= 1.3x the floor, and the collective push (with its loads) faster than the object store's, on this node.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import emit_results, median_ms, print_table  # noqa: E402
from scaletrain.controller.push_lanes import RING  # noqa: E402


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

    def collective(self, channel, load: bool) -> int:
        """``load``: each receiver copies every tensor into its own (an engine's load); else it only drains."""
        from scaletrain.controller.weight_transport import ReceivedPush, send_buckets

        if self.rank == 0:
            return send_buckets(channel, iter(self.buckets), None)
        push = ReceivedPush(channel, self.rank - 1)
        for bucket, dest in zip(push.buckets, self.dest):
            for (_, tensor), out in zip(bucket, dest):
                if load:
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


def measure(total: int, bucket_mib: int, receivers: int, store_mib: int, reps: int) -> dict[str, float]:
    """Every variant's median ms on a fresh private Ray cluster whose object store holds ``store_mib`` MiB."""
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=store_mib * 2**20,
        logging_level="ERROR",
        log_to_driver=False,
    )
    from scaletrain.controller.weight_transport import WeightChannel

    try:
        members = [Member.remote(r, total, bucket_mib) for r in range(1 + receivers)]
        channels = {}
        for lane in ("shm", "broadcast"):
            host, port = ray.get(members[0].open.remote())
            channels[lane] = WeightChannel(host, port, len(members), same_node=lane)
            ray.get([m.join.remote(channels[lane]) for m in members])
        channel = channels["broadcast"]

        def push(lane: str, load: bool) -> float:
            return median_ms(lambda: ray.get([m.collective.remote(channels[lane], load) for m in members]), reps)

        def store() -> None:
            weights = ray.get(members[0].put.remote())
            ray.get([m.read.remote(weights) for m in members[1:]])
            del weights  # its buckets leave the store with their last reference

        return {
            "floor": median_ms(lambda: ray.get([m.floor.remote(channel) for m in members]), reps),
            "collective": push("broadcast", False),
            "loaded": push("broadcast", True),
            "shm": push("shm", False),
            "shm loaded": push("shm", True),
            "store": median_ms(store, reps),
        }
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="160 MiB, 3 repeats")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--receivers", type=int, default=2)
    args = parser.parse_args()
    total, reps = (160, 3) if args.quick else (256, 7)  # 160: half of it is the smallest store Ray takes
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    roomy = measure(total, args.bucket_mib, args.receivers, max(2 * total + 4 * args.bucket_mib, 256), reps)
    small = measure(total, args.bucket_mib, args.receivers, max(total // 2, 80), reps)  # the model does not fit
    print(
        f"\n{total} MiB in {total // args.bucket_mib} buckets of {args.bucket_mib} MiB, 1 sender -> "
        f"{args.receivers} receivers (gloo, one node); object store bytes during a push: store {total} MiB, "
        f"collective 0; /dev/shm: the shared-memory lane's {RING} slots, {RING * args.bucket_mib} MiB"
    )
    table = [
        ("raw broadcast of the same bytes", roomy["floor"], None, ""),
        ("collective push, broadcast lane, transport alone", roomy["collective"], roomy["floor"], "broadcast"),
        ("collective push, shared-memory lane, transport alone", roomy["shm"], roomy["floor"], "broadcast"),
        ("collective push + loads, broadcast lane", roomy["loaded"], None, ""),
        ("collective push + loads, shared-memory lane", roomy["shm loaded"], None, ""),
        ("object store push + loads, the model fits", roomy["store"], roomy["shm loaded"], "collective + loads"),
        ("collective push + loads, shared-memory lane (small store)", small["shm loaded"], None, ""),
        ("object store push + loads, store half the model", small["store"], small["shm loaded"], "collective + loads"),
    ]
    print_table(f"split placement's weight push (median of {reps})", table)
    emit_results([(f"weight push {r[0]}", *r[1:]) for r in table])


if __name__ == "__main__":
    main()
