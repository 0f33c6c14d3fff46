"""A Hydra config composed in the caller's process, as the command line composes it (``main_ppo.run``,
``main_sft.run``): ``compose_config("ppo_trainer", overrides)`` -> a plain dict.

Works where Hydra is already initialized too (a caller's own ``@hydra.main`` app, a test inside
``initialize_config_module``): that state is set aside for the composition and put back after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

CONFIG_MODULE = "scaletrain.configs"  # configs/, shipped as a package (setup.py)


def plain_dict(config: Any) -> dict[str, Any]:
    """``OmegaConf.to_container(config, resolve=True)`` of a mapping config (a DictConfig): a plain dict with the
    ``${...}`` interpolations resolved. OmegaConf types the result as any container; a DictConfig's is a dict."""
    from omegaconf import OmegaConf

    return cast(dict[str, Any], OmegaConf.to_container(config, resolve=True))


def compose_config(config_name: str, overrides: Sequence[str]) -> dict[str, Any]:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    # Hydra keeps one global instance and refuses a second initialization: set the caller's aside
    saved = Singleton._instances.pop(GlobalHydra, None)
    try:
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            config = compose(config_name, overrides=list(overrides))
        return plain_dict(config)
    finally:
        if saved is not None:
            Singleton._instances[GlobalHydra] = saved
