"""What one worker process costs to start, and what each role's imports add (the fixed cost every run pays per
worker; it dominates the end-to-end tests on CPU).

    python benchmarks/worker_start.py [--quick]

Measured in this run, each a median over fresh processes:
- ``bare actor``: a Ray actor created on a running local cluster and answering its first call (a worker process
  started by the raylet, Ray imported): the baseline of every row below;
- ``import <role>``: a fresh interpreter importing what a worker of that role imports before it builds anything
  (the worker module, the backend's engine module, the rollout engine's module). vLLM's import is its own row:
  a role without a vLLM rollout (a critic, the hf rollout) must not pay it, nor fsdp the megatron / DeepSpeed
  packages (tests/workers/test_worker_imports.py checks both).
The ratio column is each row against the bare actor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit_results, print_table  # noqa: E402

# what each role's worker imports before building its engines (scaletrain/workers, backends/*)
ROLE_IMPORTS = {
    "actor fsdp + hf rollout": ["scaletrain.workers.actor_rollout_ref", "backends.fsdp.engine", "backends.rollout.hf"],
    "critic fsdp": ["scaletrain.workers.critic", "backends.fsdp.engine"],
    "actor deepspeed": ["scaletrain.workers.actor_rollout_ref", "backends.deepspeed.engine"],
    "actor megatron": ["scaletrain.workers.actor_rollout_ref", "backends.megatron.engine"],
    "vllm (the vllm rollout adds it)": ["vllm"],
}


def import_seconds(modules: list[str]) -> float:
    code = (
        "import time; t = time.perf_counter()\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(time.perf_counter() - t)"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def bare_actor_seconds(repeats: int) -> float:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Bare:
        def ping(self) -> int:
            return os.getpid()

    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        actor = Bare.remote()
        ray.get(actor.ping.remote())
        samples.append(time.perf_counter() - start)
        ray.kill(actor)
    ray.shutdown()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    bare = bare_actor_seconds(repeats)
    rows = [("bare actor start + first call", bare * 1e3, None, "")]
    for role, modules in ROLE_IMPORTS.items():
        seconds = statistics.median(import_seconds(modules) for _ in range(repeats))
        rows.append((f"import {role}", seconds * 1e3, bare * 1e3, "bare actor"))
    print_table(f"worker start ({repeats} fresh processes each, medians)", rows)
    emit_results(rows)


if __name__ == "__main__":
    main()
