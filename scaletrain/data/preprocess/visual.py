"""Write a synthetic visual task in verl's multimodal row format (the format of verl's geo3k preprocessing):

    python -m scaletrain.data.preprocess.visual --task count --output_dir DIR --train_size N --test_size M [--seed S]

Each row: ``data_source`` ``scaletrain/visual/<task>``, ``prompt`` one user message whose text starts with the
``<image>`` placeholder, ``images`` a one-image list of ``{"bytes": <PNG>, "path": None}``, ``ability``
``visual``, ``reward_model.ground_truth`` the answer, ``extra_info`` {split, index, task}. The answer is a short
string (a digit, or ``left`` / ``right``), scored by exact match with an EOS after it
(``scaletrain/reward/scorers/visual.py``, as the embedded arithmetic task).

Tasks (``TASKS``), drawn with PIL on a white 112 x 112 canvas:
  - ``count``: 1-5 filled squares and circles in red, green or blue; "how many <colour>?" -> 0-5.
  - ``taller``: two bars of different heights; "which bar is taller?" -> left | right.
  - ``number``: one digit drawn large; "what number?" -> the digit.
  - ``colour``: one square or circle, 24-56 pixels wide, anywhere, in one of six colours; "what colour?" -> its
    name (the recipe's task: the tiny VLM learns it from scratch in minutes, docs/multimodal.md).
The test split is drawn first; a train image identical to a test one is drawn again (the splits are disjoint).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import random
from collections.abc import Callable
from typing import Any

from scaletrain.utils.registry import Registry

DATA_SOURCE_PREFIX = "scaletrain/visual/"
SIZE = 112
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
MORE_COLOURS = {**COLOURS, "yellow": (230, 200, 20), "purple": (140, 40, 170), "orange": (240, 130, 20)}
TASKS = Registry("visual task")
Drawn = tuple[Any, str, str]  # (PIL image, question, answer)


def _canvas():
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    return image, ImageDraw.Draw(image)


@TASKS.register("count")
def draw_count(rng: random.Random) -> Drawn:
    """Shapes on a 4 x 4 grid of 28-pixel cells (no overlap); the question names one colour."""
    image, draw = _canvas()
    cells = rng.sample(range(16), rng.randint(1, 5))
    names = [rng.choice(list(COLOURS)) for _ in cells]
    for cell, name in zip(cells, names):
        x, y = (cell % 4) * 28 + 4, (cell // 4) * 28 + 4
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x, y, x + 20, y + 20), fill=COLOURS[name])
    asked = rng.choice(list(COLOURS))
    return image, f"how many {asked}?", str(names.count(asked))


@TASKS.register("taller")
def draw_taller(rng: random.Random) -> Drawn:
    image, draw = _canvas()
    left, right = rng.sample(range(20, 101, 8), 2)
    draw.rectangle((20, SIZE - left, 44, SIZE - 1), fill=COLOURS["blue"])
    draw.rectangle((68, SIZE - right, 92, SIZE - 1), fill=COLOURS["blue"])
    return image, "which bar is taller?", "left" if left > right else "right"


@TASKS.register("number")
def draw_number(rng: random.Random) -> Drawn:
    from PIL import ImageFont

    image, draw = _canvas()
    digit = rng.randrange(10)
    font = ImageFont.load_default(size=rng.randint(48, 72))
    draw.text((rng.randint(20, 50), rng.randint(5, 30)), str(digit), fill=(0, 0, 0), font=font)
    return image, "what number?", str(digit)


@TASKS.register("colour")
def draw_colour(rng: random.Random) -> Drawn:
    image, draw = _canvas()
    name, size = rng.choice(list(MORE_COLOURS)), rng.randint(24, 56)
    x, y = rng.randint(0, SIZE - size), rng.randint(0, SIZE - size)
    shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
    shape((x, y, x + size - 1, y + size - 1), fill=MORE_COLOURS[name])
    return image, "what colour?", name


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def task_row(task: str, drawn: Drawn, split: str, index: int, png: bytes) -> dict[str, Any]:
    _, question, answer = drawn
    return {
        "data_source": DATA_SOURCE_PREFIX + task,
        "prompt": [{"role": "user", "content": "<image>" + question}],
        "images": [{"bytes": png, "path": None}],
        "ability": "visual",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "task": task, "question": question},
    }


def build_splits(task: str, train_size: int, test_size: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Rows of the ``test`` split (drawn first) and the ``train`` split, no image in both."""
    draw: Callable[[random.Random], Drawn] = TASKS.get(task)
    if train_size < 0 or test_size < 0:
        raise ValueError(f"sizes must be >= 0, got train {train_size}, test {test_size}")
    taken: set[str] = set()
    rows: dict[str, list[dict[str, Any]]] = {}
    for split, wanted, split_seed in (("test", test_size, seed), ("train", train_size, seed + 1_000_003)):
        rng, out = random.Random(split_seed), []
        for _ in range(wanted * 50 + 100):  # a task with few distinct images cannot fill a large split
            if len(out) == wanted:
                break
            drawn = draw(rng)
            png = png_bytes(drawn[0])
            key = hashlib.sha1(png + drawn[1].encode()).hexdigest()
            if split == "test" or key not in taken:
                taken.add(key)
                out.append(task_row(task, drawn, split, len(out), png))
        if len(out) < wanted:
            raise ValueError(f"visual task {task!r}: only {len(out)} distinct {split} problems, {wanted} asked")
        rows[split] = out
    return rows


def write_task(task: str, output_dir: str, train_size: int, test_size: int, seed: int = 0) -> dict[str, str]:
    """``train.parquet`` and ``test.parquet`` of the task in ``output_dir``; returns their paths by split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(output_dir, exist_ok=True)
    paths = {}
    for split, rows in build_splits(task, train_size, test_size, seed).items():
        paths[split] = os.path.join(output_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="Write a synthetic visual task as multimodal RL parquet.")
    parser.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS.names())}")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_size", type=int, required=True)
    parser.add_argument("--test_size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.task not in TASKS:
        parser.error(f"unknown visual task {args.task!r}; known: {', '.join(TASKS.names())}")
    paths = write_task(args.task, args.output_dir, args.train_size, args.test_size, args.seed)
    print(f"visual/{args.task}: {args.train_size}/{args.test_size} train/test problems -> {args.output_dir}")
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
