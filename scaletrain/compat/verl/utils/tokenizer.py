"""``verl.utils.hf_tokenizer`` / ``hf_processor``: a model's tokenizer (with a pad token) and its processor
(scaletrain.models.processor's: images only where torchvision is missing)."""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoTokenizer

from scaletrain.models.processor import load_processor

logger = logging.getLogger(__name__)

__all__ = ["hf_processor", "hf_tokenizer"]


def hf_tokenizer(name_or_path: str, correct_pad_token: bool = True, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained``; with ``correct_pad_token`` a tokenizer without a pad token pads with EOS."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if correct_pad_token and tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        logger.warning(
            "tokenizer %s has no pad token: padding with its EOS token %r", name_or_path, tokenizer.eos_token
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def hf_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The model's multimodal processor; None for a text-only model (whose "processor" is its tokenizer)."""
    return load_processor(name_or_path, trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
