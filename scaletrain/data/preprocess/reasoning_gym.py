"""Write a reasoning-gym task (the ``reasoning-gym`` package's procedural generators) in verl's RL row format.

    python -m scaletrain.data.preprocess.reasoning_gym --task chain_sum --output_dir DIR \\
        --train_size 2000 --test_size 200 [--seed 0] [--task_kwargs '{"min_terms": 2, "max_terms": 2}'] [--fewshot 1]

Any task name registered in reasoning-gym works (``basic_arithmetic``, ``chain_sum``, ``countdown``,
``gsm_symbolic``, ...); ``--task_kwargs`` (a JSON object) goes to ``reasoning_gym.create_dataset`` as the task's
config. ``seed`` and ``size`` are not allowed there: ``--seed`` and the split sizes set them.

Output rows (``DIR/train.parquet``, ``DIR/test.parquet``):
  - ``data_source``: ``"reasoning_gym/<task>"`` (the default scorer, ``reward/scorers/reasoning_gym.py``, reads the
    task name from it),
  - ``prompt``: chat messages: ``--fewshot K`` worked examples (user question, assistant answer in the format: the
    calculation, then the tagged answer; drawn from a third generator stream, the same for every row), then the
    user message: the task's question followed by ``INSTRUCTION``,
  - ``ability``: the task's category in reasoning-gym (``arithmetic``, ``games``, ...),
  - ``reward_model``: ``{"style": "rule", "ground_truth": <the task's answer as a string>}`` (``""`` for the few
    tasks whose entries have no single oracle answer; their scorer checks answers against the entry instead),
  - ``extra_info``: ``split``, ``index``, ``task``, ``task_kwargs`` (JSON string) and ``entry``: the task entry
    (``question``, ``answer``, ``metadata``) as a JSON string. JSON because metadata differs in shape from task to
    task and row to row, which parquet cannot type as one column; tuples in it come back as lists.

Splits: the test problems come from a generator seeded ``seed``, the train ones from a second generator seeded
``seed + TRAIN_SEED_OFFSET``. reasoning-gym seeds item ``i`` with ``generator_seed + i``, so the offset (larger
than any split's draws) keeps the two splits' random streams apart; questions are still de-duplicated, within
each split and train against test, since different streams can produce the same question. Same seed and sizes
-> the same files; the test split does not depend on ``train_size``.

The scorer (``scaletrain.reward.scorers.reasoning_gym``) imports ``DATA_SOURCE_PREFIX``, ``ENTRY_KEY`` and
``TASK_KWARGS_KEY`` from here, so this module imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATA_SOURCE_PREFIX = "reasoning_gym/"
ENTRY_KEY, TASK_KWARGS_KEY = "entry", "task_kwargs"  # extra_info keys holding JSON strings
# the wording a small chat model (SmolLM2-135M) follows best among those tried: asked for the bare answer it wrote
# no tags at all; asked to show the calculation first it writes "6 + 2 = 8" and, shown one example, then the tag
INSTRUCTION = "Write the calculation, then give the final answer between <answer> and </answer> tags."
TRAIN_SEED_OFFSET = 1_000_000_000
FEWSHOT_SEED_OFFSET = 2 * TRAIN_SEED_OFFSET  # the worked examples: a third stream, apart from both splits
RESERVED_KWARGS = ("seed", "size")
_DRAW_FACTOR, _DRAW_SLACK = 4, 100  # a split may draw this many items (factor * wanted + slack) to find unique ones


def known_tasks() -> list[str]:
    """Names of the tasks registered in reasoning-gym, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_request(task: str, task_kwargs: dict[str, Any], train_size: int, test_size: int) -> None:
    """ValueError naming the problem for an unknown task (listing the known ones), unusable task kwargs or a
    negative split size."""
    for name, size in (("train_size", train_size), ("test_size", test_size)):
        if size < 0:
            raise ValueError(f"{name} must be >= 0, got {size}")
        if _DRAW_FACTOR * size + _DRAW_SLACK > TRAIN_SEED_OFFSET:  # the test draws would reach the train seeds
            raise ValueError(f"{name} must be at most {(TRAIN_SEED_OFFSET - _DRAW_SLACK) // _DRAW_FACTOR}, got {size}")
    names = known_tasks()
    if task not in names:
        raise ValueError(f"unknown reasoning-gym task {task!r}; known tasks: {', '.join(names)}")
    reserved = sorted(set(task_kwargs) & set(RESERVED_KWARGS))
    if reserved:
        raise ValueError(f"task_kwargs may not set {reserved}: --seed and the split sizes set them")
    create_task_dataset(task, task_kwargs, seed=0, size=1)  # the task's own config validation


