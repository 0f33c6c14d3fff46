"""A small retrieval HTTP service over a local corpus, for the ``search`` tool (tests, demos, CPU runs).

Corpus: a JSONL file of ``{"id": ..., "contents": "..."}`` lines (or a list of strings in code). Scoring is
BM25 over lower-cased word tokens. ``POST /retrieve`` with ``{"queries": [...], "topk": k}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``. Serves on loopback by default::

    python -m scaletrain.agent.tools.retrieval_server --corpus corpus.jsonl --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)
WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    return WORD.findall(text.lower())


class BM25Index:
    def __init__(self, docs: list[dict], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs, self.k1, self.b = docs, k1, b
        self.tfs = [Counter(tokenize(d["contents"])) for d in docs]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avg = sum(self.lengths) / max(1, len(self.lengths))
        df = Counter(word for tf in self.tfs for word in tf)
        n = len(docs)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}

    def search(self, query: str, topk: int) -> list[dict]:
        words = tokenize(query)
        scored = []
        for i, (tf, length) in enumerate(zip(self.tfs, self.lengths)):
            score = 0.0
            for w in words:
                if w in tf:
                    f = tf[w]
                    score += self.idf[w] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * length / self.avg))
            if score > 0:
                scored.append((score, i))
        scored.sort(key=lambda s: (-s[0], s[1]))
        return [{"document": self.docs[i], "score": s} for s, i in scored[:topk]]


def load_corpus(path: str) -> list[dict]:
    docs = []
    with open(path) as f:
        for n, line in enumerate(f):
            if line.strip():
                doc = json.loads(line)
                if "contents" not in doc:
                    raise ValueError(f"{path}: line {n + 1} has no 'contents'")
                docs.append({"id": doc.get("id", n), "contents": doc["contents"]})
    return docs


def make_server(docs: list[dict] | list[str], host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    docs = [d if isinstance(d, dict) else {"id": i, "contents": d} for i, d in enumerate(docs)]
    index = BM25Index(docs)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                queries, topk = body["queries"], int(body.get("topk", 3))
                payload = {"result": [index.search(str(q), topk) for q in queries]}
                code = 200
            except Exception as exc:
                payload, code = {"error": f"{type(exc).__name__}: {exc}"}, 400
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            logger.debug(fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(docs: list[dict] | list[str], host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, str]:
    """Start on a free loopback port in a daemon thread; (server, url of /retrieve). ``server.shutdown()`` stops."""
    server = make_server(docs, host, 0)
    threading.Thread(target=server.serve_forever, daemon=True, name="retrieval-server").start()
    return server, f"http://{host}:{server.server_address[1]}/retrieve"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    server = make_server(load_corpus(args.corpus), args.host, args.port)
    logger.info("retrieval server on http://%s:%d/retrieve", args.host, server.server_address[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
