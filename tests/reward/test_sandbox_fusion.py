"""Code rewards through a SandboxFusion-compatible service: the project's sandbox server
(``python -m scaletrain.reward.sandbox_server``) as a real process on the loopback address, probed as a careless
user and as model-written code would (stdin, separate streams, exit codes, a timeout and a memory limit asked for
beyond the server's, the network, the host's files, bad requests, the concurrency limit as the programs saw it);
the client and the code scorer (``reward.sandbox_fusion``: inputs/outputs and assert tests); a reward manager
scoring verl's code data sources through it and counting a dead server's samples as errors; a user's verl-style
function doing its own requests; and a CLI run rewarded by a verifier run in the sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scaletrain.reward.sandbox_fusion import (
    SandboxFusion,
    SandboxFusionError,
    SandboxFusionSettings,
    read_tests,
    score_code,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_CONCURRENT, MAX_TIMEOUT_S = 2, 8  # 8 s: a program started on a loaded 2-core machine still runs


class SandboxServer:
    def __init__(self, *flags: str) -> None:
        argv = [sys.executable, "-m", "scaletrain.reward.sandbox_server", "--port", "0", *flags]
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("sandbox server on "), line
        self.url = line.split()[-1]

    def post(self, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def server():
    s = SandboxServer("--max-concurrent", str(MAX_CONCURRENT), "--max-timeout-s", str(MAX_TIMEOUT_S))
    yield s
    s.close()


def client(url: str, **overrides) -> SandboxFusion:
    return SandboxFusion(SandboxFusionSettings(**{"url": url, "backoff_s": 0.05, "timeout_s": 20.0, **overrides}))


def run(coro_fn):
    """``coro_fn(sandbox)`` awaited, the client closed after (its connections belong to this loop)."""

    async def go(sandbox):
        try:
            return await coro_fn(sandbox)
        finally:
            await sandbox.aclose()

    return lambda sandbox: asyncio.run(go(sandbox))


def run_code(url: str, code: str, stdin: str | None = None, **overrides) -> dict:
    return run(lambda sandbox: sandbox.run(code, stdin))(client(url, **overrides))


# ------------------------------------------------------------------------------------------------- the server
def test_stdin_in_and_the_streams_and_exit_code_out(server):
    code = "import sys\nprint(sys.stdin.read().upper(), end='')\nprint('oops', file=sys.stderr)\nsys.exit(3)"
    reply = run_code(server.url, code, "abc\n")
    assert reply["status"] == "Failed" and reply["compile_result"] is None
    result = reply["run_result"]
    assert (result["status"], result["return_code"], result["stdout"], result["stderr"]) == (
        "Finished",
        3,
        "ABC\n",
        "oops\n",
    )
    ok = run_code(server.url, "print(sum(map(int, input().split())))", "2 40")
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "42\n" and ok["run_result"]["return_code"] == 0


def test_a_program_cannot_take_more_time_or_memory_than_the_server_allows(server):
    """The request asks for an hour and 100 GB: the server's limits bind (8 s, 2 GB)."""
    body = {"code": "while True: pass", "language": "python", "run_timeout": 3600, "memory_limit_MB": 100_000}
    status, reply = server.post(json.dumps(body).encode())
    assert status == 200 and reply["status"] == "Failed"
    assert (
        reply["run_result"]["status"] == "TimeLimitExceeded"
        and reply["run_result"]["execution_time"] < MAX_TIMEOUT_S + 2
    )
    hog = "x = bytearray(3 * 1024**3)\nprint('allocated')"
    body = {"code": hog, "run_timeout": 10, "memory_limit_MB": 100_000}
    status, reply = server.post(json.dumps(body).encode())
    assert reply["status"] == "Failed" and "MemoryError" in reply["run_result"]["stderr"]
    assert "allocated" not in reply["run_result"]["stdout"]


def test_the_code_reaches_neither_the_network_nor_the_hosts_files(server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    port = server.url.split(":")[2].split("/")[0]
    probe = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
        "except OSError as e:\n    print('no network', e)\n"
        f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError as e:\n    print('no file', e)\n"
    )
    out = run_code(server.url, probe)["run_result"]["stdout"]
    assert "no network" in out and "connected" not in out
    assert "no file" in out and "the host's secret" not in out


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"not json", 400, "not a run_code request"),
        (json.dumps({"code": 42}).encode(), 400, "'code' must be a string, got int"),
        (json.dumps({"code": "1", "run_timeout": "soon"}).encode(), 400, "'run_timeout' must be a positive number"),
        (json.dumps({"code": "1", "stdin": ["a"]}).encode(), 400, "'stdin' must be a string or null"),
        (json.dumps(["code"]).encode(), 400, "the body must be a JSON object"),
    ],
)
def test_bad_requests_are_refused_naming_what_is_wrong(server, body, status, message):
    code, reply = server.post(body)
    assert code == status and message in reply["error"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """A request announcing 17 MiB (over --max-body-mb 16) is answered 413 at once, before any of it is sent."""
    import socket

    host, port = server.url.split("/")[2].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (17 << 20))
        raw = b""
        with contextlib.suppress(ConnectionResetError):  # the server closes with the body unread
            while chunk := s.recv(65536):  # the headers and the body may come in separate writes
                raw += chunk
    answer = raw.decode()
    assert answer.startswith("HTTP/1.0 413") and "over the limit" in answer


