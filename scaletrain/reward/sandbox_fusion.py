"""Code rewards through a SandboxFusion-compatible service (``reward.sandbox_fusion.*``): the client, and the scorer
of verl's code data sources (``codecontests``, ``apps``, ``codeforces``, ``taco``).

``SandboxFusion.run(code, stdin)`` posts SandboxFusion's ``/run_code`` request to ``url`` (a SandboxFusion
deployment, or ``python -m scaletrain.reward.sandbox_server``) with the limits of http_service.py (``max_concurrent``
programs in flight, ``max_rpm`` requests a minute, ``timeout_s`` per request, ``max_retries`` retries with backoff
after timeouts, connection errors, 429 and 5xx). A reply that is not a run_code reply, or a ``SandboxError`` (the
service could not run the program), raises SandboxFusionError: the reward manager counts the sample as an error
(``reward/errors``) and the reward guard stops a run whose sandbox keeps failing. A program that fails, times out or
prints the wrong answer is the model's doing: it scores 0 on that test, no error.

``score_code(sandbox, solution_str, ground_truth)``: the program is the response's last fenced code block (a
response without one scores 0); ``ground_truth`` is the test cases (a dict or its JSON): ``{"inputs": [...],
"outputs": [...]}`` (each input is a test's stdin, its stdout must equal the output but for trailing whitespace) or
``{"assert_case": [...]}`` (each test appends its assertion to the program, which must exit 0). The score is the
share of tests passed; all of a sample's tests run concurrently. Cases of another shape (``fn_name``) raise naming
the shape.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from scaletrain.reward.http_service import RetrySettings, ServiceClient, ServiceError, check_service_settings

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
RUN_STATUSES = {"Success", "Failed", "SandboxError"}


@dataclass
class SandboxFusionSettings(RetrySettings):
    """``reward.sandbox_fusion``: verl's keys (url, max_concurrent, memory_limit_mb) and the client's limits."""

    url: str | None = None  # the service's run_code endpoint, e.g. http://127.0.0.1:8080/run_code; null: none
    max_concurrent: int = 64  # programs (tests) in flight at once
    memory_limit_mb: int = 1024  # each program's memory
    run_timeout_s: float = 10.0  # each program's run

    @property
    def enabled(self) -> bool:
        return self.url is not None


def check_sandbox_fusion_settings(settings: SandboxFusionSettings) -> None:
    """``reward.sandbox_fusion.*`` before anything starts: ValueError naming the key of a bad value."""
    positive = {key: getattr(settings, key) for key in ("max_concurrent", "memory_limit_mb", "run_timeout_s")}
    check_service_settings("reward.sandbox_fusion", "url", "http://HOST:PORT/run_code", settings, positive)


class SandboxFusionError(ServiceError):
    """The sandbox service could not run a program, or did not answer as SandboxFusion does."""


class SandboxFusion:
    """The client (module docstring); its connections belong to the event loop of its first request."""

    def __init__(self, settings: SandboxFusionSettings) -> None:
        if settings.url is None:
            raise ValueError("reward.sandbox_fusion.url is not set")
        self.settings = settings
        args = ("the code sandbox", settings.url, "reward.sandbox_fusion", settings, settings.max_concurrent)
        self.service = ServiceClient(*args, error_cls=SandboxFusionError)

    def __repr__(self) -> str:
        return f"SandboxFusion({self.service.url!r})"

    async def run(self, code: str, stdin: str | None = None, language: str = "python") -> dict[str, Any]:
        """The service's reply to running ``code``: ``status`` Success or Failed, and ``run_result``'s
        ``stdout``, ``stderr``, ``return_code``, ``status``; SandboxFusionError when it could not run it."""
        body = {
            "code": code,
            "stdin": stdin,
            "language": language,
            "compile_timeout": self.settings.run_timeout_s,
            "run_timeout": self.settings.run_timeout_s,
            "memory_limit_MB": self.settings.memory_limit_mb,
            "files": {},
            "fetch_files": [],
        }
        reply = await self.service.request("POST", "", body)
        status = reply.get("status") if isinstance(reply, dict) else None
        if status not in RUN_STATUSES or not isinstance(reply.get("run_result") or {}, dict):
            raise self.service.fail(f"answered something that is not a run_code reply: {reply!r:.200}")
        if status == "SandboxError":
            raise self.service.fail(f"could not run the program: {str(reply.get('message'))[:300]}")
        return reply

    def metrics(self) -> dict[str, float]:
        """The counters since the last call (``sandbox_fusion/*``), reset."""
        return self.service.metrics("sandbox_fusion")

    async def aclose(self) -> None:
        await self.service.aclose()


def extract_program(response: str) -> str | None:
    """The last fenced code block of a response (None: there is none)."""
    blocks = FENCE.findall(response)
    return blocks[-1][1] if blocks else None


def read_tests(ground_truth: Any) -> list[tuple[str, str | None, str | None]]:
    """[(code suffix, stdin, expected stdout or None)] of a sample's test cases (module docstring)."""
    cases = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if isinstance(cases, dict) and isinstance(cases.get("assert_case"), list):
        return [("\n" + str(case) + "\n", None, None) for case in cases["assert_case"]]
    if isinstance(cases, dict) and "fn_name" in cases:
        raise ValueError("test cases calling a function by name (fn_name) are not supported: use inputs/outputs")
    if not (isinstance(cases, dict) and isinstance(cases.get("inputs"), list)):
        shapes = "{'inputs': [...], 'outputs': [...]} or {'assert_case': [...]}"
        raise ValueError(f"test cases must be {shapes}: {cases!r:.200}")
    inputs, outputs = cases["inputs"], cases.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        raise ValueError(f"test cases have {len(inputs)} inputs and {outputs!r:.80} as outputs: one output per input")
    return [("", str(i), str(o)) for i, o in zip(inputs, outputs)]


async def _passes(sandbox: SandboxFusion, program: str, test: tuple[str, str | None, str | None]) -> bool:
    suffix, stdin, expected = test
    reply = await sandbox.run(program + suffix, stdin)
    if reply["status"] != "Success":
        return False
    if expected is None:
        return True
    stdout = str((reply.get("run_result") or {}).get("stdout") or "")
    return [line.rstrip() for line in stdout.rstrip().splitlines()] == [
        line.rstrip() for line in expected.rstrip().splitlines()
    ]


async def score_code(sandbox: SandboxFusion, solution_str: str, ground_truth: Any) -> dict[str, float]:
    """``score`` (the share of tests passed), ``tests_passed`` and ``tests`` of one response (module docstring)."""
    tests = read_tests(ground_truth)
    program = extract_program(solution_str)
    if program is None or not tests:
        return {"score": 0.0, "tests_passed": 0.0, "tests": float(len(tests))}
    # every test's request ends before the sample does (the first failure raised after), so that no request of
    # this sample is still in flight, or counted, after its score is read
    results = await asyncio.gather(*(_passes(sandbox, program, test) for test in tests), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    passed = sum(1 for result in results if result is True)
    return {"score": passed / len(tests), "tests_passed": float(passed), "tests": float(len(tests))}


async def default_score_with_sandbox(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, sandbox: Any = None
) -> float | dict:
    """The default scorer with ``reward.sandbox_fusion.url`` set: verl's code data sources through the sandbox,
    every other one as ``default_compute_score`` scores it (in a thread: this runs on the scoring loop)."""
    from scaletrain.reward.scorers.default import CODE_DATA_SOURCES, default_compute_score

    if data_source in CODE_DATA_SOURCES:
        return await score_code(sandbox, solution_str, ground_truth)
    return await asyncio.to_thread(default_compute_score, data_source, solution_str, ground_truth, extra_info)


SANDBOX_PARAMETERS = ("sandbox", "sandbox_fusion_url", "memory_limit_mb", "concurrent_semaphore")


def bind_sandbox(fn: Any, sandbox: SandboxFusion, is_default: bool) -> Any:
    """The scorer with the sandbox bound: the default scorer becomes ``default_score_with_sandbox``; a user's
    function gets whichever of ``sandbox`` (the client; an ``async def`` awaits ``sandbox.run``), verl's
    ``sandbox_fusion_url`` and ``memory_limit_mb`` (its own requests; ``concurrent_semaphore`` None: the
    reward workers, ``reward_model.num_processes``, bound its concurrency) it takes. ValueError naming the
    function when it takes none, or takes ``sandbox`` without being ``async def``."""
    import functools
    import inspect

    from scaletrain.reward.async_scorer import is_async_scorer, target_function

    if is_default:
        return functools.partial(default_score_with_sandbox, sandbox=sandbox)
    params = inspect.signature(target_function(fn)).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    offered = {
        "sandbox": sandbox,
        "sandbox_fusion_url": sandbox.settings.url,
        "memory_limit_mb": sandbox.settings.memory_limit_mb,
        "concurrent_semaphore": None,
    }
    bound = {k: v for k, v in offered.items() if k in params or takes_any}
    if not is_async_scorer(fn):
        bound.pop("sandbox", None)
        if "sandbox" in params:
            raise ValueError(f"the reward function {fn!r} takes the sandbox client but is not an async def")
    if not bound:
        raise ValueError(
            f"reward.sandbox_fusion.url is set but the reward function {fn!r} takes none of {list(SANDBOX_PARAMETERS)}"
        )
    return functools.partial(fn, **bound)
