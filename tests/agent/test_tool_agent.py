"""ToolAgentLoop state transitions, limits, tool failures / timeouts, interactions (scripted model)."""

import asyncio
import json
import time

import pytest

from scaletrain.agent import AgentState, BaseTool, ToolAgentLoop, ToolResponse
from scaletrain.agent.interactions.answer_checker import AnswerCheckerInteraction
from scaletrain.agent.tools.calculator import CalculatorTool
from tests.agent.helpers import ScriptedServer, char_ids, config, make_agent_tokenizer
from tests.backends.tiny import EOS_ID

TOK = make_agent_tokenizer()
PROMPT = [{"role": "user", "content": "What is 2+3?"}]


def call(name="calculator", **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def run(loop, **row):
    row.setdefault("raw_prompt", PROMPT)
    row.setdefault("request_id", "r0")
    return asyncio.run(loop.run({"temperature": 1.0}, **row))


def make_loop(script, tools=None, interactions=None, response_length=200, **cfg):
    server = ScriptedServer(script)
    loop = ToolAgentLoop(
        config(**cfg),
        server,
        TOK,
        response_length=response_length,
        tools=tools if tools is not None else {"calculator": CalculatorTool()},
        interactions=interactions,
    )
    return loop, server


def segments(out):
    """Runs of equal mask values: [(mask, ids)]."""
    runs = []
    for token, m in zip(out.response_ids, out.response_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


class RecordingLoop(ToolAgentLoop):
    """Records the state sequence."""

    async def _handle_pending(self, data):
        self.states = [AgentState.PENDING]
        return self._note(await super()._handle_pending(data))

    async def _handle_generating(self, data, params):
        return self._note(await super()._handle_generating(data, params))

    async def _handle_processing_tools(self, data):
        return self._note(await super()._handle_processing_tools(data))

    async def _handle_interacting(self, data, instance):
        return self._note(await super()._handle_interacting(data, instance))

    def _note(self, state):
        self.states.append(state)
        return state


def test_no_tool_call_terminates_after_one_turn():
    loop, server = make_loop(lambda rid, turn, p: ids("5"))
    out = run(loop)
    assert out.response_ids == ids("5") + [EOS_ID] and out.response_mask == [1, 1]
    assert out.response_logprobs == [-0.01, -0.02] and out.num_turns == 2
    assert out.prompt_ids == ids("<user>What is 2+3?<eos><assistant>")


def test_states_tool_call_then_answer():
    script = lambda rid, turn, p: ids(call(expression="2+3")) if turn == 0 else ids("5")  # noqa: E731
    server = ScriptedServer(script)
    loop = RecordingLoop(config(), server, TOK, response_length=200, tools={"calculator": CalculatorTool()})
    out = run(loop)
    S = AgentState
    assert loop.states == [S.PENDING, S.GENERATING, S.PROCESSING_TOOLS, S.GENERATING, S.TERMINATED]
    runs = segments(out)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert runs[0][1] == ids(call(expression="2+3")) + [EOS_ID]
    assert runs[1][1] == ids("<tool>5<eos><assistant>")  # template-rendered tool turn, mask 0
    assert runs[2][1] == ids("5") + [EOS_ID]
    # the second request's prompt is exactly the whole sequence so far
    assert server.calls[1][1] == out.prompt_ids + runs[0][1] + runs[1][1]
    assert out.metrics["tool_calls"] == 1 and out.metrics["tool_calls/calculator"] == 1
    assert out.num_turns == 4 and out.extra_fields["tool_rewards"] == [0.0]
    # log-probs: 0 on tool tokens, the engine's values on model tokens
    zero = [lp for lp, m in zip(out.response_logprobs, out.response_mask) if m == 0]
    assert zero and all(lp == 0.0 for lp in zero)


def test_model_tokens_kept_as_generated_not_re_encoded():
    # the model spells <tool_call> character by character; re-encoding would merge it into one token
    spelled = char_ids(TOK, call(expression="1+1"))
    loop, _ = make_loop(lambda rid, turn, p: spelled if turn == 0 else ids("2"))
    out = run(loop)
    runs = segments(out)
    assert runs[0][1] == spelled + [EOS_ID] and ids(call(expression="1+1")) != spelled
    assert out.metrics["tool_calls"] == 1


def test_max_assistant_turns_and_user_turns():
    always_call = lambda rid, turn, p: ids(call(expression="1"))  # noqa: E731
    loop, server = make_loop(always_call, max_assistant_turns=3)
    out = run(loop)
    assert len(server.calls) == 3 and out.metrics["assistant_turns"] == 3
    loop, server = make_loop(always_call, max_user_turns=2)
    out = run(loop)
    assert out.metrics["user_turns"] == 2 and len(server.calls) == 2


def test_response_length_budget():
    loop, server = make_loop(lambda rid, turn, p: ids(call(expression="1+2")), response_length=120)
    out = run(loop)
    assert len(out.response_ids) <= 120 and len(out.response_mask) == len(out.response_ids)
    # every request asked for at most the remaining budget
    used = 0
    for _, prompt, params, got in server.calls:
        assert params["max_new_tokens"] == 120 - (len(prompt) - len(out.prompt_ids))
        used = len(prompt) - len(out.prompt_ids) + len(got)
    assert used <= 120


def test_turn_without_eos_terminates():
    loop, server = make_loop(lambda rid, turn, p: (ids(call(expression="1")), "length"))
    out = run(loop)
    assert len(server.calls) == 1 and out.metrics.get("tool_calls", 0) == 0


class FlakyTool(BaseTool):
    default_schema = {"type": "function", "function": {"name": "flaky"}}
    released: list = []

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("mode") == "raise":
            raise RuntimeError("boom")
        if parameters.get("mode") == "sleep":
            await asyncio.sleep(parameters.get("s", 10))
        return ToolResponse(text="x" * parameters.get("n", 3)), 0.5, {}

    async def release(self, instance_id, **kwargs):
        FlakyTool.released.append(instance_id)
        await super().release(instance_id)


def tool_text(out):
    return TOK.decode(segments(out)[1][1])


@pytest.mark.parametrize(
    "args, expect, counter",
    [
        ({"mode": "raise"}, "Error when executing tool 'flaky': RuntimeError: boom", "tool_errors"),
        ({"mode": "sleep", "s": 10}, "Error: tool 'flaky' timed out after 0.2 s", "tool_timeouts"),
    ],
)
def test_tool_failure_and_timeout_come_back_as_text(args, expect, counter):
    FlakyTool.released = []
    loop, _ = make_loop(
        lambda rid, turn, p: ids(call("flaky", **args)) if turn == 0 else ids("ok"),
        tools={"flaky": FlakyTool()},
        tool_timeout_s=0.2,
    )
    out = run(loop)
    assert expect in tool_text(out)
    assert out.metrics[counter] == 1 and out.metrics["tool_errors"] == 1
    assert len(FlakyTool.released) == 1  # release ran despite the failure


def test_unknown_tool_and_malformed_call():
    text = call("nope", a=1) + '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    loop, _ = make_loop(lambda rid, turn, p: ids(text) if turn == 0 else ids("ok"))
    out = run(loop)
    assert "Error: unknown tool 'nope'" in tool_text(out)
    assert out.metrics["parse_errors"] == 1 and out.metrics["tool_errors"] == 1


def test_parallel_calls_run_concurrently_and_are_capped():
    three = "".join(call("flaky", mode="sleep", s=0.3) for _ in range(3))
    loop, _ = make_loop(
        lambda rid, turn, p: ids(three) if turn == 0 else ids("ok"), tools={"flaky": FlakyTool()}, max_parallel_calls=2
    )
    start = time.perf_counter()
    out = run(loop)
    assert time.perf_counter() - start < 0.55  # two 0.3 s calls overlapped
    assert out.metrics["tool_calls"] == 2 and out.metrics["tool_calls_dropped"] == 1


@pytest.mark.parametrize(
    "side, expect",
    [("left", "xxxxAB...(truncated)"), ("right", "(truncated)...YZzzzz"), ("middle", "xxx...(truncated)...zzz")],
)
def test_tool_response_truncation(side, expect):
    class Long(BaseTool):
        default_schema = {"type": "function", "function": {"name": "long"}}

        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="xxxxAB" + "m" * 50 + "YZzzzz"), 0.0, {}

    loop, _ = make_loop(
        lambda rid, turn, p: ids(call("long")) if turn == 0 else ids("ok"),
        tools={"long": Long()},
        max_tool_response_length=6,
        tool_response_truncate_side=side,
    )
    assert tool_text(run(loop)) == f"<tool>{expect}<eos><assistant>"


def test_tool_selection_and_create_kwargs():
    loop, _ = make_loop(
        lambda rid, turn, p: ids(call(expression="2+3")) if turn == 0 else ids("5"),
        tools={"calculator": CalculatorTool({"reward_correct": 1.0}), "flaky": FlakyTool()},
    )
    out = run(
        loop,
        extra_info={
            "tool_selection": ["calculator"],
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "5"}}},
        },
    )
    assert out.extra_fields["tool_rewards"] == [1.0]
    with pytest.raises(ValueError, match="unknown tools \\['missing'\\]"):
        run(loop, extra_info={"tool_selection": ["missing"]})


