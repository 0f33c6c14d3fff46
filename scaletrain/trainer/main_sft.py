"""``python -m scaletrain.trainer.main_sft [key=value ...]``: the SFT trainer's command line (Hydra).

    python -m scaletrain.trainer.main_sft                                   # warm up the embedded default
    python -m scaletrain.trainer.main_sft data.train_files=sft.parquet data.val_files=sft_val.parquet \\
        model.path=/models/qwen optim.lr=1e-5 trainer.total_epochs=2 trainer.n_gpus_per_node=8

configs/sft_trainer.yaml holds every key with its default. The YAML is turned into typed dataclasses and
validated (unknown keys, wrong types, batch sizes, files) before Ray starts; see scaletrain/trainer/sft_trainer.py.
``run(overrides)`` is the same run in the caller's process, returning run_sft's summary.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import hydra
from omegaconf import DictConfig

from scaletrain.trainer.config.sft_config import load_sft_config
from scaletrain.trainer.sft_trainer import run_sft
from scaletrain.utils.hydra_compose import plain_dict
from scaletrain.utils.secrets import install_scrubbing, remember_secrets

logger = logging.getLogger(__name__)


@hydra.main(config_path="pkg://scaletrain.configs", config_name="sft_trainer", version_base=None)
def main(config: DictConfig) -> dict:
    from scaletrain.trainer.run.console import setup_console, start_run_log

    setup_console(bool(config.trainer.verbose))  # the library logs' INFO lines go to the run log only
    plain = plain_dict(config)
    remember_secrets(plain)  # out of every output (scaletrain/utils/secrets.py)
    cfg = load_sft_config(plain)
    start_run_log(cfg.output_dir)  # <output_dir>/run.log, before run_sft starts Ray
    summary = run_sft(cfg)
    logger.info(
        "SFT finished at step %d (val acc %s); HF checkpoint: %s",
        summary["step"],
        summary["val_acc"],
        summary["hf_path"],
    )
    return summary


def run(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The command line's SFT run in this process (Ray: its connection if it has one, else ``ray_kwargs``'s)."""
    from scaletrain.utils.hydra_compose import compose_config

    return run_sft(load_sft_config(compose_config("sft_trainer", overrides)))


if __name__ == "__main__":
    from scaletrain.utils.fast_exit import run_and_exit
    from scaletrain.utils.gc_tuning import start_process

    start_process()  # the driver imports the model libraries too (utils/gc_tuning.py)
    install_scrubbing(sys.argv[1:])
    run_and_exit(main)
