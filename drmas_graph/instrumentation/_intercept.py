"""Where LLM calls are caught: a run-scoped hook on LangChain's `BaseChatModel`.

LangChain offers no public extension point that can *replace* a chat model's answer for every model
(callbacks only observe; the LLM cache is skipped by models built with `cache=False`). So, once, the
`BaseChatModel` methods every chat call goes through are wrapped:

- `_generate_with_cache` / `_agenerate_with_cache`: `invoke`, `ainvoke`, `batch`, `generate`, tool
  binding and `with_config` all end here, with the run manager that carries LangGraph's run metadata
  (`langgraph_node`, `langgraph_step`, `langgraph_checkpoint_ns`, `langgraph_path`, and `drmas_agent`).
- `_should_stream`: inside a run it says "do not stream", so `stream()`/`astream()` fall back to
  `invoke`, which lands in the wrapper above (LangChain's own path for models that cannot stream).
- `_iter_v2_events` / `_aiter_v2_events`: the content-block streaming protocol
  (`stream_events(version="v3")`) drives the model from here, not from `_generate_with_cache`.

The wrappers read a context variable. Outside an instrumented run it is empty and the original method
runs unchanged; inside one, it holds the run's `CallHandler`. Context variables follow LangGraph into its
worker threads and asyncio tasks, so concurrent episodes never see each other's handler. Two more rules
close the gaps a context variable leaves:

- Work a node submits to a `concurrent.futures.ThreadPoolExecutor` (`pool.submit`/`pool.map`,
  `loop.run_in_executor`) runs in a copy of the submitter's context, as LangChain's own executors and
  asyncio tasks do: the run's handler and the node's LangChain run config go along, so a call there, and
  a subgraph (a sub-agent) invoked there, belong to the node ('work/model'), as without the pool.
  Outside runs `submit` is unchanged.
- A call that reaches a chat model with no handler while an instrumented run is active in the process
  (a plain `threading.Thread` started by a node, a long-lived worker thread, code that bypasses the
  instrumented graph) cannot be attributed: it is refused with `StrictModeError` when a strict run is
  active, and answered by the app's own model with an `UnservedCallWarning` otherwise. Never silently.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatResult
from langchain_core.runnables.config import ContextThreadPoolExecutor

from drmas_graph.instrumentation import _task_paths
from drmas_graph._chat import normalize_tools
from drmas_graph.errors import StrictModeError, UnservedCallWarning

__all__ = ["CallSite", "CallHandler", "ACTIVE_HANDLER", "APP_MODELS", "install", "node_path", "call_key",
           "active_run", "register_run", "unregister_run", "app_models", "interrupt_node", "active_handler",
           "POLICY_REQUESTS", "policy_requests", "active_runs", "start_replay", "end_replay", "is_running",
           "on_run_end"]


@dataclass(frozen=True)
class CallSite:
    """Everything known about one intercepted chat-model call."""

    model: BaseChatModel | None
    """The application's chat model object; None for a request caught at the HTTP layer (`_http`)."""
    messages: list[BaseMessage]
    """The prompt."""
    stop: list[str] | None
    """Stop strings passed by the caller."""
    tools: list[dict]
    """Bound tool schemas, OpenAI function format."""
    metadata: dict[str, Any]
    """The call's run metadata (LangGraph's keys, `drmas_agent`, the caller's own)."""
    node: str
    """Node path ('outer/inner' inside subgraphs, also one a node's function runs, however often);
    '' when the call is not inside a graph node."""
    step: int
    """LangGraph superstep of the node; -1 outside a node."""
    call_key: str
    """Node instance key: node path, plus '[i]' for the i-th `Send` to the node."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The model call's keyword arguments (`tool_choice`, `response_format`, ...), as bound by the caller."""
    tags: tuple[str, ...] = ()
    """The call's run tags (`map:key:raw`: the raw branch of `with_structured_output(include_raw=True)`)."""
    client: str = "langchain"
    """What made the call: 'langchain' (a chat model), else the HTTP client ('httpx', 'requests', 'aiohttp')."""
    url: str | None = None
    """The request's URL, for a call caught at the HTTP layer."""
    prompt: str | None = None
    """A prompt given as text (the legacy Completions API): encoded as is, without the chat template."""

    @property
    def agent_name(self) -> str | None:
        """LangChain agent name of the call's run (`lc_agent_name`: `create_agent(name=...)`, Deep Agents)."""
        name = self.metadata.get("lc_agent_name")
        return str(name) if name else None


