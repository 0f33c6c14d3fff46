"""Entry point: ``python -m scaletrain.trainer.main_ppo [hydra overrides]`` (layer 4).

Composes configs/ppo_trainer.yaml with the overrides (verl's command-line forms translated first: verl_compat.py),
builds and validates the typed config before Ray starts, fills null model/data paths with the embedded default,
then trains and writes the run's outputs (metrics, checkpoints, an HF export, curves). The console shows our own
lines (a progress bar per phase, step lines, warnings); every log line of every process goes to <run dir>/run.log
(console.py; ``trainer.verbose=true`` shows the libraries' INFO lines on the console too).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from scaletrain.trainer.config import PPOConfig, load_ppo_config
from scaletrain.trainer.config_checks import check_config
from scaletrain.trainer.plan import resolve_config
from scaletrain.trainer.run_identity import claim_run_dir

logger = logging.getLogger(__name__)


def init_ray(cfg: PPOConfig) -> None:
    """Starts Ray (unless it runs already); first the run log in the run directory when the command line set up
    the console (console.py), so that every worker process writes to it too."""
    import ray

    from scaletrain.trainer.console import ray_init_kwargs, start_run_log

    start_run_log(cfg.trainer.default_local_dir)
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's token authentication stays as it is: a private cluster started here makes its own token (Ray >= 2.59:
    # its ports listen on every interface, so without one anyone reaching them could run code as this user); a
    # cluster joined by ray_init.address uses the token in the environment (launch/run.sh makes one per job).
    kwargs: dict[str, Any] = {"include_dashboard": False, **ray_init_kwargs()}
    if cfg.ray_init.address:
        kwargs["address"] = cfg.ray_init.address
    else:  # a private local cluster: never attach to a stale or foreign one by accident ("auto" does that)
        kwargs["address"] = "local"
        world = cfg.world_size
        kwargs["num_cpus"] = cfg.ray_init.num_cpus or max(world * 2, os.cpu_count() or 1)
        if cfg.trainer.device == "cpu":
            kwargs["num_gpus"] = 0
        kwargs["object_store_memory"] = cfg.ray_init.object_store_memory or 1 << 30
    ray.init(**kwargs)


def run_ppo(raw: dict[str, Any], explicit: Iterable[str] = ()) -> dict[str, Any]:
    """Train from a plain config dict (as Hydra composes it); ``explicit``: the keys the user set (the embedded
    recipe leaves them alone). Returns a summary."""
    from scaletrain.trainer.embedded_default import apply_embedded_overlay, resolve_embedded_default
    from scaletrain.trainer.run import train

    raw, applied = apply_embedded_overlay(raw, explicit)
    if applied:
        logger.info("embedded default: configs/recipe/embedded.yaml sets %s", ", ".join(applied))
    cfg = check_config(resolve_config(load_ppo_config(raw)))  # everything checkable, once, before heavy work
    claim_run_dir(cfg)  # resumes only its own run; a fresh run moves an earlier one's outputs aside
    init_ray(cfg)
    return train(resolve_embedded_default(cfg))  # may run the embedded SFT warm-up on this Ray cluster


def print_summary(summary: dict[str, Any]) -> None:
    """The user-facing end-of-run table: held-out accuracy before and after, where the outputs are."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scaletrain: {summary['steps']} steps in {summary['wall_s']} s")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key.endswith("/acc") and f"{key}@start" in summary:
            start = summary[f"{key}@start"]
            table.add_row(f"{key} (start -> end)", f"{start:.3f} -> {value:.3f} ({100 * (value - start):+.1f} points)")
    for key in ("run_dir", "hf_checkpoint", "hf_merged"):
        if key in summary:
            table.add_row(key, str(summary[key]))
    if summary.get("plots"):
        table.add_row("curves", os.path.dirname(summary["plots"][0]))
    Console().print(table)


@hydra.main(config_path="pkg://scaletrain.configs", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from scaletrain.trainer.console import FILE_ONLY, setup_console

    setup_console(bool(config.trainer.verbose))  # the library logs' INFO lines go to the run log only
    explicit = [override.split("=", 1)[0].lstrip("+~") for override in HydraConfig.get().overrides.task]
    summary = run_ppo(OmegaConf.to_container(config, resolve=True), explicit)
    logger.info("summary: %s", summary, extra=FILE_ONLY)  # the console gets the table
    print_summary(summary)
    if "preempted" in summary:  # exit 0: the job did what it was asked before the stop; a rerun resumes
        stop = summary["preempted"]
        logger.warning(
            "preempted by %s after step %d: checkpoint %s; run the same command again to resume from it",
            stop["signal"],
            stop["step"],
            stop["checkpoint"],
        )


def verl_overrides(argv: list[str]) -> list[str]:
    """The command line's overrides as Hydra should see them (verl's strategy keys, ``+`` on known keys,
    unsupported verl keys refused: scaletrain/trainer/verl_compat.py)."""
    from scaletrain.trainer.verl_compat import translate_overrides
    from scaletrain.utils.typed_config import leaf_fields

    return translate_overrides(argv, {key for key, _, _ in leaf_fields(PPOConfig)})


if __name__ == "__main__":
    from scaletrain.utils.fast_exit import run_and_exit
    from scaletrain.utils.typed_config import ConfigError

    try:
        sys.argv[1:] = verl_overrides(sys.argv[1:])
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    run_and_exit(main)
