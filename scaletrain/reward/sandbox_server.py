"""A code-execution service with SandboxFusion's ``POST /run_code`` API, running each program in the project's
sandbox (scaletrain/agent/tools/python_process.py: bubblewrap, no network, time / memory / process / output
limits), so that ``reward.sandbox_fusion.url`` (scaletrain/reward/sandbox_fusion.py) works with no outside service::

    python -m scaletrain.reward.sandbox_server --host 127.0.0.1 --port 8080
    # reward.sandbox_fusion.url=http://127.0.0.1:8080/run_code

Request (JSON): ``code``, ``language`` (``python`` only; another gets ``SandboxError`` naming it), ``stdin``,
``run_timeout`` (s), ``memory_limit_MB``; ``compile_timeout``, ``files`` and ``fetch_files`` are accepted and
unused (a Python program compiles as it runs; files cannot be sent in here). The timeout and memory asked for are
bounded by the server's ``--max-timeout-s`` / ``--max-memory-mb``. Reply: ``{"status": "Success" | "Failed" |
"SandboxError", "message", "compile_result": null, "run_result": {"status": "Finished" | "TimeLimitExceeded" |
"Error", "execution_time", "return_code", "stdout", "stderr"}}``: Success when the program exited 0, Failed when it
exited otherwise, timed out or printed more than ``--max-output-chars`` (``Error``: stopped there), SandboxError
when it could not be run. A body that is not such a request gets HTTP 400 naming what is wrong, one over
``--max-body-mb`` 413. At most ``--max-concurrent`` programs run at once; further requests wait their turn.

Without a working sandbox the server refuses to start, naming why, unless ``--allow-unsandboxed`` (the code then
runs as the server's user with the limits only: code_runner.py's docstring).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scaletrain.agent.tools.python_process import RunResult, run_python
from scaletrain.agent.tools.sandbox import sandbox_problem

logger = logging.getLogger(__name__)
LANGUAGES = ("python", "python3")


class BadRequest(ValueError):
    """The request is not a run_code request (HTTP 400)."""


def _number(body: dict[str, Any], key: str, default: float, most: float) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadRequest(f"'{key}' must be a positive number, got {value!r}")
    return min(float(value), most)


def read_request(body: Any, limits: argparse.Namespace) -> tuple[str, str | None, float, int, str]:
    """(code, stdin, timeout_s, memory_mb, language) of a request; BadRequest naming the field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    code, stdin, language = body.get("code"), body.get("stdin"), body.get("language", "python")
    if not isinstance(code, str):
        raise BadRequest(f"'code' must be a string, got {type(code).__name__}")
    if stdin is not None and not isinstance(stdin, str):
        raise BadRequest(f"'stdin' must be a string or null, got {type(stdin).__name__}")
    if not isinstance(language, str):
        raise BadRequest(f"'language' must be a string, got {type(language).__name__}")
    timeout = _number(body, "run_timeout", 10, limits.max_timeout_s)
    memory = int(_number(body, "memory_limit_MB", 1024, limits.max_memory_mb))
    return code, stdin or None, timeout, memory, language


def reply_of(result: RunResult, max_output_chars: int) -> dict[str, Any]:
    """SandboxFusion's reply to a program that ran (or did not start: SandboxError)."""
    if result.returncode is None:
        return {"status": "SandboxError", "message": result.text, "compile_result": None, "run_result": None}
    run_status = "TimeLimitExceeded" if result.timed_out else "Error" if result.truncated else "Finished"
    stderr = result.stderr
    if result.truncated:
        stderr += f"\nthe output exceeded the server's limit of {max_output_chars} characters; the program was stopped"
    run = {
        "status": run_status,
        "execution_time": round(result.elapsed_s, 4),
        "return_code": result.returncode,
        "stdout": result.stdout,
        "stderr": stderr,
    }
    status = "Success" if result.ok else "Failed"
    return {"status": status, "message": "", "compile_result": None, "run_result": run}


def unsupported(language: str) -> dict[str, Any]:
    message = f"language {language!r} is not run by this server (it runs {', '.join(LANGUAGES)})"
    return {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None}


def make_server(args: argparse.Namespace) -> ThreadingHTTPServer:
    """The server on ``args.host:args.port`` (0: a free port); ``serve_forever`` serves it."""
    slots = threading.BoundedSemaphore(args.max_concurrent)
    max_body = int(args.max_body_mb * (1 << 20))

    def run(code: str, stdin: str | None, timeout: float, memory_mb: int) -> dict[str, Any]:
        limits = {"timeout": timeout, "memory_mb": memory_mb, "max_output_chars": args.max_output_chars}
        with slots:  # a thread per request: at most max_concurrent programs at once, the rest wait here
            result = asyncio.run(
                run_python(code, stdin, split_stderr=True, allow_unsandboxed=args.allow_unsandboxed, **limits)
            )
        return reply_of(result, args.max_output_chars)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *log_args: Any) -> None:
            logger.debug(fmt, *log_args)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/run_code":
                return self._send(404, {"error": f"no such endpoint {self.path!r}: POST /run_code"})
            try:
                size = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._send(411, {"error": "a Content-Length header is required"})
            if size > max_body:
                return self._send(413, {"error": f"the body ({size} bytes) is over the limit of {max_body} bytes"})
            try:
                code, stdin, timeout, memory, language = read_request(json.loads(self.rfile.read(size)), args)
            except (ValueError, UnicodeDecodeError) as e:  # BadRequest, or not JSON
                return self._send(400, {"error": f"not a run_code request: {e}"})
            if language not in LANGUAGES:
                return self._send(200, unsupported(language))
            self._send(200, run(code, stdin, timeout, memory))

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    return server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SandboxFusion's /run_code API over the project's code sandbox")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0: a free port (printed)")
    parser.add_argument("--max-concurrent", type=int, default=4, help="programs running at once")
    parser.add_argument("--max-timeout-s", type=float, default=30.0, help="the most run_timeout a request gets")
    parser.add_argument("--max-memory-mb", type=int, default=2048, help="the most memory_limit_MB a request gets")
    parser.add_argument("--max-output-chars", type=int, default=1_000_000, help="per stream")
    parser.add_argument("--max-body-mb", type=float, default=16.0, help="the largest request body")
    parser.add_argument("--allow-unsandboxed", action="store_true", help="run the code without a sandbox if none")
    args = parser.parse_args(argv)
    for key in ("max_concurrent", "max_timeout_s", "max_memory_mb", "max_output_chars", "max_body_mb"):
        if not getattr(args, key) > 0:
            parser.error(f"--{key.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    problem = sandbox_problem()
    if problem and not args.allow_unsandboxed:
        sys.exit(
            f"sandbox_server: no sandbox here ({problem}); install bubblewrap and allow user namespaces, or pass "
            "--allow-unsandboxed to run the code as this user with resource limits only"
        )
    if problem:
        logger.warning("sandbox_server: code runs WITHOUT a sandbox (--allow-unsandboxed): %s", problem)
    server = make_server(args)
    # the line a caller (or a test) reads the port from
    print(f"sandbox server on http://{args.host}:{server.server_address[1]}/run_code", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
