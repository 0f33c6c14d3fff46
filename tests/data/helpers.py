"""Helpers for the data tests: parquet writing and a printable-character tokenizer with a configurable template."""

from __future__ import annotations

import string

import pyarrow as pa
import pyarrow.parquet as pq

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# a Llama-like template that writes BOS itself; the tokenizer built with add_bos=True also adds BOS on encode
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def write_parquet(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def char_tokenizer(template: str = PLAIN_TEMPLATE, add_bos: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = template
    return tok


def row(content, ground_truth="1", data_source="test/src", **extra):
    out = {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"note": content[:3]},
    }
    out.update(extra)
    return out
