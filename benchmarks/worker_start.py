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
- ``collector``: the CPU seconds of importing an actor's modules with vLLM and starting a vLLM engine on the
  embedded default's tiny model (the work a vLLM-rollout worker does before its first step), with Python's
  default collector thresholds and with the setup every worker process of a run gets
  (``scaletrain/utils/gc_tuning.py``: fewer young collections, the imported heap frozen before vLLM starts).
The ratio column is each row against its baseline (the bare actor; the default collector).
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


ENGINE_START = """
import time
if TUNED:
    from scaletrain.utils.gc_tuning import start_process
    start_process()
import scaletrain.workers.actor_rollout_ref, backends.deepspeed.engine, vllm
from backends.rollout.base import RolloutConfig
from backends.rollout.vllm_engine import VLLMRolloutEngine
import scaletrain.controller.worker as worker
if not TUNED:  # the default: no heap settled by the worker's start nor before vLLM's
    import backends.rollout.vllm_engine as vllm_engine
    worker.settle = vllm_engine.settle = lambda: None
worker.Worker()
config = RolloutConfig(model_path=MODEL, max_model_len=64, seed=0)
engine = VLLMRolloutEngine(config, None)
print(time.process_time())
"""


def engine_start_cpu_seconds(model: str, tuned: bool) -> float:
    """CPU seconds of a fresh process importing a vLLM-rollout actor's modules and starting its engine."""
    code = f"TUNED = {tuned}\nMODEL = {model!r}\n" + ENGINE_START
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def collector_rows(repeats: int) -> list[tuple]:
    """The collector's rows: default thresholds against the workers' setup, alternating fresh processes."""
    from scaletrain.data import build_embedded_default

    model = build_embedded_default()["model"]
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for tuned in (False, True):
            samples[tuned].append(engine_start_cpu_seconds(model, tuned))
    default, tuned = (statistics.median(samples[t]) for t in (False, True))
    return [
        ("collector: imports + vLLM engine, Python's default (CPU ms)", default * 1e3, None, ""),
        ("collector: imports + vLLM engine, the workers' setup (CPU ms)", tuned * 1e3, default * 1e3, "default"),
    ]


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
    rows += collector_rows(repeats)
    print_table(f"worker start ({repeats} fresh processes each, medians)", rows)
    emit_results(rows)


if __name__ == "__main__":
    main()
