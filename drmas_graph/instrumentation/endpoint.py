"""A run-scoped LLM endpoint on 127.0.0.1, for calls the in-process hooks cannot reach: a subprocess, a tool
server, a program in another language.

Inside a node of an instrumented run, `llm_base_url()` returns a URL that stands for *this* node instance of
*this* episode (and an agent, if given). Hand it to the other program as its OpenAI base URL (`llm_env()`
gives the environment variables the OpenAI and Anthropic SDKs, LangChain and LiteLLM read; a subprocess a
node with a policy starts gets them without asking, `_subprocess`). Its requests (OpenAI Chat Completions,
Completions, Responses; Anthropic Messages; `stream` too) are served by the run's call handler exactly as the
node's own calls are: the same agent routing (the node's path, `agents=` globs, the given agent, an
`X-Drmas-Agent` header), seeds, limits and recording (`_http`, `_wire`). One for an agent without a policy is
refused (there is no app model behind the URL).

A URL lives as long as its run (or replay): when the run ends (`_intercept.on_run_end`) its bindings are
dropped, and with them the handler and the episode they hold; a request to it then gets HTTP 410 naming the
episode that ended and when. A request body is read by its `Content-Length`, as `Transfer-Encoding: chunked`
(httpx with an iterator body, Node's fetch with a stream, `curl -T -`), or, on a connection the client closes
after the request, up to that close; a body that is malformed, or that cannot be delimited, gets an HTTP 4xx
that says so (never a 404 for a path the endpoint serves).

The server is one `ThreadingHTTPServer` per process, started on the first `llm_base_url()` call, listening
on 127.0.0.1 only, in a daemon thread.
"""

from __future__ import annotations

import collections
import http.server
import json
import secrets
import threading
import time
import types
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from langchain_core.runnables.config import var_child_runnable_config

from drmas_graph.errors import ConfigError, DrmasError, StrictModeError, StructuredOutputError
from drmas_graph.instrumentation import _task_paths
from drmas_graph.instrumentation._intercept import (
    ACTIVE_HANDLER,
    APP_MODELS,
    CallSite,
    call_key,
    is_running,
    node_path,
    on_run_end,
)
from drmas_graph.instrumentation._limits import EpisodeLimitError
from drmas_graph.instrumentation._wire import ANTHROPIC, parse_request
from drmas_graph.instrumentation._wire_replies import encode

__all__ = ["llm_base_url", "llm_env", "is_endpoint_url", "PLACEHOLDER_KEY", "OPENAI_URL_VARS", "ANTHROPIC_URL_VARS"]

_PREFIX = "/drmas/"

PLACEHOLDER_KEY = "drmas-local"
"""The API key `llm_env()` gives (the endpoint never checks one)."""
OPENAI_URL_VARS = ("OPENAI_BASE_URL", "OPENAI_API_BASE")
"""Variables that hold an OpenAI base URL: the OpenAI SDK's and LiteLLM's, and LangChain's `ChatOpenAI`'s (first)."""
ANTHROPIC_URL_VARS = ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_URL", "ANTHROPIC_API_BASE")
"""Variables that hold an Anthropic base URL: the Anthropic SDK's, LangChain's `ChatAnthropic`'s, LiteLLM's."""

_ENDED_KEPT = 4096
"""URLs of ended runs whose 410 still names the episode (older ones get the plain 410)."""
_MAX_BODY = 256 * 2**20
"""A request body larger than this is refused (HTTP 413)."""
_MAX_LINE = 65536
"""Longest chunk-size or trailer line of a chunked body."""
_EOF_WAIT_S = 10.0
"""How long a body without a length waits for more bytes before the client's close."""


@dataclass(frozen=True)
class _Binding:
    """What a URL stands for: the episode's call handler and the node instance (and agent) that asked for it."""

    handler: Any
    """The run's (or replay's) call handler."""
    metadata: dict[str, Any]
    """The node's LangGraph run metadata when the URL was made."""
    tags: tuple[str, ...]
    """The node's run tags."""
    task_paths: Any
    """The enclosing tasks' paths (`_task_paths`), for the call key."""
    agent: str | None
    """The agent named by `llm_base_url(agent)`; None: the node's own."""
    run: str
    """The run in words ('episode 3f2a (task t1)'), for the 410 once it ended."""


_bindings: dict[str, _Binding] = {}
_by_run: dict[int, list[str]] = {}
"""id(handler) -> the tokens of its bindings (each handler is held by its bindings, so its id is its own)."""
_ended: collections.OrderedDict[str, str] = collections.OrderedDict()
"""token -> why it no longer works ('node 'w' of episode 3f2a (task t1), which ended at 12:00:01'), newest last."""
_lock = threading.Lock()
_server: http.server.ThreadingHTTPServer | None = None