class CallHandler(Protocol):
    """What an instrumented run (or a replay) does with a call. `original` runs the app's own model."""

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult: ...

    async def ahandle(self, site: CallSite, original: Callable[[], Awaitable[ChatResult]]) -> ChatResult: ...


class _AppModels:
    """Handler marker: calls go to the app's own model unchanged (no recording, no guard)."""

    def __repr__(self) -> str:
        return "APP_MODELS"


APP_MODELS: Any = _AppModels()
"""Set as the active handler where the app's own models must answer (the original call of an agent
without a policy, `app_models()`)."""

ACTIVE_HANDLER: ContextVar[CallHandler | None] = ContextVar("drmas_graph_active_handler", default=None)
"""The `CallHandler` serving chat-model calls in this context: None outside instrumented runs, `APP_MODELS`
inside `app_models()`."""


POLICY_REQUESTS: ContextVar[bool] = ContextVar("drmas_graph_policy_requests", default=False)
"""True while a policy generates: its own HTTP requests (a vLLM or SGLang server, an OpenAI-compatible
endpoint a user's Policy calls) go out as they are, never back into the run's call handler."""


@contextlib.contextmanager
def policy_requests() -> Iterator[None]:
    """HTTP requests made in this context are a policy's own (see `POLICY_REQUESTS`)."""
    token = POLICY_REQUESTS.set(True)
    try:
        yield
    finally:
        POLICY_REQUESTS.reset(token)


def active_handler() -> CallHandler | None:
    """The `CallHandler` serving chat-model calls in this context (`ACTIVE_HANDLER`'s value): None outside
    instrumented runs and replays, `APP_MODELS` inside `app_models()`."""
    return ACTIVE_HANDLER.get()


_RUNS: dict[int, Any] = {}
"""Instrumented runs in progress (id -> handler): the guard's runs (`active_runs`)."""
_REPLAYS: dict[int, Any] = {}
"""Replays in progress (id -> handler): running (`is_running`), but no guard (replay has no strict mode)."""
_RUNS_LOCK = threading.Lock()
_END_LISTENERS: list[Callable[[Any], None]] = []


def register_run(handler: Any) -> None:
    """Mark an instrumented run as active in this process (see the module docstring's guard)."""
    with _RUNS_LOCK:
        _RUNS[id(handler)] = handler


def unregister_run(handler: Any) -> None:
    """The run of `handler` ended: it leaves the guard, and `on_run_end` listeners hear of it."""
    with _RUNS_LOCK:
        _RUNS.pop(id(handler), None)
    _ended(handler)


def start_replay(handler: Any) -> contextvars.Token:
    """A replay's `handler` serves the calls made in this context (and its threads and tasks) until
    `end_replay`; it is running (`is_running`) without being one of the guard's `active_runs`."""
    with _RUNS_LOCK:
        _REPLAYS[id(handler)] = handler
    return ACTIVE_HANDLER.set(handler)


def end_replay(handler: Any, token: contextvars.Token) -> None:
    """The replay of `handler` ended (`token`: what `start_replay` returned); `on_run_end` listeners hear of it."""
    ACTIVE_HANDLER.reset(token)
    with _RUNS_LOCK:
        _REPLAYS.pop(id(handler), None)
    _ended(handler)


def is_running(handler: Any) -> bool:
    """True while `handler` serves a run or a replay in progress (between `register_run` and `unregister_run`,
    or `start_replay` and `end_replay`)."""
    with _RUNS_LOCK:
        return _RUNS.get(id(handler)) is handler or _REPLAYS.get(id(handler)) is handler


