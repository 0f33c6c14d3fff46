"""Tools cannot take the driver down (issue 16, item 6): the calculator bounds an expression's cost before
evaluating it; code_runner streams and caps output, caps concurrent runs, processes (a pids cgroup, or
RLIMIT_NPROC on the sandbox's uid) and file sizes, in the sandbox and, forced with ``allow_unsandboxed`` where
there is none, without it (where it reports or refuses a run without network isolation); a tool whose create /
release hangs is cut off by the agent loop. Real subprocesses, real bubblewrap, real asyncio. The attacks on the
sandbox itself are in ``test_sandbox_escapes.py``."""

import asyncio
import json
import logging
import os
import time

import pytest

from scaletrain.agent import BaseTool, ToolAgentLoop, ToolResponse
from scaletrain.agent.tools import code_runner, python_process
from scaletrain.agent.tools.calculator import CalculatorTool, evaluate
from scaletrain.agent.tools.code_runner import CodeRunnerTool, pids_cgroup_parent
from tests.agent.helpers import SET_NAME, ScriptedServer, config, make_agent_tokenizer, pids_named
from tests.agent.test_parser_tools import execute

TOK = make_agent_tokenizer()
NO_NET = "code_runner/no_network_isolation"


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    "expression",
    [
        "((9**99)**99)**99",
        "(((9**99)**99)**99)**99",
        "(10**100)**100",
        "*".join(["9**99"] * 60),  # each product small, the chain not
        "(" * 240 + "1" + ")" * 240,  # deeply nested parentheses
        "-" * 300 + "1",  # deeply nested unary operators
        "9**99**99",
        "2**(10**400)",
        "(-8)**0.5",
    ],
)
def test_calculator_refuses_costly_expressions_quickly(expression):
    (response, _, metrics), seconds = timed(execute, CalculatorTool(), expression=expression)
    assert response.text.startswith("Error: ") and metrics["error"] == 1.0, response.text[:200]
    assert len(response.text) < 300 and seconds < 0.5


def test_calculator_normal_expressions_stay_exact():
    cases = {
        "2**100": str(2**100),
        "9**99*9**99": str(9**198),
        "(10**43)**99": str(10**4257),  # 4258 digits: just under the limit
        "+".join(["7"] * 100): "700",
        "2*(3+4)**2 - 1/4": "97.75",
        "-(-3)**3 % 5": "2",
        "2**-2": "0.25",
    }
    for expression, expected in cases.items():
        response, _, metrics = execute(CalculatorTool(), expression=expression)
        assert response.text == expected and not metrics, expression
    assert evaluate("123456789**7") == 123456789**7


# ------------------------------------------------------------------------------------------------ code_runner
def test_endless_printing_is_stopped_at_the_output_cap():
    tool = CodeRunnerTool({"timeout": 20, "max_output_chars": 3000})
    (response, _, metrics), seconds = timed(execute, tool, code="while True: print('x' * 10000)")
    assert seconds < 3  # stopped at the cap, long before the 20 s timeout
    head, _, tail = response.text.partition("...(truncated)")
    assert head == "x" * 3000 and "output exceeded 3000 characters" in tail and metrics["error"] == 1.0


def test_output_under_the_cap_and_partial_output_on_timeout():
    tool = CodeRunnerTool({"timeout": 1, "max_output_chars": 3000})
    response, _, metrics = execute(tool, code="print('é' * 2999)")
    assert response.text == "é" * 2999 + "\n" and "error" not in metrics
    text = execute(tool, code="print('started', flush=True)\nwhile True: pass")[0].text
    assert text == "started\n\nError: timed out after 1.0 s"


def test_at_most_max_concurrency_children_run_at_once():
    tool = CodeRunnerTool({"timeout": 10, "max_concurrency": 2})
    code = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"

    async def go():
        return await asyncio.gather(*(tool.execute("i", {"code": code}) for _ in range(8)))

    results, seconds = timed(asyncio.run, go())
    spans = [tuple(map(float, response.text.split())) for response, _, _ in results]
    # the child's own clock: a subset of the time it held its slot, so an overlap count over it is a lower bound
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert 1 <= peak <= 2 and seconds >= 4 * 0.5  # 8 runs of 0.5 s, 2 at a time: 4 rounds at least


def test_a_file_over_max_file_mb_cannot_be_written():
    tool = CodeRunnerTool({"timeout": 10})  # max_file_mb: 16 by default
    code = "with open('big', 'wb') as f:\n    for _ in range(100):\n        f.write(b'x' * (1 << 20))\nprint('wrote')"
    (response, _, metrics), seconds = timed(execute, tool, code=code)
    assert "File too large" in response.text and "wrote" not in response.text and metrics["error"] == 1.0
    assert seconds < 5