def test_interaction_wrong_then_right():
    answers = ["7", "6", "5"]
    checker = AnswerCheckerInteraction({"max_attempts": 5})
    server = ScriptedServer(lambda rid, turn, p: ids(answers[turn]))
    loop = RecordingLoop(config(), server, TOK, response_length=200, tools={}, interactions={"checker": checker})
    out = run(loop, extra_info={"interaction_kwargs": {"name": "checker", "ground_truth": "5"}})
    S = AgentState
    assert loop.states == [
        S.PENDING,
        S.GENERATING,
        S.INTERACTING,
        S.GENERATING,
        S.INTERACTING,
        S.GENERATING,
        S.INTERACTING,
        S.TERMINATED,
    ]
    assert out.extra_fields["turn_scores"] == [0.0, 0.0, 1.0]
    runs = segments(out)
    assert runs[1] == (0, ids("<user>Your answer is wrong. Try again.<eos><assistant>"))
    assert out.num_turns == 7 and checker._instances == {}  # finalized


def test_interaction_max_attempts_terminates():
    checker = AnswerCheckerInteraction({"max_attempts": 2})
    loop, server = make_loop(lambda rid, turn, p: ids("9"), tools={}, interactions={"c": checker})
    out = run(loop, extra_info={"interaction_kwargs": {"ground_truth": "5"}})
    assert len(server.calls) == 2 and out.extra_fields["turn_scores"] == [0.0, 0.0]
