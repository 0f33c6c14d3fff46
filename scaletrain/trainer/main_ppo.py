"""Entry point: ``python -m scaletrain.trainer.main_ppo [hydra overrides]`` (layer 4).

Composes configs/ppo_trainer.yaml with the overrides (verl's command-line forms translated first: verl_compat.py),
builds and validates the typed config before Ray starts, fills null model/data paths with the embedded default,
then trains and writes the run's outputs (metrics, checkpoints, an HF export, curves). The console shows our own
lines (a progress bar per phase, step lines, warnings); every log line of every process goes to <run dir>/run.log
(console.py; ``trainer.verbose=true`` shows the libraries' INFO lines on the console too).

``run(overrides)`` is the same run in the caller's process (a notebook, a test, a sweep), returning a
``RunResult``; the command line is that plus the console, the end-of-run table and a fast exit.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from scaletrain.trainer.config.checks import check_config
from scaletrain.trainer.config.plan import resolve_config
from scaletrain.trainer.config.ppo_config import PPOConfig, load_ppo_config
from scaletrain.trainer.run.run_identity import claim_run_dir
from scaletrain.utils.hydra_compose import plain_dict
from scaletrain.utils.secrets import install_scrubbing, remember_secrets
from scaletrain.utils.typed_config import resolved

if TYPE_CHECKING:
    from scaletrain.trainer.ppo_run import RunResult

logger = logging.getLogger(__name__)


def run_ppo(raw: dict[str, Any], explicit: Iterable[str] = ()) -> RunResult:
    """Train from a plain config dict (as Hydra composes it); ``explicit``: the keys the user set (the embedded
    recipe leaves them alone)."""
    import ray

    from scaletrain.trainer.embedded_default import apply_embedded_overlay, resolve_embedded_default
    from scaletrain.trainer.memory_plan import check_memory, sized_object_store
    from scaletrain.trainer.ppo_run import train
    from scaletrain.trainer.run.console import start_run_log
    from scaletrain.trainer.run.preemption import PreemptionWatch
    from scaletrain.trainer.run.ray_cluster import ray_cluster

    raw, applied = apply_embedded_overlay(raw, explicit)
    if applied:
        logger.info("embedded default: configs/recipe/embedded.yaml sets %s", ", ".join(applied))
    cfg = check_config(resolve_config(load_ppo_config(raw)))  # everything checkable, once, before heavy work
    cfg = sized_object_store(cfg, ray.is_initialized())  # a cluster this run starts: a store its pushes fit in
    check_memory(cfg)  # the memory plan: logged; over budget, a warning or (memory_check=error) a ConfigError
    # from here on SIGTERM / SIGUSR1 end the run cleanly, start-up included (preemption.py)
    with PreemptionWatch() as watch:
        claim_run_dir(cfg)  # resumes only its own run; a fresh run moves an earlier one's outputs aside
        # before Ray starts, so that every worker process writes to it
        start_run_log(resolved(cfg.trainer.default_local_dir, "trainer.default_local_dir"))
        with ray_cluster(cfg.ray_kwargs, cluster_ranks(cfg), cfg.trainer.device):
            watch.take_back()  # from Ray's own SIGTERM handler, which ray.init installed
            return train(resolve_embedded_default(cfg), watch)  # may run the embedded SFT warm-up on this cluster


def cluster_ranks(cfg: PPOConfig) -> int:
    """The processes a private Ray cluster is sized for: the trainer's ranks, a judge's own pool, reward workers."""
    rm = cfg.reward_model
    judge_pool = rm.n_gpus_per_node * rm.nnodes if rm.enable and rm.enable_resource_pool else 0
    return cfg.world_size + judge_pool + cfg.reward.num_workers


def run(overrides: Sequence[str] = ()) -> RunResult:
    """The command line's run, in this process: ``run(["data.train_batch_size=8", ...])`` composes the config
    as ``python -m scaletrain.trainer.main_ppo`` does (verl's forms translated), trains, and returns the result.
    Ray: this process's connection if it has one (left connected), else as ``ray_kwargs`` says (ray_cluster.py).
    A bad config raises ConfigError naming the key, before Ray starts."""
    from scaletrain.utils.hydra_compose import compose_config

    overrides = verl_overrides(list(overrides))
    return run_ppo(compose_config("ppo_trainer", overrides), explicit_keys(overrides))


def explicit_keys(overrides: Iterable[str]) -> list[str]:
    """The config keys an override list sets (``+key=v``, ``~key`` and ``key=v`` alike)."""
    return [override.split("=", 1)[0].lstrip("+~") for override in overrides]


def print_summary(result: RunResult) -> None:
    """The user-facing end-of-run table: held-out accuracy before and after, where the outputs are."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scaletrain: {result.steps} steps in {result.wall_s} s")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.val_metrics.items():
        start = result.initial_val_metrics.get(key)
        if key.endswith("/acc") and start is not None:
            table.add_row(f"{key} (start -> end)", f"{start:.3f} -> {value:.3f} ({100 * (value - start):+.1f} points)")
    for key in ("run_dir", "hf_checkpoint", "hf_merged"):
        if getattr(result, key):
            table.add_row(key, str(getattr(result, key)))
    if result.plots:
        table.add_row("curves", os.path.dirname(result.plots[0]))
    Console().print(table)


@hydra.main(config_path="pkg://scaletrain.configs", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from scaletrain.trainer.run.console import FILE_ONLY, setup_console

    setup_console(bool(config.trainer.verbose))  # the library logs' INFO lines go to the run log only
    explicit = explicit_keys(HydraConfig.get().overrides.task)
    plain = plain_dict(config)
    remember_secrets(plain)  # a YAML file's or ${oc.env:...}'s secrets, out of every output too
    result = run_ppo(plain, explicit)
    logger.info("result: %s", result, extra=FILE_ONLY)  # the console gets the table
    print_summary(result)
    if result.preempted:  # exit 0: the job did what it was asked before the stop; a rerun resumes
        stop = result.preempted
        if stop["checkpoint"] is None:
            logger.warning(
                "preempted by %s before its first checkpoint: run the same command again to start it", stop["signal"]
            )
        else:
            logger.warning(
                "preempted by %s after step %d: checkpoint %s; run the same command again to resume from it",
                stop["signal"],
                stop["step"],
                stop["checkpoint"],
            )


def verl_overrides(argv: list[str]) -> list[str]:
    """The command line's overrides as Hydra should see them (verl's strategy keys, ``+`` on known keys,
    unsupported verl keys refused: scaletrain/trainer/config/verl_compat.py)."""
    import typing

    from scaletrain.trainer.config.verl_compat import translate_overrides
    from scaletrain.utils.typed_config import leaf_fields

    leaves = [(key, typing.get_type_hints(owner)[f.name]) for key, owner, f in leaf_fields(PPOConfig)]
    mappings = frozenset(key for key, tp in leaves if typing.get_origin(tp) is dict)
    return translate_overrides(argv, {key for key, _ in leaves}, mappings)


if __name__ == "__main__":
    from scaletrain.utils.fast_exit import run_and_exit
    from scaletrain.utils.gc_tuning import start_process
    from scaletrain.utils.typed_config import ConfigError

    start_process()  # the driver imports the model libraries too (utils/gc_tuning.py)
    install_scrubbing(sys.argv[1:])  # no secret of the command line in any output, Hydra's echo included
    try:
        sys.argv[1:] = verl_overrides(sys.argv[1:])
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    run_and_exit(main)
