"""Where LLM calls are caught: a run-scoped hook on LangChain's `BaseChatModel`.

LangChain offers no public extension point that can *replace* a chat model's answer for every model
(callbacks only observe; the LLM cache is skipped by models built with `cache=False`). So, once, the
three `BaseChatModel` methods every chat call goes through are wrapped:

- `_generate_with_cache` / `_agenerate_with_cache`: `invoke`, `ainvoke`, `batch`, `generate`, tool
  binding and `with_config` all end here, with the run manager that carries LangGraph's run metadata
  (`langgraph_node`, `langgraph_step`, `langgraph_checkpoint_ns`, `langgraph_path`, and `drmas_agent`).
- `_should_stream`: inside a run it says "do not stream", so `stream()`/`astream()` fall back to
  `invoke`, which lands in the wrapper above (LangChain's own path for models that cannot stream).

The wrappers read a context variable. Outside an instrumented run it is empty and the original method
runs unchanged; inside one, it holds the run's `CallHandler`. Context variables follow LangGraph into its
worker threads and asyncio tasks, so concurrent episodes never see each other's handler.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatResult

from drmas_graph import _task_paths
from drmas_graph._chat import normalize_tools

__all__ = ["CallSite", "CallHandler", "ACTIVE_HANDLER", "install", "node_path", "call_key"]


@dataclass(frozen=True)
class CallSite:
    """Everything known about one intercepted chat-model call."""

    model: BaseChatModel
    """The application's chat model object (called for non-trainable agents)."""
    messages: list[BaseMessage]
    """The prompt."""
    stop: list[str] | None
    """Stop strings passed by the caller."""
    tools: list[dict]
    """Bound tool schemas, OpenAI function format."""
    metadata: dict[str, Any]
    """The call's run metadata (LangGraph's keys, `drmas_agent`, the caller's own)."""
    node: str
    """Node path ('outer/inner' inside subgraphs); '' when the call is not inside a graph node."""
    step: int
    """LangGraph superstep of the node; -1 outside a node."""
    call_key: str
    """Node instance key: node path, plus '[i]' for the i-th `Send` to the node."""


class CallHandler(Protocol):
    """What an instrumented run (or a replay) does with a call. `original` runs the app's own model."""

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult: ...

    async def ahandle(self, site: CallSite, original: Callable[[], Awaitable[ChatResult]]) -> ChatResult: ...


ACTIVE_HANDLER: ContextVar[CallHandler | None] = ContextVar("drmas_graph_active_handler", default=None)


def node_path(metadata: dict[str, Any]) -> str:
    """'outer/inner' from `langgraph_checkpoint_ns` ('outer:<task id>|inner:<task id>')."""
    ns = metadata.get("langgraph_checkpoint_ns")
    if ns:
        return "/".join(part.split(":", 1)[0] for part in str(ns).split("|"))
    return str(metadata.get("langgraph_node", ""))


def call_key(metadata: dict[str, Any], node: str, task_paths: Mapping[str, tuple] | None = None) -> str:
    """The node instance of a call, stable across runs whatever the scheduling order: the node path with
    '[i]' after every task that was the i-th `Send` of its step (or the i-th `@task` call of its parent),
    the call's own task and each enclosing one ('research[2]/search' for a call in subgraph node 'search'
    of the third Send to 'research').

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
    key = call_key(metadata, node, _task_paths.task_paths_of(run_manager))
    return CallSite(model=model, messages=list(messages), stop=list(stop) if stop else None,
                    tools=normalize_tools(kwargs.get("tools")), metadata=metadata, node=node,
                    step=int(step) if isinstance(step, int) else -1, call_key=key)


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Wrap the BaseChatModel methods once (idempotent). Behaviour outside a run is unchanged."""
    global _installed
    with _install_lock:
        if _installed:
            return
        orig_gen = BaseChatModel._generate_with_cache
        orig_agen = BaseChatModel._agenerate_with_cache
        orig_should_stream = BaseChatModel._should_stream

        def _generate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
            handler = ACTIVE_HANDLER.get()
            if handler is None:
                return orig_gen(self, messages, stop=stop, run_manager=run_manager, **kwargs)
            site = _site(self, messages, stop, run_manager, kwargs)
            result = handler.handle(
                site, lambda: orig_gen(self, messages, stop=stop, run_manager=run_manager, **kwargs))
            _replay_stream_events(self, result, run_manager, kwargs)
            return result

        async def _agenerate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
            handler = ACTIVE_HANDLER.get()
            if handler is None:
                return await orig_agen(self, messages, stop=stop, run_manager=run_manager, **kwargs)
            site = _site(self, messages, stop, run_manager, kwargs)
            result = await handler.ahandle(
                site, lambda: orig_agen(self, messages, stop=stop, run_manager=run_manager, **kwargs))
            replay = getattr(self, "_areplay_v2_events_for_cache_hit", None)
            if replay is not None and run_manager is not None:
                await replay(result.generations, run_manager=run_manager, **kwargs)
            return result

        def _should_stream(self, *args, **kwargs):
            if ACTIVE_HANDLER.get() is not None:
                return False
            return orig_should_stream(self, *args, **kwargs)

        BaseChatModel._generate_with_cache = _generate_with_cache
        BaseChatModel._agenerate_with_cache = _agenerate_with_cache
        BaseChatModel._should_stream = _should_stream
        _task_paths.register(lambda: ACTIVE_HANDLER.get() is not None)  # Send indices of enclosing tasks
        _installed = True


def _replay_stream_events(model: BaseChatModel, result: ChatResult, run_manager: Any, kwargs: dict) -> None:
    # LangGraph's v2 "messages" stream consumers expect stream events for every call; LangChain emits
    # them for cache hits with this (private) helper, which fits an answer that did not come from the
    # model's API. Absent in older langchain-core: nothing to replay then.
    replay = getattr(model, "_replay_v2_events_for_cache_hit", None)
    if replay is not None and run_manager is not None:
        replay(result.generations, run_manager=run_manager, **kwargs)
