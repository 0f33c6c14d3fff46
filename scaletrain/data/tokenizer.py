"""The embedded default task's character-level tokenizer (16 tokens), as a Hugging Face fast tokenizer.

Vocabulary (ids fixed): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then ``0``-``9`` (4-13), ``+`` 14,
``=`` 15. Every character is one token (a WordLevel model behind a split-every-character pre-tokenizer; the
``Fuse`` decoder joins tokens back without spaces). Any other character, spaces included, becomes ``<unk>``.
The special-token strings are recognised in text, so ``"695<eos>"`` encodes to the digits then the EOS id.

No special tokens are added by ``encode`` (no post-processor) and the chat template writes no BOS either: the
prompt of ``"437+258="`` is exactly those 8 characters, the form the platform recipe measured. All prompts of the
task have the same length, so a BOS anchor buys nothing; ``<bos>`` exists only so configs can name one.

Chat template: each message renders as its bare content; an assistant message is followed by ``<eos>`` (so a
user/assistant pair renders ``"437+258=695<eos>"``, ready for SFT); ``add_generation_prompt`` adds nothing.
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789+="
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
MODEL_MAX_LENGTH = 64

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def arithmetic_vocab() -> dict[str, int]:
    """Token -> id for the 16-token vocabulary."""
    return {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHARACTERS))}


def build_arithmetic_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over ``arithmetic_vocab()`` with the chat template above."""
    from scaletrain.models.tiny import char_level_tokenizer

    tokenizer = char_level_tokenizer(
        arithmetic_vocab(),
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=MODEL_MAX_LENGTH,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):  # guards the fixed ids the model config relies on
        raise RuntimeError(f"unexpected special token ids {ids}")
    return tokenizer


def save_arithmetic_tokenizer(path: str) -> str:
    """Write the tokenizer with ``save_pretrained`` (loadable by ``AutoTokenizer.from_pretrained(path)``)."""
    build_arithmetic_tokenizer().save_pretrained(path)
    return path
