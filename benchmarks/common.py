"""Shared benchmark helpers: median timing, the standard test batch, and a result table printer."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from scaletrain.protocol import DataProto


def median_ms(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_batch(rows: int = 1024, seq: int = 2048) -> DataProto:
    """~112 MiB at 1024 x 2048: five int64 and four float32 (rows, seq) tensors plus a string column."""
    g = torch.Generator().manual_seed(0)
    ints = {
        k: torch.randint(0, 32000, (rows, seq), generator=g)
        for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    }
    floats = {
        k: torch.randn(rows, seq, generator=g) for k in ("old_log_probs", "ref_log_prob", "advantages", "returns")
    }
    sources = np.array([f"source_{i % 7}" for i in range(rows)], dtype=object)
    return DataProto.from_dict({**ints, **floats}, {"data_source": sources}, {"temperature": 1.0})


def batch_bytes(data: DataProto) -> int:
    return sum(t.numel() * t.element_size() for t in data.batch.values())


def print_table(title: str, rows: list[tuple[str, float, float | None, str]]) -> None:
    """rows: (measure, ours ms, baseline ms or None, baseline name)."""
    w = max([34] + [len(row[0]) + 2 for row in rows])
    print(f"\n{title}")
    print(f"{'measure':<{w}}{'ours ms':>10}{'baseline ms':>13}  {'ratio':>7}  baseline")
    for name, ours, base, base_name in rows:
        if base is None:
            print(f"{name:<{w}}{ours:>10.2f}{'':>13}  {'':>7}")
        else:
            print(f"{name:<{w}}{ours:>10.2f}{base:>13.2f}  {ours / base:>6.2f}x  {base_name}")


def emit_results(rows: list, unit: str = "ms") -> None:
    """Print one ``BENCH_JSON {...}`` line for ``benchmarks/run_all.py`` to collect.

    rows: ``print_table`` tuples (measure, ours, baseline or None, baseline name) or dicts with those keys.
    ratio = ours / baseline (None without a baseline).
    """
    out = []
    for row in rows:
        if isinstance(row, dict):
            row = (row["measure"], row["ours"], row.get("baseline"), row.get("baseline_name", ""), row.get("unit"))
        name, ours, base, base_name, *rest = row
        ours = None if ours is None else float(ours)
        base = None if base is None else float(base)
        out.append(
            {
                "measure": name.strip(),
                "ours": ours,
                "baseline": base,
                "baseline_name": base_name,
                "ratio": ours / base if ours is not None and base else None,
                "unit": (rest[0] if rest and rest[0] else unit),
            }
        )
    print("BENCH_JSON " + json.dumps({"rows": out}), flush=True)
