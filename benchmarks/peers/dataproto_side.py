"""One side of the DataProto comparison: time every op of benchmarks/dataproto.py on one implementation.

    .venv/bin/python       benchmarks/peers/dataproto_side.py --impl ours [--quick]
    .venv-peers/bin/python benchmarks/peers/dataproto_side.py --impl verl [--quick]

``ours`` is scaletrain.protocol.DataProto, ``verl`` is verl.protocol.DataProto (importable only in .venv-peers).
Both get the same batch (benchmarks.common.make_batch, converted with the class's own from_dict) and the same
calls; the op names are the row keys benchmarks/peers/run.py pairs up. Prints one ``BENCH_JSON`` line whose rows
carry this side's median ms in ``ours`` (no baseline: the driver does the pairing).

verl pickles a DataProto with torch.save by default; ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` (read at every
pickle, verl/protocol.py ``__getstate__``) switches it to numpy buffers, its fast mode. The transport rows run
verl in that mode; one extra row times verl's default mode for context.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import emit_results, make_batch, median_ms  # noqa: E402
from benchmarks.dataproto import _pickle_round_trip, _ray_rows  # noqa: E402

VERL_SERIALIZATION_ENV = "VERL_DATAPROTO_SERIALIZATION_METHOD"
DEFAULT_MODE_ROW = "DataProto pickle5 round trip (verl: default torch.save mode)"


def load_impl(impl: str) -> type:
    if impl == "ours":
        from scaletrain.protocol import DataProto
    else:
        from verl.protocol import DataProto
    return DataProto


def convert(cls: type, rows: int, seq: int):
    """make_batch's batch as an instance of ``cls`` (the same tensors, so both sides time identical data)."""
    ours = make_batch(rows, seq)
    if cls.__module__.startswith("scaletrain"):
        return ours
    return cls.from_dict(dict(ours.batch.items()), dict(ours.non_tensor_batch), dict(ours.meta_info))


def op_table(cls: type, data, prompts) -> dict:
    """Op name -> zero-argument callable; the same calls on either class (their APIs agree on these)."""
    rows = len(data)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    chunks = data.chunk(4)
    other = data.select(["old_log_probs"], deepcopy=True)
    p_rows, p_seq = prompts.batch["input_ids"].shape
    return {
        "from_dict": lambda: cls.from_dict(dict(data.batch.items()), data.non_tensor_batch),
        f"slice [:{rows // 2}]": lambda: data[: rows // 2],
        "select_idxs (permutation)": lambda: data.select_idxs(perm),
        "select 3 keys": lambda: data.select(["input_ids", "attention_mask", "advantages"]),
        # select() first: union works in place, and the shared key makes both check equality (8 MiB compare)
        "union (shared key)": lambda: data.select().union(other),
        "chunk(4)": lambda: data.chunk(4),
        f"split({rows // 4})": lambda: data.split(rows // 4),
        "concat 4 chunks": lambda: cls.concat(chunks),
        "repeat(4, interleave)": lambda: data.repeat(4, interleave=True),
        f"repeat(4, interleave), prompts {p_rows} x {p_seq}": lambda: prompts.repeat(4, interleave=True),
        "reorder (permutation)": lambda: data.select().reorder(perm),
        # in order: verl's iterator never shuffles (its DataLoader has shuffle=False), ours shuffles given a seed
        f"make_iterator pass (mb {rows // 4}, in order)": lambda: list(data.make_iterator(rows // 4, epochs=1)),
        "pickle5 round trip (verl: numpy mode)": lambda: _pickle_round_trip(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("ours", "verl"), required=True)
    parser.add_argument("--quick", action="store_true", help="256 x 512 batch, fewer repeats")
    args = parser.parse_args()
    rows, seq = (256, 512) if args.quick else (1024, 2048)
    reps = 3 if args.quick else 7
    torch.set_num_threads(1)
    if args.impl == "verl":
        os.environ[VERL_SERIALIZATION_ENV] = "numpy"  # before ray.init, so Ray's workers inherit it too
    cls = load_impl(args.impl)
    data = convert(cls, rows, seq)
    prompts = convert(cls, rows // 4, seq // 2)  # the GRPO n=4 pattern: a prompt batch repeated per sample

    results = []
    for name, fn in op_table(cls, data, prompts).items():
        results.append((f"DataProto {name}", median_ms(fn, reps)))
        print(f"{args.impl:>5} {name:<52}{results[-1][1]:>10.2f} ms", flush=True)
    pickle_ms = results[-1][1]
    if args.impl == "verl":
        os.environ.pop(VERL_SERIALIZATION_ENV)
        pickle_ms = median_ms(lambda: _pickle_round_trip(data), reps)
        os.environ[VERL_SERIALIZATION_ENV] = "numpy"
    results.append((DEFAULT_MODE_ROW, pickle_ms))  # ours has one mode: the same figure as the row above

    # _ray_rows' third argument is benchmarks/dataproto.py's copy baseline, unused here
    for name, ms, *_ in _ray_rows(data, reps, 0.0):
        results.append((f"DataProto {name} (verl: numpy mode)", ms))
        print(f"{args.impl:>5} {name:<52}{ms:>10.2f} ms", flush=True)
    emit_results([(name, ms, None, "") for name, ms in results])


if __name__ == "__main__":
    main()
