"""A stand-in LLM API on 127.0.0.1 that records every request it receives.

It answers OpenAI Chat Completions (JSON and `stream: true`), Completions, Responses and Anthropic Messages
(JSON and `stream: true`) with fixed replies written here by hand from the APIs' documented shapes (not with
drmas-graph's encoder, which the tests check). A client pointed at it (`base_url=`) reaches it outside an
instrumented run; inside one, a served call must leave it with zero requests.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

REMOTE_TEXT = "remote words"
"""What the recording API answers."""


def _chat(body: dict) -> dict:
    return {"id": "chatcmpl-remote", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": REMOTE_TEXT, "refusal": None}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _chat_events(body: dict) -> list[tuple[str | None, object]]:
    head = {"id": "chatcmpl-remote", "object": "chat.completion.chunk", "created": 0, "model": body.get("model", "")}
    return [(None, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]}),
            (None, {**head, "choices": [{"index": 0, "delta": {"content": REMOTE_TEXT}, "finish_reason": None}]}),
            (None, {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            (None, {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
            (None, "[DONE]")]


def _completions(body: dict) -> dict:
    return {"id": "cmpl-remote", "object": "text_completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "text": REMOTE_TEXT, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _responses(body: dict) -> dict:
    return {"id": "resp_remote", "object": "response", "created_at": 0, "model": body.get("model", ""),
            "status": "completed", "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "msg_remote", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": REMOTE_TEXT, "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def _messages(body: dict) -> dict:
    return {"id": "msg_remote", "type": "message", "role": "assistant", "model": body.get("model", ""),
            "content": [{"type": "text", "text": REMOTE_TEXT}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 2}}


def _message_events(body: dict) -> list[tuple[str | None, object]]:
    start = {**_messages(body), "content": [], "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    return [("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": REMOTE_TEXT}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 2}}),
            ("message_stop", {"type": "message_stop"})]


@dataclass
class RecordingApi:
    """The running API: its base URL (no `/v1`) and the requests it received, as (path, JSON body)."""

    url: str
    received: list[tuple[str, dict]] = field(default_factory=list)
    overrides: dict[str, dict] = field(default_factory=dict)
    """path -> a JSON body answered instead of the fixed reply (a test's own remote answer)."""


def _handler(api: RecordingApi) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            path = self.path.split("?")[0]
            api.received.append((path, body))
            if path in api.overrides:
                return self._send(200, "application/json", json.dumps(api.overrides[path]).encode())
            if path.endswith("/chat/completions"):
                kind = (_chat, _chat_events)
            elif path.endswith("/completions"):
                kind = (_completions, None)
            elif path.endswith("/responses"):
                kind = (_responses, None)
            elif path.endswith("/messages"):
                kind = (_messages, _message_events)
            else:
                return self._send(404, "application/json", b'{"error": {"message": "no such path"}}')
            if body.get("stream") and kind[1] is not None:
                events = "".join((f"event: {name}\n" if name else "") + "data: "
                                 + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"
                                 for name, data in kind[1](body))
                return self._send(200, "text/event-stream", events.encode())
            return self._send(200, "application/json", json.dumps(kind[0](body)).encode())

        def _send(self, status: int, content_type: str, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def recording_api() -> Iterator[RecordingApi]:
    """A `RecordingApi` served on 127.0.0.1 (a free port) for the test's duration."""
    api = RecordingApi(url="")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield api
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
