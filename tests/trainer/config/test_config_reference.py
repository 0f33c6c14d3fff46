"""The config reference (docs/reference/config.md) is generated from the config dataclasses: every key has a doc
(the comment on its field's line) and the page is what scaletrain/trainer/config/reference.py generates today."""

from __future__ import annotations

import dataclasses

from scaletrain.trainer.config import reference
from scaletrain.trainer.config.ppo_config import PPOConfig
from scaletrain.utils.typed_config import leaf_fields


def test_every_key_has_a_doc():
    missing = reference.missing_docs()
    assert not missing, f"config keys without a doc (a comment on the field's line): {missing}"


def test_the_page_is_up_to_date():
    assert reference.PAGE.read_text() == reference.markdown(), (
        "docs/reference/config.md is stale: run `python -m scaletrain.trainer.config.reference`"
    )


def test_a_doc_is_the_fields_own_comment_with_its_continuation_lines():
    """On a class written for it: a trailing comment and the comment-only lines after it are the doc; a comment-only
    line after a field without one belongs to no field."""

    @dataclasses.dataclass
    class Example:
        first: int = 1  # the first
        # and more of it
        second: str = "x"
        # not second's
        third: float = 0.5  # third

    docs = reference.class_field_docs(Example)
    assert docs == {"first": "the first and more of it", "second": "", "third": "third"}


def test_the_page_lists_every_key_with_its_default():
    page = reference.PAGE.read_text()
    for key, _, _ in leaf_fields(PPOConfig):
        assert f"| `{key}` |" in page, key
    assert "| `actor_rollout_ref.actor.optim.lr` | `1e-06` |" in page