def test_another_language_is_a_sandbox_error_naming_it(server):
    with pytest.raises(SandboxFusionError, match=r"could not run the program: language 'cpp' is not run"):
        run(lambda sandbox: sandbox.run("int main() {}", language="cpp"))(client(server.url))


def test_at_most_max_concurrent_programs_run_at_once(server):
    """Six requests at once, each program sleeping 0.5 s: as the programs' own clocks saw it, no more than the
    server's --max-concurrent ran together (and more than one did)."""
    code = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"

    async def six(sandbox):
        return await asyncio.gather(*(sandbox.run(code) for _ in range(6)))

    replies = run(six)(client(server.url))
    spans = [tuple(map(float, r["run_result"]["stdout"].split())) for r in replies]
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap == MAX_CONCURRENT


def test_the_server_refuses_to_start_without_a_sandbox_unless_allowed(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}  # no bwrap on this PATH
    argv = [sys.executable, "-m", "scaletrain.reward.sandbox_server", "--port", "0"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no sandbox here" in out.stderr and "--allow-unsandboxed" in out.stderr


# ------------------------------------------------------------------------------------------------ the scorer
PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"inputs": ["1 2", "10 20", "5 5"], "outputs": ["3", "30", "10\n"]}


def test_the_share_of_tests_passed(server):
    score = run(lambda s: score_code(s, "Here:\n" + PROGRAM, json.dumps(TESTS)))
    assert score(client(server.url)) == {"score": 1.0, "tests_passed": 3.0, "tests": 3.0}
    wrong = PROGRAM.replace("a + b", "a * b if a < 5 else a + b")  # 1 2 -> 2: one test of three fails
    assert run(lambda s: score_code(s, wrong, TESTS))(client(server.url))["score"] == pytest.approx(2 / 3)
    assert run(lambda s: score_code(s, "print(3)", TESTS))(client(server.url))["score"] == 0.0  # no code block
    asserts = {"assert_case": ["assert add(2, 2) == 4", "assert add(1, 1) == 3"]}
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    assert run(lambda s: score_code(s, add, asserts))(client(server.url))["score"] == 0.5


@pytest.mark.parametrize(
    "cases, message",
    [
        ({"fn_name": "f", "inputs": [], "outputs": []}, "fn_name"),
        ({"inputs": ["1"], "outputs": []}, "one output per input"),
        ({"tests": []}, "test cases must be"),
        ("not json", "Expecting value"),
    ],
)
def test_test_cases_of_another_shape_raise(cases, message):
    with pytest.raises(ValueError, match=message):
        read_tests(cases)


# ------------------------------------------------------------------------------------------- in the manager
def code_rows(n: int) -> list[dict]:
    good = PROGRAM
    bad = PROGRAM.replace("a + b", "a - b")
    return [
        {
            "prompt": "add",
            "response": good if i % 2 == 0 else bad,
            "data_source": "codecontests",
            "ground_truth": json.dumps(TESTS),
        }
        for i in range(n)
    ]


def test_a_manager_scores_code_data_sources_through_the_sandbox_and_counts_a_dead_ones_samples(tokenizer, make_batch):
    from scaletrain.reward import build_reward_manager

    dead = SandboxServer("--max-concurrent", "4")
    rows = code_rows(4)
    with build_reward_manager(
        tokenizer, "naive", sandbox=client(dead.url, max_retries=1), step_timeout_s=60
    ) as manager:
        out = manager(make_batch(rows), return_dict=True)
        assert out["reward_extra_info"]["score"] == [1.0, 0.0, 1.0, 0.0]
        assert out["reward_extra_info"]["tests_passed"] == [3.0, 0.0, 3.0, 0.0]
        assert out["metrics"]["sandbox_fusion/requests"] == 12 and out["metrics"]["reward/errors"] == 0
        dead.close()
        out = manager(make_batch(rows), return_dict=True)
    assert out["metrics"]["reward/errors"] == 4 and out["reward_extra_info"]["score"] == [0.0] * 4
    assert out["metrics"]["sandbox_fusion/failures"] == 12  # each test's request, after its retry
    assert "the code sandbox at" in (manager.last_error or "") and "failed (2 tries)" in manager.last_error


