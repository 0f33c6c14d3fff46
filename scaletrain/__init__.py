"""scaletrain: scale-out RL post-training for LLMs.

Layers (arrows point down): trainer/ (single controller, fit()) -> controller/ (worker groups, dispatch) ->
workers/ (role workers) -> backends/ (training and rollout engines). protocol/ (DataProto), algos/, reward/,
data/ and agent/ are shared building blocks that import nothing from the layers above them.
"""

__version__ = "0.1.0"


def _map_source_configs() -> None:
    """``scaletrain.configs`` from a source checkout that was never pip-installed (the checkout on PYTHONPATH, as on
    an offline GPU machine: launch/testing/gpu_offline.sh): setup.py maps configs/ to that package at install time,
    so without an install Hydra's ``pkg://scaletrain.configs`` would find nothing."""
    import importlib.util
    import sys
    from pathlib import Path

    configs = Path(__file__).resolve().parent.parent / "configs" / "__init__.py"
    if not configs.is_file() or importlib.util.find_spec(f"{__name__}.configs") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.configs", configs, submodule_search_locations=[str(configs.parent)]
    )
    assert spec is not None and spec.loader is not None  # a .py file's
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["configs"] = module


_map_source_configs()
