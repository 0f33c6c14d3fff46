"""``python -m scaletrain.model_merger``: verl's model merger command line over scaletrain's checkpoints.

    merge --backend {fsdp,deepspeed,megatron,auto} --local_dir <run>/global_step_N/actor --target_dir DIR
          [--merge_lora [--base_model_path BASE]]   a LoRA run: the PEFT adapter, or the merged model
          [--test --hf_model_path REF]              convert, then compare with a reference HF directory
    test  --backend ... --local_dir ... --test_hf_dir REF     convert to a temporary directory and compare

verl's ``--tie-word-embedding`` and ``--is-value-model`` are facts the checkpoint records: given, they are checked
against it. Nothing is uploaded (``--hf_upload_path`` is refused: push the target directory with the hub's own
command).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

from scaletrain.model_merger.merge import BACKENDS, compare, merge
from scaletrain.utils.errors import InvalidInput


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scaletrain.model_merger",
        description="convert a scaletrain checkpoint into a Hugging Face model",
    )
    ops = parser.add_subparsers(dest="operation", required=True)
    for name in ("merge", "test"):
        op = ops.add_parser(name)
        op.add_argument("--backend", default="auto", choices=["auto", *BACKENDS])
        op.add_argument("--local_dir", required=True, help="<run>/global_step_N/actor (or /critic)")
        op.add_argument("--tie-word-embedding", action="store_true", help="checked against the checkpoint")
        op.add_argument("--is-value-model", action="store_true", help="checked against the checkpoint")
        op.add_argument("--hf_upload_path", default=None, help="refused: nothing is uploaded")
        op.add_argument("--merge_lora", action="store_true", help="LoRA: the merged model, not the adapter")
        op.add_argument("--base_model_path", default=None, help="LoRA merge: the base (default: the run's model)")
        op.add_argument("--shard_size_mb", type=int, default=1024, help="safetensors shard size (and memory held)")
        op.add_argument("--atol", type=float, default=0.0, help="--test: allowed absolute difference")
        op.add_argument("--rtol", type=float, default=0.0, help="--test: allowed relative difference")
    merge_op, test_op = ops.choices["merge"], ops.choices["test"]
    merge_op.add_argument("--target_dir", required=True)
    merge_op.add_argument("--test", action="store_true", help="compare the result with --hf_model_path")
    merge_op.add_argument("--hf_model_path", default=None, help="--test: the reference HF directory")
    test_op.add_argument("--test_hf_dir", required=True, help="the reference HF directory")
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    from backends.checkpoint.meta import read_checkpoint_meta

    if args.hf_upload_path:
        raise InvalidInput("--hf_upload_path: nothing is uploaded from here; push --target_dir with the hub's command")
    if getattr(args, "test", False) and not args.hf_model_path:
        raise InvalidInput("merge --test compares with --hf_model_path: give the reference HF directory")
    meta = read_checkpoint_meta(args.local_dir)
    if args.is_value_model and meta["kind"] != "value":
        raise InvalidInput(f"--is-value-model: {args.local_dir} holds a {meta['kind']} model")
    if args.tie_word_embedding and not meta["tied_names"]:
        raise InvalidInput(f"--tie-word-embedding: {args.local_dir} holds a model with untied embeddings")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="model_merger_") if args.operation == "test" else None
    try:
        _check_flags(args)
        target = args.target_dir if scratch is None else os.path.join(scratch, "hf")
        merge(args.local_dir, target, args.backend, args.shard_size_mb << 20, args.merge_lora, args.base_model_path)
        print(f"wrote {target}")
        reference = args.test_hf_dir if scratch is not None else (args.hf_model_path if args.test else None)
        if reference is not None:
            diffs = compare(target, reference, args.atol, args.rtol)
            print(f"{target} equals {reference}: {len(diffs)} tensors, largest difference {max(diffs.values()):.3g}")
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # InvalidInput is a ValueError
        print(f"model_merger: {e}", file=sys.stderr)
        return 1
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
