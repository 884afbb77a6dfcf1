"""A small OpenAI-compatible HTTP server on loopback, for driving the real ``openai`` client.

It answers ``POST /v1/chat/completions`` (non-streaming) with a fixed assistant message
and records the requests it received. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ANSWER = "Kyoto in November: book the 08:10 Nozomi."
MODEL = "gpt-4o-mini"


def completion(request: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake-1",
        "object": "chat.completion",
        "created": 1_764_581_640,
        "model": request.get("model", MODEL),
        "system_fingerprint": "fp_fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ANSWER, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
    }


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAI  # type: ignore[assignment]

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.requests.append((self.path, body))
        if self.path.rstrip("/").endswith("/chat/completions"):
            self._reply(200, completion(body))
        else:
            self._reply(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class FakeOpenAI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, dict[str, Any]]] = []

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


@contextmanager
def fake_openai_server() -> Iterator[FakeOpenAI]:
    """A running fake server; shut down on exit."""
    server = FakeOpenAI()
    thread = threading.Thread(target=server.serve_forever, name="fake-openai", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