def create_task_dataset(task: str, task_kwargs: dict[str, Any], seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset(task, **task_kwargs, seed=seed, size=size)``; a config the task rejects
    (unknown field, failed validation) raises ValueError naming the task and the kwargs."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, **task_kwargs, seed=seed, size=size)
    except (TypeError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym task {task!r} rejects task_kwargs {task_kwargs}: {exc}") from None


def _jsonable(value: Any) -> Any:
    """json.dumps fallback for the non-JSON types metadata may hold (numpy values, sets)."""
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"cannot store a {type(value).__name__} ({value!r:.80}) of a reasoning-gym entry as JSON")


def entry_json(entry: dict[str, Any]) -> str:
    """The entry's question, answer and metadata as one JSON string (what ``extra_info["entry"]`` holds)."""
    kept = {key: entry.get(key) for key in ("question", "answer", "metadata")}
    return json.dumps(kept, default=_jsonable, sort_keys=True)


def draw_entries(dataset: Any, wanted: int, taken: set[str], split: str) -> list[dict[str, Any]]:
    """The first ``wanted`` entries of ``dataset`` whose questions are not in ``taken`` nor repeated; adds their
    questions to ``taken``. ValueError when the dataset runs out of draws first (too few distinct questions)."""
    entries: list[dict[str, Any]] = []
    for index in range(len(dataset)):
        if len(entries) == wanted:
            break
        entry = dataset[index]
        if entry["question"] in taken:
            continue
        taken.add(entry["question"])
        entries.append(entry)
    if len(entries) < wanted:
        raise ValueError(
            f"{split}: found only {len(entries)} distinct new questions in {len(dataset)} draws, wanted {wanted}; "
            "ask for fewer problems or widen the task's config"
        )
    return entries


def user_turn(entry: dict[str, Any]) -> dict[str, str]:
    return {"role": "user", "content": f"{entry['question'].strip()} {INSTRUCTION}"}


def worked_solution(entry: dict[str, Any]) -> str:
    """An answer in the requested format for a worked example: the calculation when the entry's metadata has one
    (``answer_cot``, or ``expression`` [= ``target``]), then the answer between the tags."""
    meta, answer = entry.get("metadata") or {}, entry.get("answer")
    if meta.get("answer_cot"):
        work = str(meta["answer_cot"]).strip()
    elif meta.get("expression") is not None:
        work = f"{meta['expression']} = {meta.get('target', answer)}"
    else:
        work = ""
    return f"{work}\n<answer>{answer}</answer>".lstrip()


def fewshot_turns(task: str, task_kwargs: dict[str, Any], seed: int, shots: int, taken: set[str]) -> list[dict]:
    """``shots`` worked examples as earlier chat turns (user question, assistant answer in the format), the same
    for every row, drawn from their own generator stream; their questions join ``taken`` so no split repeats them."""
    if shots <= 0:
        return []
    dataset = create_task_dataset(task, task_kwargs, seed=seed + FEWSHOT_SEED_OFFSET, size=_DRAW_FACTOR * shots + 10)
    turns: list[dict] = []
    for entry in draw_entries(dataset, shots, taken, "fewshot"):
        turns += [user_turn(entry), {"role": "assistant", "content": worked_solution(entry)}]
    return turns


def problem_row(
    task: str,
    entry: dict[str, Any],
    ability: str,
    split: str,
    index: int,
    kwargs_json: str,
    fewshot: list[dict] | None = None,
) -> dict[str, Any]:
    """One RL row for one reasoning-gym entry (after the worked-example turns ``fewshot``, if any)."""
    answer = entry.get("answer")
    return {
        "data_source": DATA_SOURCE_PREFIX + task,
        "prompt": [*(fewshot or []), user_turn(entry)],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "task": task,
            TASK_KWARGS_KEY: kwargs_json,
            ENTRY_KEY: entry_json(entry),
        },
    }


