"""Secrets out of every output (a shared utility: the trainer's trackers, run files, logs and console use it).

Config values (``redact_secrets``): a key is a secret's when its last name contains ``token``, ``key``,
``password`` / ``passwd``, ``secret``, ``credential``, ``auth`` or ``bearer`` (any case) and its value is a
non-empty string, list or mapping: all of it is redacted. Numbers and flags such as ``max_num_batched_tokens``
stay, and so do the config's own string keys that only name things (``NOT_SECRET``: ``data.prompt_key`` names a
column, ``input_tokenizer`` a path; no default value of the trainers' configs is redacted). Any other string is
redacted where its value looks like a secret (``VALUE_PATTERNS``): a URL's password
(``https://user:PASSWORD@host``), a bearer token, and the prefixes of common API tokens (OpenAI ``sk-``, GitHub
``ghp_`` / ``github_pat_``, Hugging Face ``hf_``, Slack ``xox?-``, AWS ``AKIA``, GitLab ``glpat-``).

Free text (a log line, an error message, a function's repr, Hydra's echo of the overrides of a failed run) goes
through ``redact_text``: the same value patterns, ``name=value`` and ``'name': 'value'`` pairs under a
secret-looking name, and the exact secret values of the run's command line and config (``install_scrubbing``,
``remember_secrets``). ``install_scrubbing`` puts that on the driver's stdout / stderr (the CLI entry points);
``ScrubFilter`` is on every log handler (trainer/run/console.py); wandb sees a ``scrubbed_argv``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

SECRET_WORDS = r"token|key|passw(?:or)?d|secret|credential|auth(?!ors?\b)|bearer"
SECRET_NAME = re.compile(SECRET_WORDS, re.IGNORECASE)
NOT_SECRET = frozenset(  # the configs' keys whose values name columns or paths
    {
        "prompt_key",
        "response_key",
        "reward_fn_key",
        "image_key",
        "video_key",
        "gdpo_reward_keys",
        "input_tokenizer",
        "tokenizer",
        "tokenizer_path",
    }
)
REDACTED = "***redacted***"
# a name ending so names a setting about a secret, not the secret (RAY_AUTH_MODE=disabled, token_path=/x)
SETTING_NAME = re.compile(r"(?i)(mode|type|path|file|dir|name)$")
MIN_KNOWN_LENGTH = 6  # shorter config values are not searched for in free text (too many false matches)

VALUE_PATTERNS = (
    (re.compile(r"(://[^\s:/@'\"]+:)[^\s@/'\"]+(@)"), rf"\1{REDACTED}\2"),  # a URL's password
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), rf"\1{REDACTED}"),
    (
        re.compile(
            r"\b(?:sk-[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|hf_[A-Za-z0-9]{20,}"
            r"|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|glpat-[A-Za-z0-9_-]{20,})"
        ),
        REDACTED,
    ),
)
# name=value (overrides, kwargs reprs, environment lines) and 'name': 'value' (dict reprs) under a secret name
_NAMED_ASSIGNMENT = re.compile(rf"(?i)\b([\w.-]*(?:{SECRET_WORDS})[\w-]*)(\s*=\s*)(['\"]?)([^\s'\",;)}}\]]+)")
_NAMED_ITEM = re.compile(rf"(?i)(['\"])([\w.-]*(?:{SECRET_WORDS})[\w-]*)\1(\s*:\s*)(['\"])(.*?)\4")

_known: set[str] = set()  # this process's secret config values (remember_secrets)


def is_secret(name: str, value: Any) -> bool:
    """``name``: a key, or a dotted path whose last part is the key."""
    last = name.rsplit(".", 1)[-1]
    if last in NOT_SECRET or not SECRET_NAME.search(last):
        return False
    return isinstance(value, (str, list, tuple, Mapping)) and len(value) > 0  # numbers and flags are no secrets


def redact_value(text: str) -> str:
    """``text`` with every part that looks like a secret by its value (``VALUE_PATTERNS``) redacted."""
    for pattern, replacement in VALUE_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_secrets(obj: Any) -> Any:
    """A copy of a nested dict / list config with every secret value replaced by ``REDACTED``: all of a
    secret-looking key's value, and the secret-looking parts of any other string."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret(str(k), v) else redact_secrets(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(v) for v in obj)
    return redact_value(obj) if isinstance(obj, str) else obj


def _keep_named(name: str, value: str) -> bool:
    last = name.rsplit(".", 1)[-1].lstrip("+~")
    if last in NOT_SECRET or SETTING_NAME.search(last) or value == REDACTED:
        return True
    return value.lower() in ("true", "false", "none", "null") or re.fullmatch(r"[-+]?[\d.e_]+", value) is not None


def _redact_assignment(m: re.Match) -> str:
    name, sep, quote, value = m.groups()
    return m.group(0) if _keep_named(name, value) else f"{name}{sep}{quote}{REDACTED}"


def _redact_item(m: re.Match) -> str:
    q, name, sep, vq, value = m.groups()
    return m.group(0) if _keep_named(name, value) else f"{q}{name}{q}{sep}{vq}{REDACTED}{vq}"


def redact_text(text: str) -> str:
    """Free text with the secrets in it redacted: the remembered config values, secret-looking values, and the
    values of ``name=value`` / ``'name': 'value'`` pairs whose name looks like a secret's."""
    for secret in sorted(_known, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = redact_value(text)
    text = _NAMED_ASSIGNMENT.sub(_redact_assignment, text)
    return _NAMED_ITEM.sub(_redact_item, text)


def remember_secrets(config: Any, name: str = "") -> None:
    """Remembers the secret values of ``config`` (a nested dict / list) for ``redact_text``."""
    if is_secret(name, config):
        _known.update(s for s in _strings(config) if len(s) >= MIN_KNOWN_LENGTH)
    elif isinstance(config, Mapping):
        for k, v in config.items():
            remember_secrets(v, str(k))
    elif isinstance(config, (list, tuple)):
        for v in config:
            remember_secrets(v, name)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


class ScrubFilter(logging.Filter):
    """On a handler: the record's message, traceback and stack as ``redact_text`` leaves them."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return True
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


class ScrubbedStream:
    """A text stream writing what ``redact_text`` leaves of each write; everything else is the stream's."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_text(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def install_scrubbing(overrides: Sequence[str] = ()) -> None:
    """Driver side (the CLI entry points, before Hydra parses the command line): remembers the secret values of
    the ``key=value`` overrides and scrubs this process's stdout and stderr from here on, so that even Hydra's echo
    of a failed run's overrides and tracebacks carry none. The composed config's secrets (a YAML file's,
    ``${oc.env:...}``'s) are for the entry point to ``remember_secrets`` once it has them."""
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:
            remember_secrets(value, key.lstrip("+~"))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, ScrubbedStream):
            setattr(sys, name, ScrubbedStream(stream))


@contextlib.contextmanager
def scrubbed_argv() -> Iterator[None]:
    """``sys.argv`` redacted for the block (wandb records the command line in its run metadata)."""
    saved = list(sys.argv)
    sys.argv[:] = [redact_text(arg) for arg in saved]
    try:
        yield
    finally:
        sys.argv[:] = saved
