"""A tiny Qwen2 taught (a few seconds of SFT) to call the calculator, so multi-turn paths run on a real model.

Conversations: user ``"12+34"`` -> assistant ``<tool_call>{"name":"calculator","arguments":{"expression":
"12+34"}}</tool_call>`` -> tool ``"46"`` -> assistant ``"46"``; loss on the assistant tokens only (EOS included).
A random tiny model never emits a tool call; after this warm-up it does most of the time, which is what the
end-to-end tests need (the numbers it copies need not be right).
"""

from __future__ import annotations

import json
import os
import random

import torch

from tests.agent.helpers import make_agent_tokenizer

CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"%s"}}</tool_call>'


def problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}", str(a + b)


def conversation(question: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": CALL % question},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def encode(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask): assistant contents and their EOS are trained."""
    ids, mask = [], []
    for m in messages:
        head = tok(f"<{m['role']}>", add_special_tokens=False)["input_ids"]
        body = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def build_tool_model(path: str, steps: int = 250, seed: int = 0) -> str:
    """Write the warmed-up model + tokenizer to ``path`` (skipped when already there); returns ``path``."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    from transformers import Qwen2ForCausalLM

    from scaletrain.models.tiny import tiny_qwen2_config

    tok = make_agent_tokenizer()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    cfg = tiny_qwen2_config(len(tok), 0, 1, 2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = [encode(tok, conversation(*problem(rng))) for _ in range(32)]
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
        mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows])
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "warmup.json"), "w") as f:
        json.dump({"steps": steps, "final_loss": loss.item()}, f)
    return path
