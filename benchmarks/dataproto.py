"""DataProto ops on a 1024 x 2048 batch (~112 MiB) and a Ray round trip, against an in-process copy.

    python benchmarks/dataproto.py [--quick]

The baseline for the transport rows is a plain in-process copy (clone) of the same tensors: the floor for
moving the bytes once. A Ray put+get copies them into the object store and out again (twice the floor).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import batch_bytes, emit_results, make_batch, median_ms, print_table  # noqa: E402
from scaletrain.protocol import DataProto, padded_shares  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="256 x 512 batch, fewer repeats")
    args = parser.parse_args()
    rows, seq = (256, 512) if args.quick else (1024, 2048)
    reps = 3 if args.quick else 7
    torch.set_num_threads(1)
    data = make_batch(rows, seq)
    mib = batch_bytes(data) / 2**20
    perm = torch.randperm(rows)
    chunks = data.chunk(4)
    other = data.select(["old_log_probs"], deepcopy=True)

    targets = {k: torch.empty_like(v) for k, v in data.batch.items()}

    def copy_all() -> None:
        for k, v in data.batch.items():
            targets[k].copy_(v)

    copy_ms = median_ms(copy_all, reps)
    results = [("in-process copy (memcpy)", copy_ms, None, "")]
    ops = {
        "from_dict": lambda: DataProto.from_dict(dict(data.batch.items()), data.non_tensor_batch),
        "slice [:512]": lambda: data[: rows // 2],
        "select_idxs (permutation)": lambda: data.select_idxs(perm),
        "select 3 keys": lambda: data.select(["input_ids", "attention_mask", "advantages"]),
        "union (shared key)": lambda: data.select().union(other),
        "chunk(4)": lambda: data.chunk(4),
        "split(256)": lambda: data.split(256),
        "concat 4 chunks": lambda: DataProto.concat(chunks),
        "repeat(2, interleave)": lambda: data.repeat(2),
        "reorder (permutation)": lambda: data.select().reorder(perm),
        "make_iterator pass (mb 256)": lambda: list(data.make_iterator(rows // 4, seed=0)),
        "padded_shares(3)": lambda: padded_shares(data, 3),
        "pickle5 out-of-band round trip": lambda: _pickle_round_trip(data),
    }
    for name, fn in ops.items():
        ms = median_ms(fn, reps)
        copies = name in ("select_idxs (permutation)", "concat 4 chunks", "pickle5 out-of-band round trip")
        results.append((name, ms, copy_ms if copies else None, "in-process copy"))

    results += _ray_rows(data, reps, copy_ms)
    print_table(f"DataProto, {rows} x {seq}, {mib:.0f} MiB of tensors + a string column", results)
    emit_results([(f"DataProto {r[0]}", *r[1:]) for r in results])


def _pickle_round_trip(data: DataProto) -> DataProto:
    buffers: list = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=buffers)


def _ray_rows(data: DataProto, reps: int, copy_ms: float) -> list:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, object_store_memory=1500 * 2**20, logging_level="ERROR"
    )

    @ray.remote
    class Echo:
        def echo(self, d):
            return d

    echo = Echo.remote()
    ray.get(echo.echo.remote(None))
    put_get = median_ms(lambda: ray.get(ray.put(data)), reps)
    to_actor = median_ms(lambda: ray.get(echo.echo.remote(data)), reps)
    ray.shutdown()
    return [
        ("ray put + get (driver)", put_get, copy_ms, "in-process copy"),
        ("ray actor echo round trip", to_actor, copy_ms, "in-process copy"),
    ]


if __name__ == "__main__":
    main()
