"""Helpers for the agent tests: a chat tokenizer whose turns end with EOS, a scripted server, configs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from backends.rollout.base import TokenOutput
from scaletrain.agent.server import LocalEngineBackend
from scaletrain.agent.tools.pids_cgroup import read_text
from scaletrain.workers.config import MultiTurnConfig
from tests.backends.tiny import EOS_ID, make_tokenizer

# prepended to a code_runner program: names its process (and the children it forks) for ``pids_named``
SET_NAME = "import ctypes\nctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME

# every turn ends with the EOS token, so an assistant turn the model ended with EOS re-renders exactly
AGENT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
# multi-character tokens (as a BPE vocabulary would have): single ids a model may also spell char by char
EXTRA_TOKENS = ["<tool_call>", "</tool_call>", '{"name":', '"calculator"', ',"arguments":', '{"expression":']


def make_agent_tokenizer():
    tok = make_tokenizer()
    tok.add_tokens(EXTRA_TOKENS, special_tokens=False)
    tok.chat_template = AGENT_TEMPLATE
    return tok


def config(**overrides) -> MultiTurnConfig:
    settings = dict(enable=True, format="hermes", tool_timeout_s=5.0)
    settings.update(overrides)
    return MultiTurnConfig(**settings)


def char_ids(tokenizer, text: str) -> list[int]:
    """``text`` spelled one character per token (non-canonical where the tokenizer has multi-char tokens)."""
    vocab = tokenizer.get_vocab()
    return [vocab[c] for c in text]


class ScriptedServer:
    """Answers ``generate`` with scripted turns: ``script(request_id, turn, prompt_ids) -> token ids`` (EOS added
    unless the script returns a tuple (ids, "length")). Log-prob of the k-th token of a turn: -(k + 1) / 100."""

    def __init__(self, script: Callable, delay_s: float = 0.0) -> None:
        self.script, self.delay_s = script, delay_s
        self.turns: dict[str, int] = {}
        self.calls: list[tuple[str, list[int], dict, list[int]]] = []

    async def generate(self, request_id, prompt_ids, sampling_params, multi_modal_inputs=None) -> TokenOutput:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        turn = self.turns.get(request_id, 0)
        self.turns[request_id] = turn + 1
        result = self.script(request_id, turn, list(prompt_ids))
        ids, reason = result if isinstance(result, tuple) else (list(result) + [EOS_ID], "stop")
        ids = ids[: sampling_params["max_new_tokens"]]
        if len(ids) == sampling_params["max_new_tokens"] and reason == "stop" and ids[-1] != EOS_ID:
            reason = "length"
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params), list(ids)))
        return TokenOutput(ids, [-(k + 1) / 100 for k in range(len(ids))], reason)


class SpyBackend(LocalEngineBackend):
    """In-process engines that record every (prompt ids, sampled ids) they were asked and gave."""

    def __init__(self, engines):
        super().__init__(engines)
        self.sampled: list[tuple[list[int], list[int]]] = []

    def generate(self, per_rank):
        outs = super().generate(per_rank)
        for reqs, rank_outs in zip(per_rank, outs):
            self.sampled += [(list(r.prompt_ids), list(o.token_ids)) for r, o in zip(reqs, rank_outs)]
        return outs


def pids_named(name: str) -> list[int]:
    """Live host pids whose command name (``/proc/<pid>/comm``) is ``name`` (zombies are dead: left out): how the
    host finds a code_runner program's processes, whatever pid namespace they run in."""
    pids = [p for p in os.listdir("/proc") if p.isdigit() and read_text(f"/proc/{p}/comm").strip() == name]
    return [int(p) for p in pids if "State:\tZ" not in read_text(f"/proc/{p}/status")]
