"""scaletrain/models/tiny.py: the one definition of the tiny Qwen2 shapes the embedded default, the tests and the
benchmarks build."""

import pytest

from scaletrain.models.tiny import SHAPES, tiny_qwen2_config


def test_a_shape_for_a_vocabulary_with_overrides():
    cfg = tiny_qwen2_config(99, 0, 1, 2, shape="embedded", max_position_embeddings=256)
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (99, 0, 1, 2)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 512, 2)
    assert cfg.max_position_embeddings == 256 and cfg.tie_word_embeddings
    assert tiny_qwen2_config(10, 0, 1, 2, num_key_value_heads=1).num_key_value_heads == 1
    assert tiny_qwen2_config(10, 0, 1, 2).hidden_size == SHAPES["test"]["hidden_size"] == 64


def test_an_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown tiny model shape 'huge'; known: test, embedded"):
        tiny_qwen2_config(10, 0, 1, 2, shape="huge")
