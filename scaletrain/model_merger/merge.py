"""Converting an engine checkpoint (``<run>/global_step_N/actor`` or ``/critic``) into a Hugging Face directory.

The checkpoint describes itself (backends/checkpoint/meta.py ``write_checkpoint_meta``: the backend and its layout,
the model's kind, architecture and dtype, and ``huggingface/`` with the config and tokenizer), and its backend's
reader (``CHECKPOINT_READERS``) yields the full tensors a bucket at a time, in one process with no process group.
Every tensor is checked against the model the saved config builds (on the meta device: no weights allocated):
a name it does not have, another shape (a checkpoint of another model), or a tensor missing at the end (a cut
checkpoint) fails the conversion naming the checkpoint, and nothing is left at ``target_dir`` (the export is
written to ``<target_dir>.incomplete`` and renamed only when complete: backends/checkpoint/hf_export.py). Memory holds
one bucket of tensors (``shard_bytes``), never the whole model twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

import torch

from backends.checkpoint.hf_export import write_hf_checkpoint
from backends.checkpoint.hf_names import checkpoint_layout
from backends.checkpoint.meta import CHECKPOINT_READERS, HF_META_DIR, read_checkpoint_meta
from backends.hf_model import torch_dtype
from backends.lora_weights import LoraLayout, write_adapter_dir
from scaletrain.model_merger.lora import checked_adapters, merged_lora
from scaletrain.model_merger.safetensors_dir import safetensors_index

logger = logging.getLogger(__name__)
BACKENDS = ("fsdp", "deepspeed", "megatron")
Bucket = list[tuple[str, torch.Tensor]]


def merge(
    local_dir: str,
    target_dir: str,
    backend: str = "auto",
    shard_bytes: int = 1 << 30,
    merge_lora: bool = False,
    base_model_path: str | None = None,
) -> str:
    """Writes the HF model of checkpoint ``local_dir`` to ``target_dir``; returns ``target_dir``. ``backend``: the
    backend that wrote it, checked against the checkpoint's own record, or "auto" to take that record. A LoRA
    checkpoint (its adapters alone) gives the PEFT adapter directory, or with ``merge_lora`` the merged model, its
    base read from ``base_model_path`` (default: the run's model path, recorded in the checkpoint)."""
    meta = _meta(local_dir, backend)
    hf_dir = os.path.join(local_dir, HF_META_DIR)
    config, expected, meta_model = model_tensors(hf_dir, meta["architecture"])
    reader = CHECKPOINT_READERS.get(meta["backend"])
    buckets = reader(local_dir, meta, list(expected), shard_bytes)
    if meta["lora"] is not None:
        trained = checked_adapters(buckets, meta["lora"]["scales"], local_dir)
        if not merge_lora:
            adapter = [[(name, get()) for name, _, get in LoraLayout.adapter_items(trained)]]
            write_adapter_dir(target_dir, adapter, meta["lora"]["config"], True, hf_dir)
            return target_dir
        base_dir = base_model_path or meta["model_path"]
        buckets = merged_lora(trained, meta["lora"]["scales"], base_dir, expected, shard_bytes)
    elif merge_lora:
        raise ValueError(f"--merge_lora: {local_dir} is not a LoRA checkpoint (it holds the whole model)")
    checked = _checked(buckets, expected, set(meta["tied_names"]), torch_dtype(meta["dtype"]), local_dir, hf_dir)
    generation = _generation_config(hf_dir)
    # a MoE model's fused experts are written per expert, as save_pretrained does (backends/checkpoint/hf_names.py)
    checked = checkpoint_layout(checked, meta_model)
    write_hf_checkpoint(target_dir, checked, config, meta["architecture"], True, generation, tokenizer_dir=hf_dir)
    return target_dir


def _meta(local_dir: str, backend: str) -> dict:
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"--backend {backend}: expected one of {['auto', *BACKENDS]}")
    meta = read_checkpoint_meta(local_dir)
    if backend != "auto" and backend != meta["backend"]:
        raise ValueError(
            f"{local_dir} was written by the {meta['backend']} backend, not {backend} (or: --backend auto)"
        )
    return meta


def model_tensors(
    hf_dir: str, architecture: str
) -> tuple[object, dict[str, tuple[tuple[int, ...], torch.dtype]], torch.nn.Module]:
    """The saved config, the state dict names and shapes of the model it builds, and that model (on the meta
    device)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise ValueError(f"{hf_dir}: architecture '{architecture}' is not a model class of transformers")
    with torch.device("meta"):
        model = model_class(config)
    return config, {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}, model


def _checked(
    buckets: Iterable[Bucket], expected: dict, tied: set[str], dtype: torch.dtype, where: str, hf_dir: str
) -> Iterator[Bucket]:
    """The buckets less the tied duplicates, in ``dtype``, each tensor checked against the model; raises at the
    end if one is missing."""
    seen = set()
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            if name in tied:
                continue
            if name not in expected:
                raise ValueError(
                    f"{where}: holds '{name}', which the model of {hf_dir}/config.json has not: a checkpoint of "
                    "another model, or a config replaced"
                )
            if tuple(tensor.shape) != expected[name][0]:
                raise ValueError(f"{where}: '{name}' has shape {tuple(tensor.shape)}, the model {expected[name][0]}")
            seen.add(name)
            out.append((name, tensor.to(dtype)))
        if out:
            yield out
    missing = [name for name in expected if name not in seen and name not in tied]
    if missing:
        raise ValueError(f"{where}: no tensor for {len(missing)} of the model's {len(expected)}: {missing[:4]}")


def _generation_config(hf_dir: str):
    if not os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(hf_dir)


def compare(converted_dir: str, reference_dir: str, atol: float = 0.0, rtol: float = 0.0) -> dict[str, float]:
    """Tensor by tensor (one at a time), the converted model against a reference HF directory of the same model:
    same names, shapes, and values within ``atol + rtol * |reference|``; returns each tensor's largest difference,
    raises naming the ones that differ."""
    from safetensors import safe_open

    ours, theirs = safetensors_index(converted_dir), safetensors_index(reference_dir)
    if set(ours) != set(theirs):
        only_ours, only_theirs = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise ValueError(
            f"{converted_dir} vs {reference_dir}: names differ: only ours {only_ours[:4]}, only theirs "
            f"{only_theirs[:4]}"
        )
    diffs, failed = {}, []
    for name in sorted(ours):
        with safe_open(ours[name], "pt") as a, safe_open(theirs[name], "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
        if x.shape != y.shape:
            failed.append(f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        diff = (x.double() - y.double()).abs()
        diffs[name] = float(diff.max()) if diff.numel() else 0.0
        if bool((diff > atol + rtol * y.double().abs()).any()):
            failed.append(f"{name}: max difference {diffs[name]:.3g}")
    if failed:
        raise ValueError(f"{converted_dir} differs from {reference_dir} in {len(failed)} tensors: {failed[:4]}")
    return diffs