def build_splits(
    task: str,
    train_size: int,
    test_size: int,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    fewshot: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """Rows of the disjoint ``test`` (drawn first) and ``train`` splits, each prompt after ``fewshot`` worked
    examples (chat turns)."""
    task_kwargs = dict(task_kwargs or {})
    check_request(task, task_kwargs, train_size, test_size)
    if fewshot < 0:
        raise ValueError(f"fewshot must be >= 0, got {fewshot}")
    kwargs_json = json.dumps(task_kwargs, sort_keys=True)
    taken: set[str] = set()
    shots = fewshot_turns(task, task_kwargs, seed, fewshot, taken)
    rows: dict[str, list[dict[str, Any]]] = {}
    for split, wanted, split_seed in (("test", test_size, seed), ("train", train_size, seed + TRAIN_SEED_OFFSET)):
        draws = _DRAW_FACTOR * wanted + _DRAW_SLACK
        dataset = create_task_dataset(task, task_kwargs, seed=split_seed, size=draws)
        entries = draw_entries(dataset, wanted, taken, split)
        rows[split] = [
            problem_row(task, e, dataset.category, split, i, kwargs_json, shots) for i, e in enumerate(entries)
        ]
    return rows


def write_task(
    task: str,
    output_dir: str,
    train_size: int,
    test_size: int,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    fewshot: int = 0,
) -> dict[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` under ``output_dir``; returns split -> path."""
    import pyarrow as pa  # here, not at the top: the scorer imports this module's constants in every reward worker
    import pyarrow.parquet as pq

    rows = build_splits(task, train_size, test_size, seed, task_kwargs, fewshot)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "test"):
        paths[split] = str(out / f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows[split]), paths[split])
        logger.info("reasoning_gym/%s %s: %d rows -> %s", task, split, len(rows[split]), paths[split])
    return paths


def parse_task_kwargs(text: str) -> dict[str, Any]:
    """``--task_kwargs`` JSON -> dict; ValueError unless it is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--task_kwargs is not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--task_kwargs must be a JSON object, got {type(value).__name__}: {text!r}")
    return value


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="Write a reasoning-gym task as RL parquet (train/test).")
    parser.add_argument("--task", required=True, help="a reasoning-gym task name, e.g. chain_sum")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_size", type=int, required=True)
    parser.add_argument("--test_size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task_kwargs", default="{}", help="task config as JSON, e.g. '{\"min_terms\": 2}'")
    parser.add_argument("--fewshot", type=int, default=0, help="worked examples shown before each question")
    args = parser.parse_args(argv)
    try:  # a bad task, config or size is a usage error: message and exit code 2
        task_kwargs = parse_task_kwargs(args.task_kwargs)
        check_request(args.task, task_kwargs, args.train_size, args.test_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.fewshot < 0:
        parser.error(f"--fewshot must be >= 0, got {args.fewshot}")
    paths = write_task(
        args.task, args.output_dir, args.train_size, args.test_size, args.seed, task_kwargs, args.fewshot
    )
    print(f"reasoning_gym/{args.task}: {args.train_size}/{args.test_size} train/test problems -> {args.output_dir}")
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
