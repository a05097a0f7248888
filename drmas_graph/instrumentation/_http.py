"""Where LLM calls made without LangChain are caught: a run-scoped hook on the HTTP clients' send methods.

The OpenAI and Anthropic SDKs and LiteLLM send their requests through `httpx` (or its successor `httpx2`);
other code uses `requests` or `aiohttp`. Once (`install`, with the `BaseChatModel` hook), the one method
every request of each client passes through is wrapped: `httpx[2].Client.send` and `AsyncClient.send`,
`requests.Session.send`, `aiohttp.ClientSession._request`. Like the chat-model hook, the wrapper reads the
run's context variable: outside instrumented runs (and inside `app_models()`, and while a policy sends its
own requests) it calls the original method and nothing else happens.

Inside a run, a request `_wire.parse_request` recognises (OpenAI Chat Completions, Completions, Responses,
Anthropic Messages) becomes a `CallSite` with the node's LangGraph run metadata (LangChain's
`var_child_runnable_config`, which a node's code runs under) and goes to the run's call handler, the same
one LangChain calls go to: the same routing, seeds, limits, structured output and recording. The handler's
answer is encoded in the client's protocol (`_wire_replies`) and returned as that client's response object;
nothing is sent. A call whose agent has no policy (not strict) is sent as it is by the original method (the
app's own model), recorded as a non-trainable turn, and its real response returned. Replay answers from the
recording; it never sends a request.

An LLM API request (`_wire.is_llm_request`: to a known LLM API host, or shaped like an API's in full) that
is not served (an unrecognised shape, a call from a thread outside every run while runs are active) is
refused with `StrictModeError` in strict mode and sent with an `UnservedCallWarning` otherwise; either way it
is counted on the episode (`metadata["unserved_calls"]`), which `drmas-graph check` reports.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import json as jsonlib
import sys
import threading
import types
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from langchain_core.outputs import ChatResult
from langchain_core.runnables.config import var_child_runnable_config

from drmas_graph.errors import DrmasError, StrictModeError, UnservedCallWarning
from drmas_graph.instrumentation import _task_paths
from drmas_graph.instrumentation._intercept import (
    ACTIVE_HANDLER,
    APP_MODELS,
    POLICY_REQUESTS,
    CallSite,
    active_runs,
    call_key,
    node_path,
)
from drmas_graph.instrumentation._intercept import install as install_chat_hooks
from drmas_graph.instrumentation._subprocess import install as install_subprocess_env
from drmas_graph.instrumentation.endpoint import is_endpoint_url
from drmas_graph.instrumentation._wire import UNSERVED_KEY, WireCall, is_llm_request, parse_request
from drmas_graph.instrumentation._wire_replies import decode, encode

__all__ = ["install", "Reply", "UNSERVED_KEY"]

Reply = tuple[int, dict[str, str], bytes]
"""An HTTP answer: (status, headers, body)."""

_DROPPED_HEADERS = ("content-encoding", "content-length", "transfer-encoding")
"""Headers of a real response that no longer describe the body handed on (already decoded, re-measured)."""


def _watching() -> bool:
    """Whether a request made here may have to be served or refused (an instrumented run is concerned)."""
    if POLICY_REQUESTS.get():
        return False
    handler = ACTIVE_HANDLER.get()
    return handler is not APP_MODELS and (handler is not None or bool(active_runs()))


class _Plan:
    """How one request inside a run is answered: by the run's call handler, `n` times for `n` choices."""

    def __init__(self, handler: Any, call: WireCall, site: CallSite) -> None:
        self.handler, self.call, self.site = handler, call, site
        self.reply: Reply | None = None
        """The real API's answer, when the app's own model answered (an agent without a policy)."""

    def _choice(self, index: int) -> ChatResult:
        status, headers, body = self.reply  # type: ignore[misc]
        if status >= 400:
            raise _ErrorReply(self.reply)
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        choices = decode(self.call, content_type, body)
        return choices[min(index, len(choices) - 1)]

    def original(self, send: Callable[[], Reply], index: int) -> ChatResult:
        if self.reply is None:
            token = ACTIVE_HANDLER.set(APP_MODELS)
            try:
                self.reply = send()
            finally:
                ACTIVE_HANDLER.reset(token)
        return self._choice(index)

    async def aoriginal(self, send: Callable[[], Awaitable[Reply]], index: int) -> ChatResult:
        if self.reply is None:
            token = ACTIVE_HANDLER.set(APP_MODELS)
            try:
                self.reply = await send()
            finally:
                ACTIVE_HANDLER.reset(token)
        return self._choice(index)

    def answer(self, results: list[ChatResult]) -> Reply:
        if self.reply is not None:
            return self.reply
        content_type, body = encode(self.call, results)
        return 200, {"content-type": content_type}, body

    def serve(self, send: Callable[[], Reply]) -> Reply:
        try:
            results = [self.handler.handle(self.site, functools.partial(self.original, send, i))
                       for i in range(self.call.n)]
        except _ErrorReply as error:
            return error.reply
        return self.answer(results)

    async def aserve(self, send: Callable[[], Awaitable[Reply]]) -> Reply:
        try:
            results = [await self.handler.ahandle(self.site, functools.partial(self.aoriginal, send, i))
                       for i in range(self.call.n)]
        except _ErrorReply as error:
            return error.reply
        return self.answer(results)