def llm_base_url(agent: str | None = None, *, api: str = "openai") -> str:
    """The base URL of this node's LLM endpoint in the running episode: `api='openai'` gives the OpenAI SDK's
    base URL (`.../v1`), `api='anthropic'` the Anthropic SDK's. Calls through it are this node's calls (of
    `agent` when given). Call it inside a node of an instrumented run; the URL stops working when the episode
    ends."""
    if api not in ("openai", "anthropic"):
        raise ConfigError(f"llm_base_url(api={api!r}): valid APIs are 'openai' and 'anthropic'")
    root = _root(_bind(agent))
    return root + "/v1" if api == "openai" else root


def llm_env(agent: str | None = None) -> dict[str, str]:
    """Environment variables that point the OpenAI and Anthropic SDKs (and LangChain's and LiteLLM's clients) of
    another process at this node's endpoint: every name in `OPENAI_URL_VARS` and `ANTHROPIC_URL_VARS`, and
    `OPENAI_API_KEY` / `ANTHROPIC_API_KEY` set to a placeholder, which is never checked."""
    root = _root(_bind(agent))
    env = {name: root + "/v1" for name in OPENAI_URL_VARS} | {name: root for name in ANTHROPIC_URL_VARS}
    return env | {"OPENAI_API_KEY": PLACEHOLDER_KEY, "ANTHROPIC_API_KEY": PLACEHOLDER_KEY}


def is_endpoint_url(url: str) -> bool:
    """True for a URL of this process's endpoint (its requests are served there, not by the in-process hook)."""
    if _server is None or not url:
        return False
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return False
    return parts.hostname == "127.0.0.1" and port == _server.server_address[1] and parts.path.startswith(_PREFIX)


def _bind(agent: str | None) -> str:
    """A new URL token for the node running here (of `agent`), alive until its run ends."""
    handler = ACTIVE_HANDLER.get()
    if handler is None or handler is APP_MODELS:
        raise ConfigError("llm_base_url() was called outside an instrumented run (or inside app_models()): the URL "
                          "stands for a node of a running episode; call it inside the node that starts the program")
    config = var_child_runnable_config.get() or {}
    callbacks = config.get("callbacks")
    manager = callbacks if hasattr(callbacks, "handlers") else types.SimpleNamespace(handlers=list(callbacks or ()))
    metadata = dict(config.get("metadata") or {})
    binding = _Binding(handler, metadata, tuple(config.get("tags") or ()), _task_paths.task_paths_of(manager), agent,
                       _run_name(handler))
    token = secrets.token_hex(12)
    _port()  # (the server runs before the URL exists)
    with _lock:  # (a run that ends meanwhile drops its bindings after this block: `_release` takes the lock)
        if not is_running(handler):
            raise ConfigError(f"llm_base_url() was called where no episode or replay is running (node "
                              f"{node_path(metadata) or '<outside any node>'!r}, handler {handler!r}: graph code that "
                              "update_state() runs, or a run that already ended); the URL stands for a node of a "
                              "running episode: call it inside a node of an instrumented run")
        _bindings[token] = binding
        _by_run.setdefault(id(handler), []).append(token)
    return token


def _root(token: str) -> str:
    """The URL of a binding, without the API's path."""
    return f"http://127.0.0.1:{_port()}{_PREFIX}{token}"


def _run_name(handler: Any) -> str:
    """The run of `handler` in words: its episode (a recorder's), else 'a replay' (replay's handler)."""
    episode = getattr(handler, "episode", None)
    if episode is not None:
        return f"episode {episode.id} (task {episode.task_id})"
    return "a replay" if getattr(handler, "offline", False) else f"the run of {type(handler).__name__}"


def _release(handler: Any) -> None:
    """The run of `handler` ended: its URLs stop working, and nothing here holds it (or its episode) any more."""
    clock = time.strftime("%H:%M:%S")
    with _lock:
        for token in _by_run.pop(id(handler), ()):
            binding = _bindings.pop(token)
            _ended[token] = (f"node {node_path(binding.metadata) or '<outside any node>'!r} of {binding.run}, which "
                             f"ended at {clock}")
        while len(_ended) > _ENDED_KEPT:
            _ended.popitem(last=False)


on_run_end(_release)


def _port() -> int:
    global _server
    with _lock:
        if _server is None:
            _server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            _server.daemon_threads = True
            threading.Thread(target=_server.serve_forever, name="drmas-llm-endpoint", daemon=True).start()
        return _server.server_address[1]


