"""A run-scoped LLM endpoint on 127.0.0.1, for calls the in-process hooks cannot reach: a subprocess, a tool
server, a program in another language.

Inside a node of an instrumented run, `llm_base_url()` returns a URL that stands for *this* node instance of
*this* episode (and an agent, if given). Hand it to the other program as its OpenAI base URL (`llm_env()`
gives the environment variables the OpenAI and Anthropic SDKs read). Its requests (OpenAI Chat Completions,
Completions, Responses; Anthropic Messages; `stream` too) are served by the run's call handler exactly as the
node's own calls are: the same agent routing (the node's path, `agents=` globs, the given agent, an
`X-Drmas-Agent` header), seeds, limits and recording (`_http`, `_wire`). A request after the episode ended
gets HTTP 410; one for an agent without a policy is refused (there is no app model behind the URL).

The server is one `ThreadingHTTPServer` per process, started on the first `llm_base_url()` call, listening
on 127.0.0.1 only, in a daemon thread.
"""

from __future__ import annotations

import http.server
import json
import secrets
import threading
import types
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from langchain_core.runnables.config import var_child_runnable_config

from drmas_graph.errors import ConfigError, StrictModeError, StructuredOutputError
from drmas_graph.instrumentation import _task_paths
from drmas_graph.instrumentation._intercept import ACTIVE_HANDLER, APP_MODELS, CallSite, active_runs, call_key, node_path
from drmas_graph.instrumentation._limits import EpisodeLimitError
from drmas_graph.instrumentation._wire import ANTHROPIC, parse_request
from drmas_graph.instrumentation._wire_replies import encode

__all__ = ["llm_base_url", "llm_env", "is_endpoint_url"]

_PREFIX = "/drmas/"


@dataclass(frozen=True)
class _Binding:
    """What a URL stands for: the episode's call handler and the node instance (and agent) that asked for it."""

    handler: Any
    metadata: dict[str, Any]
    tags: tuple[str, ...]
    task_paths: Any
    agent: str | None


_bindings: dict[str, _Binding] = {}
_lock = threading.Lock()
_server: http.server.ThreadingHTTPServer | None = None


def llm_base_url(agent: str | None = None, *, api: str = "openai") -> str:
    """The base URL of this node's LLM endpoint in the running episode: `api='openai'` gives the OpenAI SDK's
    base URL (`.../v1`), `api='anthropic'` the Anthropic SDK's. Calls through it are this node's calls (of
    `agent` when given). Call it inside a node of an instrumented run; the URL stops working when the episode
    ends."""
    if api not in ("openai", "anthropic"):
        raise ConfigError(f"llm_base_url(api={api!r}): valid APIs are 'openai' and 'anthropic'")
    handler = ACTIVE_HANDLER.get()
    if handler is None or handler is APP_MODELS:
        raise ConfigError("llm_base_url() was called outside an instrumented run (or inside app_models()): the URL "
                          "stands for a node of a running episode; call it inside the node that starts the program")
    config = var_child_runnable_config.get() or {}
    callbacks = config.get("callbacks")
    manager = callbacks if hasattr(callbacks, "handlers") else types.SimpleNamespace(handlers=list(callbacks or ()))
    binding = _Binding(handler, dict(config.get("metadata") or {}), tuple(config.get("tags") or ()),
                       _task_paths.task_paths_of(manager), agent)
    token = secrets.token_hex(12)
    with _lock:
        live = set(map(id, active_runs()))
        for key in [k for k, b in _bindings.items() if not _alive(b, live)]:
            del _bindings[key]
        _bindings[token] = binding
    root = f"http://127.0.0.1:{_port()}{_PREFIX}{token}"
    return root + "/v1" if api == "openai" else root


def llm_env(agent: str | None = None) -> dict[str, str]:
    """Environment variables that point the OpenAI and Anthropic SDKs of another process at this node's
    endpoint (`OPENAI_BASE_URL`, `ANTHROPIC_BASE_URL`, and placeholder API keys, which are never checked)."""
    return {"OPENAI_BASE_URL": llm_base_url(agent), "OPENAI_API_KEY": "drmas-local",
            "ANTHROPIC_BASE_URL": llm_base_url(agent, api="anthropic"), "ANTHROPIC_API_KEY": "drmas-local"}


def is_endpoint_url(url: str) -> bool:
    """True for a URL of this process's endpoint (its requests are served there, not by the in-process hook)."""
    if _server is None:
        return False
    parts = urlsplit(url)
    return parts.hostname == "127.0.0.1" and parts.port == _server.server_address[1] and parts.path.startswith(_PREFIX)


def _alive(binding: _Binding, live: set[int]) -> bool:
    return id(binding.handler) in live or bool(getattr(binding.handler, "offline", False))


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


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # the run's own logs say what was served
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._error(404, "NotFound", "the drmas-graph LLM endpoint serves POST requests only", None)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        token, _, rest = self.path[len(_PREFIX):].partition("/") if self.path.startswith(_PREFIX) else ("", "", "")
        with _lock:
            binding = _bindings.get(token)
            alive = binding is not None and _alive(binding, set(map(id, active_runs())))
        if not alive:
            self._error(410, "Gone", f"no running episode has the endpoint URL {self.path!r}: its episode ended (or "
                        "the URL is not one llm_base_url() returned); ask llm_base_url() again inside the run", None)
            return
        url = f"http://127.0.0.1:{self.server.server_address[1]}/{rest}"
        call = parse_request("POST", url, dict(self.headers.items()), body)
        if call is None:
            self._error(404, "NotFound", f"POST /{rest} is no API the endpoint serves: OpenAI chat/completions, "
                        "completions, responses, or Anthropic v1/messages, with a JSON body", None)
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

    def _error(self, status: int, kind: str, message: str, call: Any) -> None:
        if call is not None and call.protocol == ANTHROPIC:
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
        self.end_headers()
        self.wfile.write(payload)
