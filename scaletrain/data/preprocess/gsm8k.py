"""Convert a local copy of GSM8K to verl's RL row format.

    python -m scaletrain.data.preprocess.gsm8k --input train.jsonl --input test.jsonl --output_dir DIR

Input: ``.jsonl`` (one JSON object a line, blank lines skipped) or ``.parquet`` files whose rows have
``question`` and ``answer`` strings, the answer ending with ``#### <number>`` (GSM8K's own layout). Each input's
split is ``--split`` when given, else read from its file name (it must contain ``train`` or ``test``); files of
the same split are concatenated into ``DIR/<split>.parquet``.

Output rows: ``data_source="openai/gsm8k"``, ``prompt`` = one user message (the question followed by
``INSTRUCTION``), ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}`` (commas
removed), ``extra_info={"split", "index", "question", "answer"}``. A bad row raises ValueError naming the file and
the line (jsonl, 1-based) or row (parquet, 0-based).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Solve the problem step by step, then write the final answer as a number after "####".'
SPLITS = ("train", "test")
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def final_answer(answer: str) -> str | None:
    """The number after the trailing ``####`` of a GSM8K answer, commas removed; None if there is none."""
    match = _FINAL.search(answer.strip())
    return match.group(1).replace(",", "") if match else None


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of a jsonl or parquet file; location reads ``file:line N`` / ``file: row N``."""
    path = str(path)
    if path.endswith(".parquet"):
        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}: row {i}", record
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None


def _required_text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: '{key}' must be a non-empty string, got {value!r:.100}")
    return value


def convert_record(record: Any, split: str, index: int, where: str) -> dict[str, Any]:
    """One GSM8K record -> one RL row; ValueError naming ``where`` when the record is malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'question' and 'answer', got {type(record).__name__}")
    question, answer = _required_text(record, "question", where), _required_text(record, "answer", where)
    number = final_answer(answer)
    if number is None:
        raise ValueError(f"{where}: the answer does not end with '#### <number>': {answer[-80:]!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": number},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def split_of(path: str | os.PathLike, split: str | None = None) -> str:
    """``split`` when given, else ``train`` / ``test`` read from the file name."""
    if split is not None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return split
    name = Path(path).name.lower()
    found = [s for s in SPLITS if s in name]
    if len(found) != 1:
        raise ValueError(f"cannot tell the split of {path} from its name; pass --split train|test")
    return found[0]


def convert(inputs: list[str], output_dir: str | os.PathLike, split: str | None = None) -> dict[str, str]:
    """Convert the input files; returns split -> written parquet path."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in inputs:
        if not os.path.exists(path):
            raise FileNotFoundError(f"GSM8K input not found: {path}")
        name = split_of(path, split)
        out = rows.setdefault(name, [])
        for where, record in read_records(path):
            out.append(convert_record(record, name, len(out), where))
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, split_rows in rows.items():
        if not split_rows:
            raise ValueError(f"no GSM8K rows for split '{name}' in {inputs}")
        paths[name] = str(Path(output_dir) / f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(split_rows), paths[name])
        logger.info("gsm8k %s: %d rows -> %s", name, len(split_rows), paths[name])
    return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="Convert local GSM8K jsonl/parquet files to verl's RL row format.")
    parser.add_argument("--input", action="append", required=True, help="a .jsonl or .parquet file (repeatable)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--split", choices=SPLITS, default=None, help="split of every input (default: from file name)")
    args = parser.parse_args(argv)
    paths = convert(args.input, args.output_dir, args.split)
    print("gsm8k: " + ", ".join(f"{name} -> {path}" for name, path in paths.items()))
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
