"""A tiny OpenAI-compatible server (http.server) for testing the harness without a model.

It answers ``/health``, ``/v1/models`` and ``/v1/completions``. A completion is looked up by
the last question in the prompt: ``answers`` maps question text -> completion text; unknown
questions get ``default``. It can also serve GSM8K rows in the HF rows-API format (``/rows``)
so the downloader can be tested offline, delay readiness, and fail chosen questions.

In-process: ``with FakeOpenAIServer(...) as srv: srv.base_url``.
As a stand-in for `vllm serve` (subprocess): ``python -m evals.gsm8k.fake_server MODEL --port P
[--answers FILE.json] [--ready-after S] [ignored vllm options...]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Sequence


def last_question(prompt: str) -> str:
    """The question the prompt ends with (after the last 'Question: ', before 'Answer:')."""
    tail = prompt.rsplit("Question: ", 1)[-1]
    return re.sub(r"\s*\nAnswer:\s*$", "", tail).strip()


class FakeOpenAIServer:
    def __init__(
        self,
        model: str,
        answers: Optional[Dict[str, str]] = None,
        default: str = "I do not know.",
        *,
        ready_after_s: float = 0.0,
        fail_questions: Sequence[str] = (),
        rows: Optional[Dict[str, List[dict]]] = None,
        metrics_text: Optional[str] = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.model = model
        self.answers = dict(answers or {})
        self.default = default
        self.ready_at = time.monotonic() + ready_after_s
        self.fail_questions = set(fail_questions)
        self.rows = rows or {}
        self.metrics_text = metrics_text
        self.requests: List[dict] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._overlap = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, code: int, obj) -> None:
                body = json.dumps(obj).encode("utf-8")
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                if url.path == "/health":
                    ready = time.monotonic() >= outer.ready_at
                    self._send(200 if ready else 503, {} if ready else {"error": "loading"})
                elif url.path == "/v1/models":
                    if time.monotonic() < outer.ready_at:
                        self._send(503, {"error": "loading"})
                    else:
                        self._send(
                            200,
                            {"object": "list", "data": [{"id": outer.model, "object": "model"}]},
                        )
                elif url.path == "/metrics" and outer.metrics_text is not None:
                    body = outer.metrics_text.encode("utf-8")
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif url.path == "/rows":
                    q = urllib.parse.parse_qs(url.query)
                    split = q["split"][0]
                    off, length = int(q["offset"][0]), int(q["length"][0])
                    all_rows = outer.rows.get(split, [])
                    page = [
                        {"row_idx": i, "row": r}
                        for i, r in enumerate(all_rows[off : off + length], off)
                    ]
                    self._send(200, {"rows": page, "num_rows_total": len(all_rows)})
                else:
                    self._send(404, {"error": f"no route {url.path}"})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n).decode("utf-8"))
                if self.path != "/v1/completions":
                    self._send(404, {"error": f"no route {self.path}"})
                    return
                with outer._overlap:
                    outer.requests.append(body)
                    outer._in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer._in_flight)
                    outer._overlap.notify_all()
                    # Hold the request until another one is in flight (bounded), so a test sees
                    # overlap however loaded the machine is, not only when the timing is kind.
                    outer._overlap.wait_for(lambda: outer._in_flight > 1, timeout=0.5)
                    code, reply = self._reply(body)
                    # Leave the in-flight set before the reply is sent: once the client has the
                    # reply it may send its next request, which must not count this one too.
                    outer._in_flight -= 1
                self._send(code, reply)

            def _reply(self, body: dict):
                if body.get("model") != outer.model:
                    return 404, {"error": f"model {body.get('model')!r} not served"}
                question = last_question(body.get("prompt", ""))
                if question in outer.fail_questions:
                    return 500, {"error": "injected failure"}
                text = outer.answers.get(question, outer.default)
                return 200, {
                    "object": "text_completion",
                    "model": outer.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": len(text.split())},
                }

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://{host}:{self.port}"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "FakeOpenAIServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="fake `vllm serve` for harness tests")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--answers", help="JSON file: question -> completion text")
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument(
        "--exit-after",
        type=float,
        default=None,
        help="exit with status 3 after this many seconds (simulates a crash)",
    )
    args, _ignored = p.parse_known_args(argv)
    answers = {}
    if args.answers:
        with open(args.answers, encoding="utf-8") as f:
            answers = json.load(f)
    srv = FakeOpenAIServer(
        args.model, answers, ready_after_s=args.ready_after, host=args.host, port=args.port
    )
    srv.start()
    print(f"fake server for {args.model} on {srv.base_url}", flush=True)
    try:
        if args.exit_after is not None:
            time.sleep(args.exit_after)
            return 3
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
