"""Which `Send` made each enclosing task: the stable identity of a node instance inside nested graphs.

LangGraph gives a task's run metadata only its *own* path (``langgraph_path``, ``('__pregel_push', i,
...)`` for the i-th `Send` of a step) and its namespace (``langgraph_checkpoint_ns``,
``'research:<task id>|search:<task id>'``). A task inside a subgraph that was the target of a `Send`
overwrites the parent's metadata, so the parent's Send index is lost by the time the chat model is
called, and the task ids in the namespace are drawn from the checkpoint id (a new one every run).

`TaskPaths` is a LangChain callback handler that remembers, for every task namespace started in a run,
the task path LangGraph gave it. It joins every callback manager configured while an instrumented run
or a replay is active (a configure hook, the mechanism LangChain's own tracers use), is inherited by
every child run, and is found again on the chat model call's run manager. `send_indices` then turns the
call's namespace into the Send index of every ancestor task: ``research[2]/search``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

__all__ = ["TaskPaths", "send_index", "task_paths_of", "register"]

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

    def on_chain_start(self, serialized: Any, inputs: Any, *, metadata: Mapping[str, Any] | None = None,
                       **kwargs: Any) -> None:
        ns = (metadata or {}).get("langgraph_checkpoint_ns")
        path = (metadata or {}).get("langgraph_path")
        if ns and path is not None:
            self.paths.setdefault(str(ns), tuple(path))  # dict writes are atomic: threads need no lock


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


def ancestor_namespaces(ns: str) -> list[tuple[str, str]]:
    """[(node name, namespace of that task)] from the outermost task to the innermost one."""
    parts = [p for p in str(ns).split(_NS_SEP) if p]
    return [(part.split(_NS_END, 1)[0], _NS_SEP.join(parts[: i + 1])) for i, part in enumerate(parts)]


class _WhileActive:
    """The configure hook's 'context variable': a new `TaskPaths` while `active()` is true, else None.
    LangChain adds it to a callback manager only when none of its handlers is a TaskPaths already, so
    one handler is shared by a whole run (child managers inherit it)."""

    def __init__(self, active: Callable[[], bool]) -> None:
        self.active = active

    def get(self) -> TaskPaths | None:
        return TaskPaths() if self.active() else None


_registered = False


def register(active: Callable[[], bool]) -> None:
    """Add `TaskPaths` to every callback manager configured while `active()` is true (once per process)."""
    global _registered
    if not _registered:
        hook = _WhileActive(active)  # duck-typed: LangChain only calls the hook variable's get()
        register_configure_hook(hook, inheritable=True, handle_class=TaskPaths)  # type: ignore[arg-type]
        _registered = True
