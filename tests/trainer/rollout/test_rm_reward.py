"""The reward model's keys and glue, without Ray: checks before Ray (tokenizers, checkpoint kind, megatron layout),
how its score joins the rule reward, and the re-tokenized inputs of an RM with its own chat template."""

import numpy as np
import pytest
import torch

from scaletrain.protocol import DataProto
from scaletrain.trainer.rollout.rm_reward import combine_rewards
from scaletrain.utils.typed_config import ConfigError
from scaletrain.workers.rm_inputs import retokenized_inputs
from tests.trainer.config.test_ppo_config import checked


def save_char_rm(path) -> str:
    """A tiny sequence-classification RM over tests/backends/tiny.py's character vocabulary (not the policy's)."""
    from transformers import AutoModelForSequenceClassification

    from tests.backends.tiny import make_tokenizer, tiny_qwen2_config

    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(tiny_qwen2_config(num_labels=1)).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def save_embedded_vocab_rm(path) -> str:
    """A tiny sequence-classification RM over the embedded default's vocabulary (the policy's)."""
    from transformers import AutoModelForSequenceClassification

    from scaletrain.data.embedded import tiny_qwen2_config
    from scaletrain.data.tokenizer import save_arithmetic_tokenizer

    torch.manual_seed(4)
    AutoModelForSequenceClassification.from_config(tiny_qwen2_config(num_labels=1)).save_pretrained(path)
    save_arithmetic_tokenizer(str(path))
    return str(path)


def test_rm_keys_are_checked_before_ray(tmp_path):
    char_rm, same_rm = save_char_rm(tmp_path / "char"), save_embedded_vocab_rm(tmp_path / "same")
    policy = str(tmp_path / "policy")
    from scaletrain.data.tokenizer import save_arithmetic_tokenizer

    save_arithmetic_tokenizer(policy)
    on = ["reward_model.enable=true"]
    ok = checked(*on, f"reward_model.model.path={same_rm}")
    assert ok.reward_model.model.input_tokenizer is None and ok.reward_model.micro_batch_size_per_gpu == 8
    checked(*on, f"reward_model.model.path={char_rm}", f"reward_model.model.input_tokenizer={policy}")
    bad = {
        "reward_model.enable needs reward_model.model.path": [],
        "the reward model's tokenizer differs from the policy's (16 vs 99 tokens)": [
            f"reward_model.model.path={char_rm}"
        ],
        "reward_model.model.input_tokenizer: must be the policy's tokenizer": [
            f"reward_model.model.path={same_rm}",
            f"reward_model.model.input_tokenizer={char_rm}",
        ],
        "reward_model.micro_batch_size_per_gpu must be positive": [
            f"reward_model.model.path={same_rm}",
            "reward_model.micro_batch_size_per_gpu=0",
        ],
        "reward_model.model.path: not found: /no/rm": ["reward_model.model.path=/no/rm"],
    }
    for message, overrides in bad.items():
        with pytest.raises(ConfigError) as info:
            checked(*on, *overrides)
        assert message in str(info.value), (message, str(info.value))


def test_a_causal_lm_is_refused_as_reward_model(tmp_path):
    from scaletrain.data.embedded import save_tiny_model

    path = save_tiny_model(tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"Qwen2ForCausalLM; the reward model must be a \*ForSequenceClassification"):
        checked("reward_model.enable=true", f"reward_model.model.path={path}")


def test_megatron_checks_the_rm_against_the_shared_layout(tmp_path):
    rm = save_embedded_vocab_rm(tmp_path / "rm")  # 4 heads, 2 KV heads: TP=4 cannot split the KV heads
    with pytest.raises(ConfigError, match="reward_model.model.path: .*shares the actor's layout"):
        checked(
            "backend=megatron",
            "trainer.n_gpus_per_node=4",
            "reward_model.enable=true",
            f"reward_model.model.path={rm}",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        )


def test_rm_score_replaces_or_adds_to_the_rule_reward():
    rm = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, -1.5]])
    alone = combine_rewards(rm, None)
    assert torch.equal(alone["reward_tensor"], rm) and alone["reward_extra_info"]["rm_score"] == [0.5, -1.5]
    assert alone["metrics"]["reward_model/score/mean"] == pytest.approx(-0.5)
    rule = {
        "reward_tensor": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        "reward_extra_info": {"score": [1.0, 0.0]},
        "metrics": {"reward/score_mean": 0.5},
    }
    both = combine_rewards(rm, rule)
    assert torch.equal(both["reward_tensor"], torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, -1.5]]))
    assert both["reward_extra_info"] == {"score": [1.0, 0.0], "rm_score": [0.5, -1.5], "rule_score": [1.0, 0.0]}
    assert both["metrics"]["reward/score_mean"] == 0.5 and both["metrics"]["reward_model/score/max"] == 0.5
    weighted = combine_rewards(rm, rule, (0.5, 2.0))  # each component times its weight, logged unweighted
    assert torch.equal(weighted["reward_tensor"], torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, -3.0]]))
    assert weighted["reward_extra_info"]["rule_score"] == [1.0, 0.0]
    assert weighted["reward_extra_info"]["rm_score"] == [0.5, -1.5]
    assert torch.equal(combine_rewards(rm, None, (0.5, 2.0))["reward_tensor"], rm * 2.0)


def test_retokenized_inputs_render_the_rm_chat_template():
    from scaletrain.data.tokenizer import build_arithmetic_tokenizer
    from tests.backends.tiny import make_tokenizer

    policy, rm = build_arithmetic_tokenizer(), make_tokenizer()
    prompts = ["12+34=", "7+8="]
    responses = [[8, 10, 2], [5, 9]]  # "46<eos>" (EOS dropped when decoded), "15"
    P, R = 6, 4
    prompt_ids = torch.zeros((2, P), dtype=torch.long)
    response_ids = torch.zeros((2, R), dtype=torch.long)
    mask = torch.zeros((2, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = policy(p, add_special_tokens=False)["input_ids"]
        prompt_ids[i, P - len(ids) :] = torch.tensor(ids)
        response_ids[i, : len(r)] = torch.tensor(r)
        mask[i, P - len(ids) : P + len(r)] = 1
    raw = np.empty(len(prompts), dtype=object)  # one list of chat messages per row
    for i, p in enumerate(prompts):
        raw[i] = [{"role": "user", "content": p}]
    data = DataProto.from_dict(
        {"prompts": prompt_ids, "responses": response_ids, "attention_mask": mask}, {"raw_prompt": raw}
    )
    inputs, truncated = retokenized_inputs(data, policy, rm, max_length=None)
    expected = ["<user>12+34=<assistant>46", "<user>7+8=<assistant>15"]
    am = inputs.batch["attention_mask"]
    for i, text in enumerate(expected):
        assert rm.decode(inputs.batch["input_ids"][i][am[i].bool()]) == text
        assert am[i].sum().item() == len(text) and am[i][: len(text)].all()  # right-padded
        assert inputs.batch["position_ids"][i][: len(text)].tolist() == list(range(len(text)))
    assert truncated == 0
    cut, truncated = retokenized_inputs(data, policy, rm, max_length=10)
    assert truncated == 2 and rm.decode(cut.batch["input_ids"][0]) == "assistant>46"[-10:]
