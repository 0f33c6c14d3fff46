"""Write the embedded default's addition task as parquet: ``python -m scaletrain.data.preprocess.arithmetic
--output_dir DIR [--seed 0 --n_train 50000 --n_val 300 --n_test 500]``.

Writes ``train/val/test.parquet`` (RL rows) and ``sft_train/sft_val.parquet`` (prompt/response); see
``scaletrain.data.embedded`` for the format.
"""

from __future__ import annotations

import argparse
import logging

from scaletrain.data.embedded import DEFAULT_N_TRAIN, write_arithmetic_task


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="Write the embedded addition task (RL + SFT parquet).")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_train", type=int, default=DEFAULT_N_TRAIN)
    parser.add_argument("--n_val", type=int, default=300)
    parser.add_argument("--n_test", type=int, default=500)
    args = parser.parse_args(argv)
    paths = write_arithmetic_task(
        args.output_dir, seed=args.seed, n_train=args.n_train, n_val=args.n_val, n_test=args.n_test
    )
    print(f"arithmetic: {args.n_train}/{args.n_val}/{args.n_test} train/val/test problems -> {args.output_dir}")
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