def on_run_end(listener: Callable[[Any], None]) -> None:
    """`listener(handler)` is called once each run or replay ends (the local endpoint frees its URLs then)."""
    with _RUNS_LOCK:
        if listener not in _END_LISTENERS:
            _END_LISTENERS.append(listener)


def _ended(handler: Any) -> None:
    with _RUNS_LOCK:
        listeners = list(_END_LISTENERS)
    for listener in listeners:
        listener(handler)


def active_runs() -> list[Any]:
    with _RUNS_LOCK:
        return list(_RUNS.values())


@contextlib.contextmanager
def active_run(handler: Any) -> Iterator[Any]:
    """`handler` serves every chat-model call in this context (and its threads and tasks)."""
    token = ACTIVE_HANDLER.set(handler)
    register_run(handler)
    try:
        yield handler
    finally:
        ACTIVE_HANDLER.reset(token)
        unregister_run(handler)


@contextlib.contextmanager
def app_models() -> Iterator[None]:
    """Chat-model calls made in this context go to the app's own models, even while instrumented runs
    are active in the process (e.g. an LLM judge inside a reward function)."""
    token = ACTIVE_HANDLER.set(APP_MODELS)
    try:
        yield
    finally:
        ACTIVE_HANDLER.reset(token)


def node_path(metadata: dict[str, Any]) -> str:
    """'outer/inner' from `langgraph_checkpoint_ns` ('outer:<task id>|inner:<task id>'; the counter of a
    subgraph's second, third... run in one task, 'outer:<id>|1|inner:<id>', names no node)."""
    ns = metadata.get("langgraph_checkpoint_ns")
    if ns:
        return _task_paths.node_path(str(ns))
    return str(metadata.get("langgraph_node", ""))


def _recording_handler() -> Any:
    """The call handler whose calls are recorded in this context (None outside runs and in `app_models()`)."""
    handler = ACTIVE_HANDLER.get()
    return None if handler is APP_MODELS else handler


def interrupt_node(interrupt: Any, default: str) -> str:
    """Node path of the task that called `interrupt()` for `interrupt` (a LangGraph `Interrupt`) in a run of
    the call handler active here: a Functional API `@task` ('entry/task'), which the thread's state shows at
    its entrypoint, or a subgraph node ('outer/inner'); `default` when no run of this handler raised it."""
    return _task_paths.interrupt_node(_recording_handler(), getattr(interrupt, "id", None)) or default


def call_key(metadata: dict[str, Any], node: str, task_paths: Mapping[str, tuple] | None = None) -> str:
    """The node instance of a call, stable across runs whatever the scheduling order: the node path with
    '[i]' after every task that was the i-th `Send` of its step (or the i-th `@task` call of its parent),
    the call's own task and each enclosing one ('research[2]/search' for a call in subgraph node 'search'
    of the third Send to 'research'). A subgraph that one task runs several times has the same key in
    every run (as its node path): their calls are told apart by their order and their prompt, never by
    which run LangGraph happened to start first.

    The call's own task path is `langgraph_path` in `metadata`; the enclosing tasks' paths come from
    `task_paths` (namespace -> task path, recorded by `_task_paths.TaskPaths` during the run), matched
    through `langgraph_checkpoint_ns`. A task id never enters the key: LangGraph draws it from the
    checkpoint id, which is new every run.
    """
    ns = metadata.get("langgraph_checkpoint_ns")
    if not ns:
        index = _task_paths.send_index(metadata.get("langgraph_path"))
        return node if index is None else f"{node}[{index}]"
    own_ns, own_path = str(ns), metadata.get("langgraph_path")
    parts = []
    for name, task_ns in _task_paths.ancestor_namespaces(own_ns):
        path = own_path if task_ns == own_ns else (task_paths or {}).get(task_ns)
        index = _task_paths.send_index(path)
        parts.append(name if index is None else f"{name}[{index}]")
    return "/".join(parts)


