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


def test_the_shapes_in_other_architectures():
    from scaletrain.models.tiny import tiny_config

    qwen3 = tiny_config("qwen3", 99, 0, 1, 2)
    assert type(qwen3).__name__ == "Qwen3Config" and qwen3.head_dim == 16 and qwen3.hidden_size == 64
    moe = tiny_config("qwen3_moe", 99, 0, 1, 2, shape="embedded")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.head_dim) == (4, 2, 128, 32)
    assert moe.decoder_sparse_step == 1 and not moe.mlp_only_layers  # every layer a mixture
    mixtral = tiny_config("mixtral", 99, 0, 1, 2, num_hidden_layers=3)
    assert (mixtral.num_local_experts, mixtral.intermediate_size, mixtral.num_hidden_layers) == (4, 32, 3)
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'; known: qwen2, qwen3, qwen3_moe, mixtral"):
        tiny_config("gpt2", 99, 0, 1, 2)