FORKS = (
    "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
    "            time.sleep(0.3)\n            os._exit(0)\n        n += 1\nexcept OSError as exc:\n"
    "    print('refused after', n, type(exc).__name__)\nelse:\n    print('forked', n)\n"
    "try:\n    while True:\n        os.wait()\nexcept ChildProcessError:\n    pass\n"
)


def test_forks_beyond_max_processes_are_refused():
    if pids_cgroup_parent() is None and os.geteuid() == 0:
        pytest.skip("root without a writable pids cgroup: no process limit here (see the root test below)")
    text, _, metrics = execute(CodeRunnerTool({"timeout": 10, "max_processes": 16}), code=FORKS)
    words = text.text.split()
    assert words[:2] == ["refused", "after"] and int(words[2]) < 16 and words[3] == "BlockingIOError", text.text
    assert "code_runner/no_process_limit" not in metrics


def test_without_a_cgroup_the_sandboxs_uid_is_limited_by_rlimit_nproc(monkeypatch):
    monkeypatch.setattr(code_runner.RunCgroup, "make", classmethod(lambda cls, n: None))  # no cgroup available
    text, _, metrics = execute(CodeRunnerTool({"timeout": 10, "max_processes": 16}), code=FORKS)
    words = text.text.split()
    assert words[:2] == ["refused", "after"] and int(words[2]) < 16, text.text
    assert "code_runner/no_process_limit" not in metrics and "code_runner/unsandboxed" not in metrics


def test_unsandboxed_without_a_cgroup_root_is_not_limited_and_the_run_says_so(monkeypatch, no_sandbox):
    """What RLIMIT_NPROC does as root, measured: nothing (the kernel exempts uid 0); the run reports it."""
    if os.geteuid() != 0:
        pytest.skip("RLIMIT_NPROC binds a non-root user")
    monkeypatch.setattr(code_runner.RunCgroup, "make", classmethod(lambda cls, n: None))  # no cgroup available
    tool = CodeRunnerTool({"timeout": 10, "max_processes": 16, "allow_unsandboxed": True})
    response, _, metrics = execute(tool, code=FORKS)
    assert response.text.strip() == "forked 100" and metrics["code_runner/no_process_limit"] == 1.0
    assert metrics["code_runner/unsandboxed"] == 1.0


def test_a_process_that_left_the_session_is_killed_with_its_cgroup(unsandboxed):
    if pids_cgroup_parent() is None and unsandboxed:
        pytest.skip("no writable pids cgroup")
    name = f"left{os.getpid() % 10000}"
    code = SET_NAME.format(name=name) + (
        "import os, sys, time\nready, told = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
        "    print('forked', flush=True)\n    os.close(1); os.close(2)\n    os.write(told, b'x')\n    time.sleep(60)\n"
        "else:\n    os.read(ready, 1)\n"  # the program ends once its child has printed: no race with the kill
    )
    response, _, _ = execute(CodeRunnerTool({"timeout": 10, "allow_unsandboxed": unsandboxed}), code=code)
    assert response.text.split() == ["forked"], response.text
    time.sleep(0.1)  # SIGKILL is asynchronous
    assert pids_named(name) == []
    if pids_cgroup_parent() is not None:
        assert [d for d in os.listdir(pids_cgroup_parent()) if d.startswith(f"scaletrain-code-{os.getpid()}-")] == []


@pytest.mark.parametrize("cgroup", [True, False])
def test_a_cancelled_run_kills_its_child(monkeypatch, cgroup, unsandboxed):
    if not cgroup:  # the process-group kill (and, sandboxed, the pid namespace) alone
        monkeypatch.setattr(code_runner.RunCgroup, "make", classmethod(lambda cls, n: None))
    name = f"cancel{os.getpid() % 10000}"
    code = SET_NAME.format(name=name) + "import time\ntime.sleep(60)"

    async def go():
        tool = CodeRunnerTool({"timeout": 30, "allow_unsandboxed": unsandboxed})
        task = asyncio.create_task(tool.execute("i", {"code": code}))
        for _ in range(500):  # until the program runs
            await asyncio.sleep(0.01)
            if pids_named(name):
                break
        assert pids_named(name), "the program never started"
        task.cancel()  # as the agent loop's tool_timeout_s would
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    for _ in range(100):  # SIGKILL is asynchronous: give the kernel a moment
        if not pids_named(name):
            break
        time.sleep(0.01)
    assert pids_named(name) == []


