"""The config reference (layer 4): every key of the PPO and SFT trainers, its default and its doc, generated from
the config dataclasses themselves.

A field's doc is the comment on its own line of the dataclass (``lr: float = 1e-6  # peak learning rate``) with
the comment-only lines that follow it. ``python -m scaletrain.trainer.config.reference`` rewrites
docs/reference/config.md; ``--missing`` lists the keys without a doc (tests/trainer/config/test_config_reference.py
fails on any, and on a page that differs from what this module generates).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.trainer.config.sft_config import SFTConfig
from scaletrain.utils.typed_config import leaf_fields, to_dict

PAGE = Path(__file__).resolve().parents[3] / "docs" / "reference" / "config.md"
# (title, root dataclass, where its YAML is, how it is run)
TREES = (
    ("PPO / GRPO trainer", PPOConfig, "configs/ppo_trainer.yaml", "python -m scaletrain.trainer.main_ppo"),
    ("SFT trainer", SFTConfig, "configs/sft_trainer.yaml", "python -m scaletrain.trainer.main_sft"),
)


def declaring_class(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose body declares field ``name`` (where its comment is)."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return klass
    return cls


@functools.cache
def class_field_docs(cls: type) -> dict[str, str]:
    """{field name: doc} for the fields declared in ``cls``'s own body."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, the line holds only the comment)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    docs = {}
    for node in ast.parse(src).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line, parts = node.end_lineno or node.lineno, []
        if line in comments and not comments[line][1]:
            parts.append(comments[line][0])
            line += 1
            while line in comments and comments[line][1]:
                parts.append(comments[line][0])
                line += 1
        docs[node.target.id] = " ".join(p for p in parts if p)
    return docs


def field_doc(cls: type, name: str) -> str:
    return class_field_docs(declaring_class(cls, name)).get(name, "")


def keys(root: type) -> list[tuple[str, Any, str]]:
    """(dotted key, default, doc) of each leaf key of config dataclass ``root``."""
    defaults = to_dict(root())
    rows = []
    for key, owning, f in leaf_fields(root):
        value = defaults
        for part in key.split("."):
            value = value[part]
        rows.append((key, value, field_doc(owning, f.name)))
    return rows


def missing_docs() -> list[str]:
    return [f"{root.__name__}: {key}" for _, root, _, _ in TREES for key, _, doc in keys(root) if not doc]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = to_dict(value)
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{_cell(repr(value) if isinstance(value, str) and not value else str(value))}`"


def markdown() -> str:
    out = [
        "# Config reference",
        "",
        "Every key of the trainers' config, its default and what it does, generated from the config dataclasses",
        "(`python -m scaletrain.trainer.config.reference`; `tests/trainer/config/test_config_reference.py` fails",
        "when a key has no doc or this page is out of date). Set a key on the command line as `section.key=value`",
        "(Hydra), or pass the same dotted keys to `run_ppo(dict)`. verl's key names are kept; see",
        "[Porting from verl](../porting.md).",
    ]
    for title, root, yaml_path, command in TREES:
        out += ["", f"## {title}", "", f"`{command}`; the YAML is `{yaml_path}`.", ""]
        section = None
        for key, default, doc in keys(root):
            top = key.split(".")[0]
            if top != section:
                section = top
                out += ["", f"### `{top}`", "", "| key | default | what it does |", "|---|---|---|"]
            out.append(f"| `{key}` | {_default(default)} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--missing", action="store_true", help="list the keys without a doc, exit 1 if any")
    parser.add_argument("--out", type=Path, default=PAGE, help=f"default: {PAGE}")
    args = parser.parse_args(argv)
    if args.missing:
        missing = missing_docs()
        print("\n".join(missing) or "every key has a doc")
        return 1 if missing else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
