"""Tool parsers, the tool / interaction registries and YAML loading, and the shipped tools for real."""

import asyncio
import json
import socket
import textwrap
from pathlib import Path

import pytest

from scaletrain.agent import FunctionCall, ToolParser, load_interactions, load_tools
from scaletrain.agent.tools.calculator import CalculatorTool, evaluate
from scaletrain.agent.tools.code_runner import CodeRunnerTool
from scaletrain.agent.tools.retrieval_server import serve_in_thread
from scaletrain.agent.tools.search import SearchTool
from tests.agent.helpers import make_agent_tokenizer

TOK = make_agent_tokenizer()


def parse(text, name="hermes"):
    parser = ToolParser.get_tool_parser(name, TOK)
    return asyncio.run(parser.extract_tool_calls(TOK(text, add_special_tokens=False)["input_ids"]))


def test_hermes_parses_calls_and_skips_malformed():
    text = (
        'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>not json</tool_call>'
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call><tool_call>{"name": "open"'
    )
    content, calls, bad = parse(text)
    assert calls == [FunctionCall("calculator", '{"expression": "1+2"}'), FunctionCall("search", '{"query": "x"}')]
    assert bad == 4 and content.startswith("I will compute.")
    assert parse("no calls here") == ("no calls here", [], 0)


def test_parser_registry():
    @ToolParser.register("test_bang")
    class Bang(ToolParser):
        async def extract_tool_calls(self, response_ids):
            text = self.tokenizer.decode(response_ids)
            return text, [FunctionCall(w[1:], "{}") for w in text.split() if w.startswith("!")], 0

    assert parse("hi !calc", "test_bang")[1] == [FunctionCall("calc", "{}")]
    with pytest.raises(ValueError, match="unknown tool parser 'nope'.*hermes"):
        ToolParser.get_tool_parser("nope", TOK)


def execute(tool, **params):
    async def go():
        instance, _ = await tool.create()
        try:
            return await tool.execute(instance, params)
        finally:
            await tool.release(instance)

    return asyncio.run(go())


def test_calculator():
    assert evaluate("2*(3+4)**2 - 1/4") == 97.75
    assert execute(CalculatorTool(), expression="437+258")[0].text == "695"
    for bad in ("__import__('os')", "1/0", "9**999", "a+1"):
        response, _, metrics = execute(CalculatorTool(), expression=bad)
        assert response.text.startswith("Error") and metrics["error"] == 1.0


def test_code_runner_output_errors_limits_and_no_network():
    tool = CodeRunnerTool({"timeout": 2, "memory_mb": 256})
    assert execute(tool, code="print(6*7)")[0].text.strip() == "42"
    text = execute(tool, code="raise ValueError('bad')")[0].text
    assert "ValueError: bad" in text and "exit code" in text
    assert "timed out" in execute(tool, code="while True: pass")[0].text
    assert "MemoryError" in execute(tool, code="x = bytearray(1 << 30)")[0].text
    with socket.create_server(("127.0.0.1", 0)) as server:  # a host service the code knows the port of
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        net = execute(tool, code=code)[0].text
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever reached it
    assert "ConnectionRefusedError" in net and not net.startswith("connected"), net


def test_search_tool_against_local_retrieval_server():
    server, url = serve_in_thread(
        ["Paris is the capital of France.", "Berlin is the capital of Germany.", "Cats are small mammals."]
    )
    try:
        tool = SearchTool({"retrieval_service_url": url, "topk": 2, "num_workers": 2, "rate_limit": 50, "timeout": 5})
        response, _, metrics = execute(tool, query="capital of France")
        assert response.text.splitlines()[0] == "Doc 1: Paris is the capital of France." and not metrics

        async def many():
            inst, _ = await tool.create()
            return await asyncio.gather(*(tool.execute(inst, {"query": "cats"}) for _ in range(6)))

        assert all("Cats" in r[0].text for r in asyncio.run(many()))
        down = SearchTool({"retrieval_service_url": "http://127.0.0.1:9/retrieve", "timeout": 1})
        response, _, metrics = execute(down, query="x")
        assert response.text.startswith("Error: search failed") and metrics["error"] == 1.0
    finally:
        server.shutdown()


def test_load_tools_and_interactions_from_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        textwrap.dedent("""
        tools:
          - class_name: calculator
            config: {reward_correct: 1.0}
          - class_name: scaletrain.agent.tools.code_runner.CodeRunnerTool
            config: {timeout: 3}
            tool_schema: {type: function, function: {name: python, description: run code}}
    """)
    )
    tools = load_tools(str(path))
    assert [t.name for t in tools] == ["calculator", "python"] and tools[1].config["timeout"] == 3
    path.write_text("tools:\n  - class_name: nosuchtool\n")
    with pytest.raises(ValueError, match=r"tools\[0\].*nosuchtool"):
        load_tools(str(path))
    path.write_text("tools:\n  - class_name: search\n    config: {}\n")
    with pytest.raises(ValueError, match="retrieval_service_url"):
        load_tools(str(path))
    ipath = tmp_path / "interaction.yaml"
    ipath.write_text("interaction:\n  - name: checker\n    class_name: answer_checker\n    config: {max_attempts: 2}\n")
    interactions = load_interactions(str(ipath))
    assert list(interactions) == ["checker"] and interactions["checker"].config["max_attempts"] == 2
    assert json.dumps(tools[0].tool_schema)  # schemas are plain JSON


def test_shipped_example_configs_load():
    root = Path(__file__).resolve().parents[2] / "configs" / "agent"
    tools = load_tools(str(root / "tools.yaml"))
    assert [t.name for t in tools] == ["calculator", "code_runner", "search"]
    assert tools[2].config["retrieval_service_url"].startswith("http://127.0.0.1")
    interactions = load_interactions(str(root / "interaction.yaml"))
    assert list(interactions) == ["checker"] and interactions["checker"].config["max_attempts"] == 3