def _site(model: BaseChatModel, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any,
          kwargs: dict[str, Any]) -> CallSite:
    metadata = dict(getattr(run_manager, "metadata", None) or {})
    node = node_path(metadata)
    step = metadata.get("langgraph_step", -1)
    return CallSite(model=model, messages=list(messages), stop=list(stop) if stop else None,
                    tools=normalize_tools(kwargs.get("tools")), metadata=metadata, node=node,
                    step=int(step) if isinstance(step, int) else -1,
                    call_key=call_key(metadata, node, _task_paths.task_paths_of(run_manager)),
                    kwargs=dict(kwargs), tags=tuple(getattr(run_manager, "tags", None) or ()))


def _unattributed(model: BaseChatModel) -> None:
    """A call with no handler: refuse it (a strict run is active) or warn (a run is active), see module doc."""
    runs = active_runs()
    if not runs:
        return
    where = (f"a {type(model).__name__} call was made outside the context of every instrumented run, while "
             f"{len(runs)} instrumented run(s) are active in this process, so it cannot be attributed to an "
             "episode and no policy serves it. Typical causes: a node started a plain threading.Thread, handed "
             "work to a thread that existed before the run (a queue worker), or code ran the graph without "
             "the instrumented wrapper (app.graph.invoke). Fix: call the model from the node's own thread, a "
             "concurrent.futures.ThreadPoolExecutor or loop.run_in_executor (they carry the run), or wrap "
             "deliberate calls to the app's own model in drmas_graph.app_models().")
    strict = [r for r in runs if getattr(r, "strict", False)]
    if strict:
        error = StrictModeError(where)
        if len(runs) == 1:  # unambiguous: the one active episode made it, and fails even if the app swallows it
            runs[0].refused(error)
        raise error
    warnings.warn(UnservedCallWarning(where + " The app's own model answers it."), stacklevel=4)


def _with_app_models(fn: Callable[[], Any]) -> Any:
    token = ACTIVE_HANDLER.set(APP_MODELS)
    try:
        return fn()
    finally:
        ACTIVE_HANDLER.reset(token)


async def _awith_app_models(fn: Callable[[], Awaitable[Any]]) -> Any:
    token = ACTIVE_HANDLER.set(APP_MODELS)
    try:
        return await fn()
    finally:
        ACTIVE_HANDLER.reset(token)


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Wrap the BaseChatModel methods and ThreadPoolExecutor.submit once (idempotent); `_http.install` adds the
    HTTP clients. Behaviour outside a run is unchanged."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _install_chat_hooks()
        _install_v2_event_hooks()
        orig_submit = concurrent.futures.ThreadPoolExecutor.submit

        def submit(self, fn, /, *args, **kwargs):
            handler = ACTIVE_HANDLER.get()
            if handler is None or handler is APP_MODELS or isinstance(self, ContextThreadPoolExecutor):
                return orig_submit(self, fn, *args, **kwargs)  # (LangChain's executor copies the context itself)
            return orig_submit(self, functools.partial(contextvars.copy_context().run, fn), *args, **kwargs)

        concurrent.futures.ThreadPoolExecutor.submit = submit
        _task_paths.register(_recording_handler)  # Send indices of enclosing tasks, interrupts' tasks
        _installed = True