class _ErrorReply(DrmasError):
    """The app's own model answered with an HTTP error: the client gets that answer as it came."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"HTTP {reply[0]}")
        self.reply = reply


def _node_config() -> tuple[dict[str, Any], Any]:
    """(run metadata, callbacks) of the LangChain/LangGraph run whose code is running here."""
    config = var_child_runnable_config.get() or {}
    return dict(config.get("metadata") or {}), config


def _site(call: WireCall, client: str, url: str) -> CallSite:
    metadata, config = _node_config()
    if call.agent:
        metadata["drmas_agent"] = call.agent
    node = node_path(metadata)
    step = metadata.get("langgraph_step", -1)
    callbacks = config.get("callbacks")
    manager = callbacks if hasattr(callbacks, "handlers") else types.SimpleNamespace(handlers=list(callbacks or ()))
    return CallSite(model=None, messages=call.messages, stop=call.stop, tools=call.tools, metadata=metadata,
                    node=node, step=int(step) if isinstance(step, int) else -1,
                    call_key=call_key(metadata, node, _task_paths.task_paths_of(manager)), kwargs=dict(call.kwargs),
                    tags=tuple(config.get("tags") or ()), client=client, url=url, prompt=call.prompt)


def _plan(client: str, method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> _Plan | None:
    """The plan for a request made while `_watching()`; None: send it as it is (after a warning if it is an
    LLM API request that no run can serve). Raises `StrictModeError` for one a strict run refuses."""
    if is_endpoint_url(url):  # the run's own local endpoint serves it, with the agent its URL names
        return None
    handler = ACTIVE_HANDLER.get()
    if handler is None:  # a thread outside every run, while runs are active
        if is_llm_request(url, headers, body):
            _unattributed(client, url)
        return None
    call = parse_request(method, url, headers, body)
    if call is not None:
        return _Plan(handler, call, _site(call, client, url))
    if is_llm_request(url, headers, body):
        _unserved(handler, client, method, url)
    return None


def _strict(handler: Any) -> bool:
    return bool(getattr(handler, "strict", getattr(getattr(handler, "app", None), "strict", False)))


def _unserved(handler: Any, client: str, method: str, url: str) -> None:
    """An LLM API request inside a run that no policy can serve: refused (strict, replay) or warned about."""
    metadata, _ = _node_config()
    node = node_path(metadata) or "<outside any node>"
    what = (f"node {node!r} sent a {method} request with {client} to {url}, an LLM API, in a shape drmas-graph "
            "does not serve (it serves OpenAI Chat Completions, Completions and Responses, and Anthropic Messages "
            "requests, as POST with a JSON body)")
    if getattr(handler, "offline", False):
        raise StrictModeError(f"{what}; replay never sends a request. Record the call through a client drmas-graph "
                              "serves, or wrap the deliberate call in drmas_graph.app_models().")
    strict = _strict(handler)
    note = getattr(handler, "note_unserved", None)
    if note is not None:
        note({"node": node, "client": client, "url": url, "refused": strict})
    if strict:
        error = StrictModeError(f"{what}; strict=True refuses it. Call the model through a served API, or wrap "
                                "a deliberate call (a judge) in drmas_graph.app_models().")
        if hasattr(handler, "refused"):
            handler.refused(error)  # the episode fails even if the app catches the error
        raise error
    warnings.warn(UnservedCallWarning(f"{what}; it is sent to the remote API unserved and unrecorded."), stacklevel=4)


def _unattributed(client: str, url: str) -> None:
    runs = active_runs()
    what = (f"a {client} request to {url} (an LLM API) was made outside the context of every instrumented run "
            f"while {len(runs)} run(s) are active in this process, so no episode or policy can serve it. Typical "
            "causes: a plain threading.Thread started by a node, a worker thread that existed before the run, or "
            "the graph run without the instrumented wrapper. Fix: make the call from the node's own thread, a "
            "concurrent.futures.ThreadPoolExecutor or loop.run_in_executor, or wrap a deliberate call in "
            "drmas_graph.app_models().")
    strict = any(_strict(r) for r in runs)
    for run in runs if len(runs) == 1 else ():  # unambiguous: the one active episode made it
        note = getattr(run, "note_unserved", None)
        if note is not None:
            note({"node": "<outside any run>", "client": client, "url": url, "refused": strict})
    if strict:
        error = StrictModeError(what)
        if len(runs) == 1 and hasattr(runs[0], "refused"):
            runs[0].refused(error)
        raise error
    warnings.warn(UnservedCallWarning(what + " It is sent unserved."), stacklevel=4)


def _json_body(json: Any, data: Any) -> bytes | None:
    if json is not None:
        return jsonlib.dumps(json).encode()
    if isinstance(data, str):
        return data.encode()
    return bytes(data) if isinstance(data, (bytes, bytearray)) else None


def _kept(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROPPED_HEADERS}


# ---- errors the client must not take for a failed connection ---------------------------------------------
@contextlib.contextmanager
def _raised_as_is(headers: Mapping[str, str]) -> Iterator[None]:
    """A drmas-graph error raised while a request is served (the reply broke the call's output format, a strict
    run refused it, an episode limit, a `ConfigError`) reaches the app as itself, once, whatever the client's
    retry settings. The OpenAI SDK, LiteLLM and raw clients let an exception from the transport through (LiteLLM
    maps it to its own error, which names it). The Anthropic SDK takes any exception from its transport that is
    not an `anthropic.AnthropicError` for a failed connection: it raises `APIConnectionError("Connection
    error.")` after retrying the request `max_retries` times (each retry one more generation and turn). So an
    error raised for an Anthropic request (its `anthropic-version` header) is also made an `AnthropicError`,
    which that SDK passes on as it is, without a retry (`anthropic._base_client`: "SDK-originated errors already
    carry their own type; don't wrap")."""
    try:
        yield
    except DrmasError as error:
        anthropic = sys.modules.get("anthropic")
        if anthropic is not None and any(str(k).lower() == "anthropic-version" for k in headers):
            _also(error, anthropic.AnthropicError)
        raise


def _also(error: DrmasError, base: type) -> None:
    """Make `error` an instance of `base` too (same object, message and attributes; its class keeps its name)."""
    if not isinstance(error, base):
        error.__class__ = _joined(type(error), base)


@functools.cache
def _joined(kind: type, base: type) -> type:
    """A subclass of `kind` and `base` named as `kind`, pickled as a `kind` (it exists in this process only)."""
    def reduce(self: Any) -> tuple:
        return _unjoined, (kind, self.args, dict(self.__dict__))

    return type(kind.__name__, (kind, base), {"__module__": kind.__module__, "__qualname__": kind.__qualname__,
                                              "__reduce__": reduce})


def _unjoined(kind: type, args: tuple, state: dict) -> BaseException:
    error = kind.__new__(kind)
    error.args = args
    error.__dict__.update(state)
    return error


# ---- httpx and httpx2 ---------------------------------------------------------------------------------
def _patch_httpx(module: Any, name: str) -> None:
    orig_send, orig_asend = module.Client.send, module.AsyncClient.send

    def response(request: Any, reply: Reply) -> Any:
        status, headers, body = reply
        out = module.Response(status, headers=headers, content=body, request=request)
        out.elapsed = datetime.timedelta(0)
        return out

    def send(self, request, *args, **kwargs):
        if not _watching():
            return orig_send(self, request, *args, **kwargs)
        with _raised_as_is(request.headers):
            plan = _plan(name, request.method, str(request.url), request.headers, request.read())
        if plan is None:
            return orig_send(self, request, *args, **kwargs)

        def original() -> Reply:
            real = orig_send(self, request, *args, **kwargs)
            body = real.read()
            real.close()
            return real.status_code, _kept(real.headers), body

        with _raised_as_is(request.headers):
            return response(request, plan.serve(original))

    async def asend(self, request, *args, **kwargs):
        if not _watching():
            return await orig_asend(self, request, *args, **kwargs)
        with _raised_as_is(request.headers):
            plan = _plan(name, request.method, str(request.url), request.headers, await request.aread())
        if plan is None:
            return await orig_asend(self, request, *args, **kwargs)

        async def original() -> Reply:
            real = await orig_asend(self, request, *args, **kwargs)
            body = await real.aread()
            await real.aclose()
            return real.status_code, _kept(real.headers), body

        with _raised_as_is(request.headers):
            return response(request, await plan.aserve(original))

    module.Client.send, module.AsyncClient.send = send, asend


# ---- requests ---------------------------------------------------------------------------------------
def _patch_requests(requests: Any) -> None:
    orig_send = requests.Session.send

    def send(self, request, **kwargs):
        if not _watching():
            return orig_send(self, request, **kwargs)
        body = request.body.encode() if isinstance(request.body, str) else request.body
        plan = _plan("requests", request.method or "GET", request.url, request.headers,
                     body if isinstance(body, bytes) else None)
        if plan is None:
            return orig_send(self, request, **kwargs)

        def original() -> Reply:
            real = orig_send(self, request, **kwargs)
            return real.status_code, _kept(real.headers), real.content

        status, headers, content = plan.serve(original)
        out = requests.Response()
        out.status_code, out.url, out.request, out.encoding = status, request.url, request, "utf-8"
        out.headers = requests.structures.CaseInsensitiveDict(headers)
        out.reason = "OK" if status < 400 else "Error"
        out._content, out._content_consumed = content, True  # iter_content/iter_lines read it (stream=True too)
        out.elapsed = datetime.timedelta(0)
        return out

    requests.Session.send = send


# ---- aiohttp ----------------------------------------------------------------------------------------
class _AiohttpContent:
    """The body of a served aiohttp response, read the ways code reads `ClientResponse.content`."""

    def __init__(self, body: bytes) -> None:
        self._body, self._at = body, 0

    async def read(self, n: int = -1) -> bytes:
        end = len(self._body) if n < 0 else min(len(self._body), self._at + n)
        out, self._at = self._body[self._at:end], end
        return out

    async def readany(self) -> bytes:
        return await self.read()

    async def readline(self) -> bytes:
        end = self._body.find(b"\n", self._at)
        return await self.read(len(self._body) - self._at if end < 0 else end + 1 - self._at)

    def at_eof(self) -> bool:
        return self._at >= len(self._body)

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> bytes:
        line = await self.readline()
        if not line:
            raise StopAsyncIteration
        return line

    async def iter_any(self) -> Any:
        while not self.at_eof():
            yield await self.readany()

    async def iter_chunked(self, n: int) -> Any:
        while not self.at_eof():
            yield await self.read(n)


class _AiohttpReply:
    """What a served request returns in place of an `aiohttp.ClientResponse`: status, headers, body
    (`read`/`text`/`json`, `content` for streams), `raise_for_status`, and the async context manager."""

    def __init__(self, aiohttp: Any, method: str, url: Any, reply: Reply) -> None:
        from multidict import CIMultiDict, CIMultiDictProxy

        self._aiohttp, self.method, self.url = aiohttp, method, url
        self.status, headers, self._body = reply
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self.reason = "OK" if self.status < 400 else "Error"
        self.ok = self.status < 400
        self.content = _AiohttpContent(self._body)
        self.content_type = self.headers.get("content-type", "application/json").split(";")[0]
        self.closed = False

    async def read(self) -> bytes:
        return self._body

    async def text(self, encoding: str | None = None, errors: str = "strict") -> str:
        return self._body.decode(encoding or "utf-8", errors)

    async def json(self, *, loads: Callable[[str], Any] = jsonlib.loads, **_: Any) -> Any:
        return loads(self._body.decode())

    def raise_for_status(self) -> None:
        if not self.ok:
            info = self._aiohttp.RequestInfo(self.url, self.method, self.headers, self.url)
            raise self._aiohttp.ClientResponseError(info, (), status=self.status, message=self.reason,
                                                    headers=self.headers)

    def release(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    async def wait_for_close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> _AiohttpReply:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.closed = True


def _patch_aiohttp(aiohttp: Any) -> None:
    orig_request = aiohttp.ClientSession._request

    async def _request(self, method, str_or_url, *args, **kwargs):
        if not _watching():
            return await orig_request(self, method, str_or_url, *args, **kwargs)
        build = getattr(self, "_build_url", None)
        url = build(str_or_url) if build is not None else aiohttp.client.URL(str_or_url)
        headers = {**dict(self.headers or {}), **dict(kwargs.get("headers") or {})}
        plan = _plan("aiohttp", method, str(url), headers, _json_body(kwargs.get("json"), kwargs.get("data")))
        if plan is None:
            return await orig_request(self, method, str_or_url, *args, **kwargs)

        async def original() -> Reply:
            real = await orig_request(self, method, str_or_url, *args, **kwargs)
            body = await real.read()
            real.release()
            return real.status, _kept(real.headers), body

        return _AiohttpReply(aiohttp, method, url, await plan.aserve(original))

    aiohttp.ClientSession._request = _request


_installed = False
_lock = threading.Lock()


def install() -> None:
    """Install the interception once (idempotent): the chat-model hooks (`_intercept.install`), the send
    methods of every HTTP client that is installed, and the endpoint for subprocesses (`_subprocess.install`)."""
    global _installed
    install_chat_hooks()
    install_subprocess_env()
    with _lock:
        if _installed:
            return
        for name in ("httpx", "httpx2"):
            module = _optional(name)
            if module is not None:
                _patch_httpx(module, name)
        requests = _optional("requests")
        if requests is not None:
            _patch_requests(requests)
        aiohttp = _optional("aiohttp")
        if aiohttp is not None:
            _patch_aiohttp(aiohttp)
        _installed = True


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
