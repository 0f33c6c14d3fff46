"""Secrets out of the logs: config values whose keys look like credentials are redacted before any logger,
tracker (wandb, mlflow, tensorboard) or run file sees the config.

A key is a secret's when its last name contains ``token``, ``key``, ``password`` or ``secret`` (any case) and its
value is a non-empty string, list or mapping (all of it is redacted). Numbers and flags such as
``max_num_batched_tokens`` stay, and so do the config's own string keys that only name things (``NOT_SECRET``:
``data.prompt_key`` names a column, ``input_tokenizer`` a path).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SECRET_NAME = re.compile(r"token|key|password|secret", re.IGNORECASE)
NOT_SECRET = frozenset({"prompt_key", "input_tokenizer", "tokenizer", "tokenizer_path"})
REDACTED = "***redacted***"


def is_secret(name: str, value: Any) -> bool:
    """``name``: a key, or a dotted path whose last part is the key."""
    last = name.rsplit(".", 1)[-1]
    if last in NOT_SECRET or not SECRET_NAME.search(last):
        return False
    return isinstance(value, (str, list, tuple, Mapping)) and len(value) > 0  # numbers and flags are no secrets


def redact_secrets(obj: Any) -> Any:
    """A copy of a nested dict / list config with every secret-looking string value replaced by ``REDACTED``."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret(str(k), v) else redact_secrets(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(v) for v in obj)
    return obj