def _install_chat_hooks() -> None:
    orig_gen = BaseChatModel._generate_with_cache
    orig_agen = BaseChatModel._agenerate_with_cache
    orig_should_stream = BaseChatModel._should_stream

    def _generate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
        handler = ACTIVE_HANDLER.get()
        if handler is None:
            _unattributed(self)
        if handler is None or handler is APP_MODELS:
            return orig_gen(self, messages, stop=stop, run_manager=run_manager, **kwargs)
        site = _site(self, messages, stop, run_manager, kwargs)
        result = handler.handle(site, lambda: _with_app_models(
            lambda: orig_gen(self, messages, stop=stop, run_manager=run_manager, **kwargs)))
        _replay_stream_events(self, result, run_manager, kwargs)
        return result

    async def _agenerate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
        handler = ACTIVE_HANDLER.get()
        if handler is None:
            _unattributed(self)
        if handler is None or handler is APP_MODELS:
            return await orig_agen(self, messages, stop=stop, run_manager=run_manager, **kwargs)
        site = _site(self, messages, stop, run_manager, kwargs)
        result = await handler.ahandle(site, lambda: _awith_app_models(
            lambda: orig_agen(self, messages, stop=stop, run_manager=run_manager, **kwargs)))
        replay = getattr(self, "_areplay_v2_events_for_cache_hit", None)
        if replay is not None and run_manager is not None:
            await replay(result.generations, run_manager=run_manager, **kwargs)
        return result

    def _should_stream(self, *args, **kwargs):
        handler = ACTIVE_HANDLER.get()
        if handler is APP_MODELS or (handler is None and not active_runs()):
            return orig_should_stream(self, *args, **kwargs)
        return False  # the call goes through _generate_with_cache, where it is served or refused

    BaseChatModel._generate_with_cache = _generate_with_cache
    BaseChatModel._agenerate_with_cache = _agenerate_with_cache
    BaseChatModel._should_stream = _should_stream


def _install_v2_event_hooks() -> None:
    """The content-block streaming path (`stream_events(version="v3")` on a chat model); absent in older
    langchain-core."""
    orig_iter = getattr(BaseChatModel, "_iter_v2_events", None)
    orig_aiter = getattr(BaseChatModel, "_aiter_v2_events", None)
    if orig_iter is None or orig_aiter is None:
        return
    from langchain_core.language_models._compat_bridge import amessage_to_events, message_to_events

    orig_gen = BaseChatModel._generate_with_cache
    orig_agen = BaseChatModel._agenerate_with_cache

    def _iter_v2_events(self, messages, *, run_manager, stream, stop=None, **kwargs) -> Iterator[Any]:
        handler = ACTIVE_HANDLER.get()
        if handler is None:
            _unattributed(self)
        if handler is None or handler is APP_MODELS:
            yield from orig_iter(self, messages, run_manager=run_manager, stream=stream, stop=stop, **kwargs)
            return
        site = _site(self, messages, stop, run_manager, kwargs)
        result = handler.handle(site, lambda: _with_app_models(
            lambda: orig_gen(self, messages, stop=stop, run_manager=run_manager, **kwargs)))
        for event in message_to_events(result.generations[0].message, message_id=stream.message_id):
            stream.dispatch(event)
            run_manager.on_stream_event(event)
            yield event

    async def _aiter_v2_events(self, messages, *, run_manager, stream, stop=None, **kwargs) -> AsyncIterator[Any]:
        handler = ACTIVE_HANDLER.get()
        if handler is None:
            _unattributed(self)
        if handler is None or handler is APP_MODELS:
            async for event in orig_aiter(self, messages, run_manager=run_manager, stream=stream, stop=stop,
                                          **kwargs):
                yield event
            return
        site = _site(self, messages, stop, run_manager, kwargs)
        result = await handler.ahandle(site, lambda: _awith_app_models(
            lambda: orig_agen(self, messages, stop=stop, run_manager=run_manager, **kwargs)))
        async for event in amessage_to_events(result.generations[0].message, message_id=stream.message_id):
            stream.dispatch(event)
            await run_manager.on_stream_event(event)
            yield event

    BaseChatModel._iter_v2_events = _iter_v2_events
    BaseChatModel._aiter_v2_events = _aiter_v2_events


def _replay_stream_events(model: BaseChatModel, result: ChatResult, run_manager: Any, kwargs: dict) -> None:
    # LangGraph's v2 "messages" stream consumers expect stream events for every call; LangChain emits
    # them for cache hits with this (private) helper, which fits an answer that did not come from the
    # model's API. Absent in older langchain-core: nothing to replay then.
    replay = getattr(model, "_replay_v2_events_for_cache_hit", None)
    if replay is not None and run_manager is not None:
        replay(result.generations, run_manager=run_manager, **kwargs)
