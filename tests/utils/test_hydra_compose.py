"""``compose_config``: the command line's composition in the caller's process, also inside a Hydra context the caller
initialized (a notebook or an app of its own calling ``main_ppo.run``), which it leaves as it was."""

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from scaletrain.utils.hydra_compose import compose_config


def test_composes_with_overrides_and_leaves_hydra_uninitialized():
    config = compose_config("ppo_trainer", ["data.train_batch_size=8", "backend=megatron"])
    assert config["data"]["train_batch_size"] == 8 and config["backend"]["name"] == "megatron"
    assert not GlobalHydra.instance().is_initialized()


def test_inside_the_callers_hydra_context():
    with initialize_config_module("scaletrain.configs", version_base=None):
        assert compose_config("sft_trainer", ["trainer.seed=7"])["trainer"]["seed"] == 7
        assert compose("ppo_trainer")["trainer"]["seed"] == 1  # the caller's Hydra still works


def test_a_source_checkout_without_install_finds_its_configs():
    """The checkout on PYTHONPATH, never pip-installed (an offline GPU machine): the install's mapping of configs/ to
    scaletrain.configs is absent, and the command line and compose_config still find the YAML."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
        f"sys.path.insert(0, {str(root)!r}); "
        "from scaletrain.utils.hydra_compose import compose_config; "
        "print(compose_config('ppo_trainer', ['trainer.seed=5'])['trainer']['seed'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["5"], out.stdout + out.stderr[-2000:]