def _has_cap_sys_admin() -> bool:
    caps = [line for line in code_runner.read_text("/proc/self/status").splitlines() if line.startswith("CapEff:")]
    return bool(caps) and bool(int(caps[0].split()[1], 16) & (1 << 21))


def test_the_sandbox_has_no_network_interface_but_loopback():
    code = "print(' '.join(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))"
    response, _, metrics = execute(CodeRunnerTool(), code=code)
    assert response.text.split() == ["lo"] and NO_NET not in metrics, response.text


def test_unsandboxed_the_child_gets_a_network_namespace_and_the_prelude(no_sandbox):
    code = "print(' '.join(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))"
    tool = CodeRunnerTool({"allow_unsandboxed": True})
    response, _, metrics = execute(tool, code=code)
    if NO_NET in metrics:
        assert not _has_cap_sys_admin(), "root with CAP_SYS_ADMIN should always get a network namespace"
        pytest.skip("no network namespace on this machine (reported, as tested below)")
    assert set(response.text.split()) <= {"lo"}, response.text
    net = execute(tool, code="import socket\nsocket.socket()")[0].text
    assert "network access is disabled" in net


def test_missing_network_isolation_is_reported_or_refused(monkeypatch, caplog, no_sandbox):
    monkeypatch.setattr(python_process, "UNSHARE_ATTEMPTS", (0x1,))  # an invalid flag: every unshare fails
    monkeypatch.setattr(code_runner, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="scaletrain.agent.tools.code_runner")
    tool = CodeRunnerTool({"allow_unsandboxed": True})
    for _ in range(2):
        response, _, metrics = execute(tool, code="print('ran')")
        assert response.text == "ran\n" and metrics[NO_NET] == 1.0 and "error" not in metrics
    assert sum("no network namespace" in r.getMessage() for r in caplog.records) == 1  # warned once
    assert sum("WITHOUT a sandbox" in r.getMessage() for r in caplog.records) == 1
    strict = CodeRunnerTool({"require_network_isolation": True, "allow_unsandboxed": True})
    response, _, metrics = execute(strict, code="print('ran')")
    assert response.text.startswith("Error: code_runner could not isolate the network (Invalid argument)")
    assert "the code was not run" in response.text and "ran\n" not in response.text
    assert metrics["error"] == 1.0 and metrics[NO_NET] == 1.0


# --------------------------------------------------------------------------------- create / release timeouts
def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


class HangingTool(BaseTool):
    """``create`` / ``release`` hang as configured; ``create`` even shrugs off its first cancellation (as a
    badly written client might), so a plain ``asyncio.wait_for`` would keep waiting for it."""

    default_schema = {"type": "function", "function": {"name": "hang"}}

    async def create(self, instance_id=None, **kwargs):
        if self.config.get("hang") == "create":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(1.0)  # bounded, so that asyncio.run can finish the test
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="done"), 0.0, {}

    async def release(self, instance_id, **kwargs):
        if self.config.get("hang") == "release":
            await asyncio.sleep(3600)
        await super().release(instance_id)


def run_loop(tool):
    server = ScriptedServer(lambda rid, turn, p: ids(call("hang")) if turn == 0 else ids("ok"))
    loop = ToolAgentLoop(config(), server, TOK, response_length=300, tools={"hang": tool})

    async def go():
        start = time.perf_counter()
        out = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "hi"}], request_id="r")
        return out, time.perf_counter() - start

    out, seconds = asyncio.run(go())
    tool_text = TOK.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    return out, seconds, server, tool_text


def test_a_hanging_create_ends_the_trajectory_with_a_counted_error():
    out, seconds, server, tool_text = run_loop(HangingTool({"hang": "create", "create_timeout_s": 0.2}))
    assert seconds < 0.8 and len(server.calls) == 1  # not waited for; no further turn
    assert "Error: tool 'hang': create did not finish within 0.2 s (config create_timeout_s)" in tool_text
    assert out.metrics["tool_create_timeouts"] == 1 and out.metrics["tool_errors"] == 1


def test_a_hanging_release_is_logged_and_counted_and_the_trajectory_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="scaletrain.agent.tool_agent")
    out, seconds, server, tool_text = run_loop(HangingTool({"hang": "release", "release_timeout_s": 0.2}))
    assert seconds < 0.8 and len(server.calls) == 2 and "done" in tool_text
    assert out.metrics["tool_release_timeouts"] == 1 and "tool_errors" not in out.metrics
    assert any("release did not finish within 0.2 s" in r.getMessage() for r in caplog.records)


def test_lifecycle_timeouts_are_checked_when_the_tool_is_built():
    with pytest.raises(ValueError, match="'hang': config create_timeout_s must be a positive number.*-1"):
        HangingTool({"create_timeout_s": -1})