def test_without_the_sandbox_a_code_data_source_is_refused_naming_the_key(tokenizer, make_batch):
    from scaletrain.reward import build_reward_manager

    with build_reward_manager(tokenizer, "naive") as manager:
        manager(make_batch(code_rows(1)), return_dict=True)
    assert "set reward.sandbox_fusion.url" in (manager.last_error or "")


VERL_STYLE = """
import httpx

def compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                  concurrent_semaphore=None, memory_limit_mb=None):
    body = {"code": "print(input()[::-1])", "stdin": solution_str, "language": "python",
            "run_timeout": 5, "memory_limit_MB": memory_limit_mb}
    reply = httpx.post(sandbox_fusion_url, json=body, timeout=30).json()
    return float(reply["run_result"]["stdout"].strip() == ground_truth)
"""


def test_a_verl_style_function_gets_the_url_and_does_its_own_requests(server, tokenizer, make_batch, tmp_path):
    from scaletrain.reward import build_reward_manager

    path = tmp_path / "verl_style.py"
    path.write_text(VERL_STYLE)
    rows = [{"prompt": "p", "response": r, "ground_truth": "cba"} for r in ("abc", "abd")]
    sandbox = client(server.url, memory_limit_mb=256)
    with build_reward_manager(tokenizer, "naive", {"path": str(path)}, sandbox=sandbox) as manager:
        out = manager(make_batch(rows), return_dict=True)
    assert out["reward_extra_info"]["score"] == [1.0, 0.0] and out["metrics"]["reward/errors"] == 0
    blind = tmp_path / "blind.py"
    blind.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n  return 0\n")
    with pytest.raises(ValueError, match=r"takes none of \['sandbox', 'sandbox_fusion_url'"):
        build_reward_manager(tokenizer, "naive", {"path": str(blind)}, sandbox=sandbox)


VERIFIER = '''
PROGRAM = "import re, sys\\nnumbers = re.findall(r'-?\\\\d+', sys.stdin.read())\\nprint(numbers[-1] if numbers else '')"

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox=None):
    """The response's last number, found by a verifier run in the sandbox, against the answer."""
    reply = await sandbox.run(PROGRAM, stdin=solution_str)
    return float(reply["run_result"]["stdout"].strip() == str(ground_truth).strip())
'''


@pytest.mark.slow
def test_a_run_rewarded_by_a_verifier_in_the_sandbox_server(ray_cluster, task, server, tmp_path):
    """The embedded default, one step, its reward from a verifier program the sandbox server runs for each
    sample (``reward.sandbox_fusion.url`` on the command line)."""
    from tests.trainer.runs import metrics, run_in_process

    path = tmp_path / "verifier.py"
    path.write_text(VERIFIER)
    overrides = [f"custom_reward_function.path={path}", f"reward.sandbox_fusion.url={server.url}"]
    overrides += ["trainer.save_freq=-1", "trainer.test_freq=-1"]
    result = run_in_process(task, tmp_path / "run", 1, overrides)
    logged = metrics(result.run_dir)[1]
    assert logged["sandbox_fusion/requests"] > 0 and logged["sandbox_fusion/failures"] == 0
    assert logged["reward/errors"] == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.sandbox_fusion.url=localhost:8080"], r"reward.sandbox_fusion.url must be an http\(s\) URL"),
        (
            ["reward.sandbox_fusion.url=http://h:1/run_code", "reward.sandbox_fusion.max_concurrent=0"],
            "max_concurrent must be positive",
        ),
        (
            ["reward.sandbox_fusion.url=http://h:1/run_code", "reward.sandbox_fusion.max_retries=-1"],
            "max_retries must be >= 0",
        ),
        (
            ["reward.sandbox_fusion.url=http://h:1/run_code", "reward_model.reward_manager=multi"],
            "does not score with reward.sandbox_fusion",
        ),
        (["reward.judge.base_url=http://h:1/v1"], r"reward.judge.base_url needs custom_reward_function.path"),
        (["reward.judge.base_url=h:1"], r"reward.judge.base_url must be an http\(s\) URL"),
    ],
)
def test_bad_service_settings_are_refused_before_the_run_naming_the_key(task, tmp_path, overrides, message):
    from scaletrain.utils.typed_config import ConfigError
    from tests.trainer.config.test_ppo_config import checked
    from tests.trainer.runs import ppo_overrides

    with pytest.raises(ConfigError, match=message):
        checked(*ppo_overrides(task, tmp_path / "run", 2, overrides))