def _site(binding: _Binding, call: Any, url: str) -> CallSite:
    metadata = dict(binding.metadata)
    agent = call.agent or binding.agent
    if agent:
        metadata["drmas_agent"] = agent
    node = node_path(metadata)
    step = metadata.get("langgraph_step", -1)
    return CallSite(model=None, messages=call.messages, stop=call.stop, tools=call.tools, metadata=metadata,
                    node=node, step=int(step) if isinstance(step, int) else -1,
                    call_key=call_key(metadata, node, binding.task_paths), kwargs=dict(call.kwargs), tags=binding.tags,
                    client="endpoint", url=url, prompt=call.prompt)


def _no_app_model(site: CallSite) -> Any:
    def refuse() -> Any:
        raise ConfigError(f"a call to the local LLM endpoint from node {site.node!r} belongs to an agent without a "
                          "policy; the endpoint has no app model behind it. Give the agent a policy, or name "
                          "one that has a policy (llm_base_url(agent=...), header X-Drmas-Agent)")
    return refuse


class _BadBody(DrmasError, ValueError):
    """A request body that cannot be read: answered with `status` and `message`, and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_SERVED = {"chat/completions": "an OpenAI Chat Completions request needs a 'messages' list",
           "completions": "an OpenAI Completions request needs a 'prompt' (a fill-in-the-middle 'suffix' is not "
                          "served)",
           "responses": "an OpenAI Responses request needs an 'input'",
           "messages": "an Anthropic Messages request needs a 'messages' list (at v1/messages, or with an "
                       "anthropic-version header)"}
"""The APIs the endpoint serves, by the end of their path, and what their body must have."""


def _api_of(path: str) -> str | None:
    """The served API a request path ends with ('chat/completions' before 'completions'), else None."""
    path = path.split("?", 1)[0].rstrip("/")
    return next((api for api in _SERVED if path == api or path.endswith("/" + api)), None)


def _why_unparsed(path: str, headers: Any, body: bytes) -> tuple[int, str]:
    """(status, message) for a POST that `parse_request` did not take: 404 for a path no served API ends
    with, else 400 naming what is wrong with the body."""
    api = _api_of(path)
    if api is None:
        return 404, (f"POST /{path} is no API the endpoint serves: OpenAI chat/completions, completions, responses, "
                     "or Anthropic v1/messages, with a JSON body")
    if not body:
        return 400, (f"POST /{path} came without a body (Content-Length: 0, or neither Content-Length nor "
                     "Transfer-Encoding): send the JSON request as its body")
    encoding = headers.get("content-encoding")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        hint = f" (it came with Content-Encoding {encoding!r}, which the endpoint does not decode)" if encoding else ""
        return 400, f"the body of POST /{path} is not JSON{hint}: {exc}; starts {body[:60]!r}"
    if not isinstance(data, dict):
        return 400, f"the body of POST /{path} is a JSON {type(data).__name__}, not an object"
    return 400, f"the body of POST /{path} is no request of that API: {_SERVED[api]}; it has keys {sorted(data)[:12]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # the run's own logs say what was served
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.close_connection = True  # (a body it may have sent is not read)
        self._error(404, "NotFound", "the drmas-graph LLM endpoint serves POST requests only", None)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            body = self._body()
        except _BadBody as exc:
            self.close_connection = True  # where the next request would start is unknown
            self._error(exc.status, "BadRequest" if exc.status == 400 else "RequestError", str(exc), None)
            return
        token, _, rest = self.path[len(_PREFIX):].partition("/") if self.path.startswith(_PREFIX) else ("", "", "")
        with _lock:
            binding, ended = _bindings.get(token), _ended.get(token)
        if binding is None:
            why = (f"it stood for {ended}: its episode ended, and the URL with it" if ended else
                   "it is not one llm_base_url() returned in this process (or its episode ended long ago)")
            self._error(410, "Gone", f"no running episode has the endpoint URL {self.path!r}: {why}. A URL works "
                        "while its episode runs: ask llm_base_url() (or llm_env()) again inside the run, and let the "
                        "node wait for the program that uses it", None)
            return
        url = f"http://127.0.0.1:{self.server.server_address[1]}/{rest}"
        call = parse_request("POST", url, dict(self.headers.items()), body)
        if call is None:
            status, message = _why_unparsed(rest, self.headers, body)
            self._error(status, "NotFound" if status == 404 else "BadRequest", message, None)
            return
        site = _site(binding, call, url)
        try:
            results = [binding.handler.handle(site, _no_app_model(site)) for _ in range(call.n)]
        except StrictModeError as exc:
            self._error(403, type(exc).__name__, str(exc), call)
            return
        except (ConfigError, StructuredOutputError) as exc:
            self._error(400, type(exc).__name__, str(exc), call)
            return
        except EpisodeLimitError as exc:
            self._error(429, type(exc).__name__, str(exc), call)
            return
        except Exception as exc:  # noqa: BLE001 - the other process gets the error, the run's logs the turn
            self._error(500, type(exc).__name__, f"{type(exc).__name__}: {exc}", call)
            return
        content_type, payload = encode(call, results)
        self._send(200, content_type, payload)

    def _body(self) -> bytes:
        """The request body, framed by Transfer-Encoding (chunked), else Content-Length, else the client's close
        (a connection the client marked as its last); `_BadBody` when it cannot be read."""
        codings = [c.strip().lower() for c in ",".join(self.headers.get_all("transfer-encoding") or []).split(",")
                   if c.strip()]
        if codings:
            if codings != ["chunked"]:
                raise _BadBody(501, f"Transfer-Encoding {', '.join(codings)!r}: the endpoint reads 'chunked' only; "
                                    "send the body uncompressed, chunked or with a Content-Length")
            self.close_connection = True  # (a Content-Length beside it is ignored, so the connection ends here)
            return _read_chunked(self.rfile)
        lengths = {v.strip() for v in self.headers.get_all("content-length") or []}
        if lengths:
            if len(lengths) > 1 or not next(iter(lengths)).isdigit():
                raise _BadBody(400, f"Content-Length {', '.join(sorted(lengths))!r} is not one number of bytes")
            size = int(next(iter(lengths)))
            if size > _MAX_BODY:
                raise _BadBody(413, f"a body of {size} bytes is over the endpoint's {_MAX_BODY} bytes")
            body = self.rfile.read(size)
            if len(body) < size:
                raise _BadBody(400, f"the body ended after {len(body)} of its {size} bytes (Content-Length): the "
                                    "client closed the connection early")
            return body
        connection = (self.headers.get("connection") or "").lower()
        last = "close" in connection or (self.request_version == "HTTP/1.0" and "keep-alive" not in connection)
        return self._read_to_close() if last else b""  # (HTTP/1.1: a request without either header has no body)

    def _read_to_close(self) -> bytes:
        """A body with neither Content-Length nor Transfer-Encoding, on a connection the client ends after this
        request: it lasts until the client closes its side."""
        self.connection.settimeout(_EOF_WAIT_S)
        try:
            body = self.rfile.read(_MAX_BODY + 1)
        except TimeoutError:
            raise _BadBody(400, "the request has neither Content-Length nor Transfer-Encoding, and its body did not "
                                f"end (the client did not close its side within {_EOF_WAIT_S:.0f} s): send a "
                                "Content-Length or a chunked body") from None
        if len(body) > _MAX_BODY:
            raise _BadBody(413, f"the body is over the endpoint's {_MAX_BODY} bytes")
        return body

    def _error(self, status: int, kind: str, message: str, call: Any) -> None:
        """An error in the API's own JSON form (the call's protocol, else the one the path names)."""
        if (call.protocol == ANTHROPIC) if call is not None else _api_of(self.path) == "messages":
            body = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        if status >= 400:  # the OpenAI and Anthropic SDKs retry a 429 or 5xx (another generation) unless told not to
            self.send_header("x-should-retry", "false")
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        if self.close_connection:
            self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(payload)


def _read_chunked(rfile: Any) -> bytes:
    """A `Transfer-Encoding: chunked` body (RFC 9112 section 7.1): hexadecimal size lines (extensions after ';'
    ignored), each chunk followed by CRLF, a 0-size chunk, then trailer lines up to an empty one."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = _line(rfile, "a chunk-size line")
        if not line:
            raise _BadBody(400, f"the chunked body ended after {total} bytes, before its last chunk (a chunk of size 0)")
        text = line.split(b";", 1)[0].strip()
        if not text or text.strip(b"0123456789abcdefABCDEF"):
            raise _BadBody(400, f"a chunk size must be hexadecimal, got the line {line[:80]!r} (after {total} bytes "
                                "of the chunked body)")
        size = int(text, 16)
        if size == 0:
            break
        total += size
        if total > _MAX_BODY:
            raise _BadBody(413, f"the chunked body is over the endpoint's {_MAX_BODY} bytes")
        data = rfile.read(size)
        if len(data) < size:
            raise _BadBody(400, f"a chunk of {size} bytes ended after {len(data)}: the client closed the connection")
        parts.append(data)
        if rfile.readline(3) not in (b"\r\n", b"\n"):
            raise _BadBody(400, f"a chunk of {size} bytes (hex {text.decode()}) is not followed by CRLF: its size "
                                "line does not match its data")
    while _line(rfile, "a trailer line").strip():  # trailers (ignored) up to an empty line, or the close
        pass
    return b"".join(parts)


def _line(rfile: Any, what: str) -> bytes:
    line = rfile.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise _BadBody(400, f"{what} of the chunked body is longer than {_MAX_LINE} bytes")
    return line
