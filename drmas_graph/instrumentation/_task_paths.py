"""Which `Send` made each enclosing task: the stable identity of a node instance inside nested graphs.

LangGraph gives a task's run metadata only its *own* path (``langgraph_path``, ``('__pregel_push', i,
...)`` for the i-th `Send` of a step) and its namespace (``langgraph_checkpoint_ns``,
``'research:<task id>|search:<task id>'``). A task inside a subgraph that was the target of a `Send`
overwrites the parent's metadata, so the parent's Send index is lost by the time the chat model is
called, and the task ids in the namespace are drawn from the checkpoint id (a new one every run).

A namespace also holds LangGraph's subgraph-run counter: a task that runs a subgraph (a sub-agent) more
than once gets a purely numeric part for every run after its first (``'work:<id>|1|model:<id>'``), numbered
in the order the runs start, so by thread timing when they run concurrently (`.batch`, a thread pool,
`asyncio.gather`). It names no node: node paths and call keys leave it out, as LangGraph's own
`recast_checkpoint_ns` does (the calls of repeated sub-runs are told apart by their order and prompt).

`TaskPaths` is a LangChain callback handler that remembers, for every task namespace started in a run,
the task path LangGraph gave it, and for every `interrupt()` the namespace of the innermost task that
raised it (the task's run ends with LangGraph's `GraphInterrupt`; a `@task` of the Functional API too,
whose interrupt the thread's state shows at the entrypoint only). One handler serves one call handler
(an episode, a replay) across all its runs: it joins every callback manager configured while that call
handler is active (a configure hook, the mechanism LangChain's own tracers use), is inherited by every
child run, and is found again on the chat model call's run manager. `send_index` then turns the call's
namespace into the Send index of every ancestor task: ``research[2]/search``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook
from langgraph.errors import GraphInterrupt

__all__ = ["TaskPaths", "send_index", "task_paths_of", "ancestor_namespaces", "node_path", "interrupt_node",
           "register"]

_PUSH = "__pregel_push"
_NS_SEP = "|"
_NS_END = ":"


class TaskPaths(BaseCallbackHandler):
    """Callback handler: task namespace -> LangGraph task path, for every task started in one run."""

    run_inline = True  # called in the task's own thread / event loop, before the task's body runs
    raise_error = False

    def __init__(self) -> None:
        self.paths: dict[str, tuple] = {}
        """``langgraph_checkpoint_ns`` of a task -> its ``langgraph_path``."""
        self.interrupts: dict[str, str] = {}
        """Interrupt id -> namespace of the innermost task that raised it."""
        self._running: dict[UUID, str] = {}
        """Run id of a task's own run (the outermost run with its namespace) -> the namespace, while it runs."""
        self._open: dict[str, UUID] = {}
        """The other way round (a task resumed on its thread runs again under the same namespace)."""

    # dict writes are atomic and every namespace and run id is one task's: threads need no lock
    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, metadata: Mapping[str, Any] | None = None,
                       **kwargs: Any) -> None:
        ns = (metadata or {}).get("langgraph_checkpoint_ns")
        path = (metadata or {}).get("langgraph_path")
        if ns and path is not None and str(ns) not in self._open:
            self.paths.setdefault(str(ns), tuple(path))
            self._running[run_id], self._open[str(ns)] = str(ns), run_id

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        ns = self._ended(run_id)
        if ns is not None and isinstance(error, GraphInterrupt):  # the innermost task's run ends first
            for interrupt in (error.args[0] if error.args else ()):
                self.interrupts.setdefault(str(getattr(interrupt, "id", "")), ns)

    def _ended(self, run_id: UUID) -> str | None:
        ns = self._running.pop(run_id, None)
        if ns is not None:
            self._open.pop(ns, None)
        return ns


def send_index(path: Any) -> int | None:
    """i when the task was pushed as the i-th of its kind: a `Send` (path ``('__pregel_push', i, ...)``,
    the i-th Send of its step) or a functional-API `@task` call (``('__pregel_push', <parent task path>,
    i, ...)``, the i-th call its parent made); None for a task of a graph edge."""
    if not isinstance(path, (list, tuple)) or len(path) < 2 or path[0] != _PUSH:
        return None
    if isinstance(path[1], int):
        return path[1]
    if isinstance(path[1], (list, tuple)) and len(path) >= 3 and isinstance(path[2], int):
        return path[2]
    return None


def task_paths_of(run_manager: Any) -> Mapping[str, tuple]:
    """The task paths recorded by the `TaskPaths` handler on a run manager ({} if it has none)."""
    for handler in getattr(run_manager, "handlers", None) or ():
        if isinstance(handler, TaskPaths):
            return handler.paths
    return {}


def _is_counter(part: str) -> bool:
    """A subgraph-run counter part of a namespace (see the module docstring); a task part has ':<id>'."""
    return part.isdigit()


def ancestor_namespaces(ns: str) -> list[tuple[str, str]]:
    """[(node name, namespace of that task)] from the outermost task to the innermost one; subgraph-run
    counters are no tasks (they stay in the namespaces, which name tasks exactly)."""
    parts = [p for p in str(ns).split(_NS_SEP) if p]
    return [(part.split(_NS_END, 1)[0], _NS_SEP.join(parts[: i + 1]))
            for i, part in enumerate(parts) if not _is_counter(part)]


def node_path(ns: str) -> str:
    """'outer/inner' from a namespace ('outer:<task id>|1|inner:<task id>'): task names, no counters."""
    return "/".join(name for name, _ in ancestor_namespaces(ns))


class _PerHandler:
    """The configure hook's 'context variable': the `TaskPaths` of the call handler now active (one per
    handler, made on first use, gone with the handler), None while none is. LangChain adds it to a
    callback manager only when none of its handlers is a TaskPaths already (child managers inherit it)."""

    def __init__(self, current: Callable[[], Any]) -> None:
        self.current = current
        self._of: weakref.WeakKeyDictionary[Any, TaskPaths] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> TaskPaths | None:
        handler = self.current()
        return None if handler is None else self.of(handler)

    def of(self, handler: Any) -> TaskPaths:
        with self._lock:
            paths = self._of.get(handler)
            if paths is None:
                paths = self._of[handler] = TaskPaths()
            return paths

    def find(self, handler: Any) -> TaskPaths | None:
        with self._lock:
            return self._of.get(handler)


_hook: _PerHandler | None = None


def register(current: Callable[[], Any]) -> None:
    """Add the `TaskPaths` of the call handler `current()` returns to every callback manager configured
    while it returns one (once per process)."""
    global _hook
    if _hook is None:
        _hook = _PerHandler(current)  # duck-typed: LangChain only calls the hook variable's get()
        register_configure_hook(_hook, inheritable=True, handle_class=TaskPaths)  # type: ignore[arg-type]


def interrupt_node(handler: Any, interrupt_id: str | None) -> str | None:
    """Node path of the task that raised interrupt `interrupt_id` in a run of `handler` (an episode, a
    replay): a Functional API `@task`'s path ('entry/task'), a subgraph node's ('outer/inner'); None when
    no run of the handler raised it."""
    paths = _hook.find(handler) if _hook is not None and handler is not None else None
    ns = paths.interrupts.get(str(interrupt_id)) if paths is not None and interrupt_id is not None else None
    return None if ns is None else node_path(ns)
