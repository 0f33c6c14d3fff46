"""A stand-in for a remote judge service (an outside service cannot be reached here): an OpenAI-compatible HTTP server
on the loopback address, run as its own process (``python -m tests.reward.judge_server``; it prints its port).

``GET /v1/models`` lists ``judge-model``; ``POST /v1/chat/completions`` answers as the rule would: the last user
message holds ``Expected: <answer>`` and ``Answer: <response>`` lines and the reply is ``yes`` when they are equal,
else ``no``. ``POST /get_reward`` stands in for a remote reward model (OpenRLHF's protocol): ``{"query", "prompts",
"labels"}`` in, ``{"rewards"}`` out, 1.0 where the response (the query after its prompt) equals the label, else
0.0. ``POST /control`` ``{"mode": ...}`` changes how both answer from then on:

- ``rule``: as above (the default); ``slow``: after ``delay_s`` seconds (default 30);
- ``garbage``: HTTP 200 with an HTML page; ``flaky``: HTTP 503 for every request but each ``every``-th (default 3);
- ``die``: the process exits at the next chat request, answering nothing;
- ``short``: ``/get_reward`` answers one reward whatever the number of samples.

``GET /control`` returns what it saw: ``requests``, ``max_in_flight``, the ``authorization`` headers received and
the request times.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"mode": "rule", "delay_s": 30.0, "every": 3, "requests": 0, "in_flight": 0, "max_in_flight": 0}
SEEN: dict[str, list] = {"authorization": [], "times": []}
LOCK = threading.Lock()


def verdict(messages: list[dict]) -> str:
    text = str(messages[-1].get("content", ""))
    expected = re.search(r"Expected: (.*)", text)
    answer = re.search(r"Answer: (.*)", text)
    same = expected is not None and answer is not None and expected.group(1).strip() == answer.group(1).strip()
    return "yes" if same else "no"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "judge-model"}]}).encode())
        elif self.path == "/control":
            with LOCK:
                self._send(200, json.dumps({**STATE, **SEEN}).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/control":
            with LOCK:
                STATE.update(body)
            self._send(200, b"{}")
            return
        if self.path not in ("/v1/chat/completions", "/get_reward"):
            self._send(404, b"{}")
            return
        with LOCK:
            STATE["requests"] += 1
            STATE["in_flight"] += 1
            STATE["max_in_flight"] = max(STATE["max_in_flight"], STATE["in_flight"])
            SEEN["authorization"].append(self.headers.get("Authorization"))
            SEEN["times"].append(time.monotonic())
            mode, n = STATE["mode"], STATE["requests"]
        try:
            self._answer(mode, n, body)
        finally:
            with LOCK:
                STATE["in_flight"] -= 1

    def _answer(self, mode: str, n: int, body: dict) -> None:
        if mode == "die":
            os._exit(1)
        if mode == "slow":
            time.sleep(float(STATE["delay_s"]))
        if mode == "garbage":
            self._send(200, b"<html>502 Bad Gateway</html>", "text/html")
            return
        if mode == "flaky" and n % int(STATE["every"]):
            self._send(503, b'{"error": "overloaded"}')
            return
        time.sleep(float(body.get("hold_s", 0.0)))  # a test's way to keep requests in flight
        if self.path == "/get_reward":
            responses = [q[len(p) :].strip() for q, p in zip(body["query"], body["prompts"])]
            rewards = [1.0 if r == str(label).strip() else 0.0 for r, label in zip(responses, body["labels"])]
            rewards = rewards[:1] if mode == "short" else rewards
            self._send(200, json.dumps({"rewards": rewards}).encode())
            return
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": verdict(body["messages"])}}]}
        self._send(200, json.dumps({"id": f"c{n}", "object": "chat.completion", **reply}).encode())


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
