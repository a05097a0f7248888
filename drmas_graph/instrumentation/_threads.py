"""Where a rollout on a checkpointed thread started, and how replay starts from the same place.

A graph compiled with a checkpointer and run with ``configurable.thread_id`` continues that thread: its
state at the start (earlier messages, a pending interrupt) is part of the episode's input. `thread_start`
records the thread's checkpoint at the rollout's start in `Episode.metadata['thread_start']`;
`fork_config` copies that checkpoint (and its pending writes) into a new thread, so replay re-runs from
the same state without touching the recorded thread. When the checkpoint is not available, the reason
is returned so replay can say that the episode cannot be reproduced.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

__all__ = ["thread_start", "athread_start", "fork_config", "afork_config", "LOOK_UP", "recorded_config",
           "replay_config"]

LOOK_UP = object()
"""Marker: the thread start is still to be looked up (with the sync API)."""

def _checkpointer(graph: Any) -> Any:
    saver = getattr(graph, "checkpointer", None)
    return saver if hasattr(saver, "get_tuple") else None


def _start(graph: Any, config: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
    configurable = dict((config or {}).get("configurable") or {})
    thread_id = configurable.get("thread_id")
    saver = _checkpointer(graph)
    if thread_id is None or saver is None:
        return None, None
    return saver, {"thread_id": str(thread_id), "checkpoint_ns": configurable.get("checkpoint_ns", ""),
                   "checkpoint_id": configurable.get("checkpoint_id")}


def _lookup(start: dict[str, Any]) -> dict[str, Any]:
    return {"configurable": {k: v for k, v in start.items() if v is not None}}


def _found(start: dict[str, Any], found: Any) -> dict[str, Any]:
    if found is not None:
        start["checkpoint_id"] = found.config["configurable"]["checkpoint_id"]
    elif start["checkpoint_id"] is not None:
        start["error"] = f"checkpoint {start['checkpoint_id']} is not in thread {start['thread_id']!r}"
    return start


def thread_start(graph: Any, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The thread checkpoint a run with `config` starts from, as JSON data; None when the run uses no
    checkpointed thread. ``checkpoint_id`` None means the thread was empty (the input alone reproduces
    the run); ``error`` says why the checkpoint could not be read."""
    saver, start = _start(graph, config)
    if start is None:
        return None
    try:
        return _found(start, saver.get_tuple(_lookup(start)))
    except Exception as exc:  # e.g. an async-only saver read from its own event loop
        start["error"] = f"{type(exc).__name__}: {exc}"
        return start


async def athread_start(graph: Any, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`thread_start` with the checkpointer's async method (async runs; async-only savers)."""
    saver, start = _start(graph, config)
    if start is None:
        return None
    try:
        return _found(start, await saver.aget_tuple(_lookup(start)))
    except Exception as exc:
        start["error"] = f"{type(exc).__name__}: {exc}"
        return start


def _source(graph: Any, start: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any] | None, str | None]:
    """(saver, source config, reason it cannot be used); source None when the run started from nothing."""
    if not start or (start.get("checkpoint_id") is None and not start.get("error")):
        return None, None, None
    where = f"thread {start.get('thread_id')!r}"
    if start.get("error"):
        return None, None, (f"the episode continued {where}, whose starting checkpoint was not recorded "
                            f"({start['error']})")
    saver = _checkpointer(graph)
    if saver is None:
        return None, None, (f"the episode continued {where} from checkpoint {start['checkpoint_id']}, and the "
                            "graph has no checkpointer to read it from; compile the graph with the checkpointer "
                            "the run used")
    source = {"configurable": {"thread_id": start["thread_id"], "checkpoint_ns": start.get("checkpoint_ns") or "",
                               "checkpoint_id": start["checkpoint_id"]}}
    return saver, source, None


def _missing(start: Mapping[str, Any]) -> str:
    return (f"the episode continued thread {start.get('thread_id')!r} from checkpoint {start['checkpoint_id']}, "
            "which the graph's checkpointer does not hold (a new process with an in-memory saver?); "
            "compile the graph with the checkpointer the run used")


def _unreadable(start: Mapping[str, Any], exc: Exception) -> str:
    return (f"the episode continued thread {start.get('thread_id')!r} from checkpoint {start['checkpoint_id']}, "
            f"which the graph's checkpointer could not read ({type(exc).__name__}: {exc})")


def _writes_by_task(found: Any) -> dict[str, list[tuple[str, Any]]]:
    by_task: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for task_id, channel, value in found.pending_writes or ():
        by_task[task_id].append((channel, value))
    return by_task


def _new_thread(start: Mapping[str, Any]) -> dict[str, Any]:
    ns = start.get("checkpoint_ns") or ""
    return {"configurable": {"thread_id": f"replay-{uuid.uuid4().hex}", "checkpoint_ns": ns}}


def fork_config(graph: Any, start: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """(configurable of a new thread holding a copy of the starting checkpoint, or None when the run
    started from nothing; the reason the start cannot be reproduced, or None)."""
    saver, source, reason = _source(graph, start)
    if source is None:
        return None, reason
    try:
        found = saver.get_tuple(source)
    except Exception as exc:  # an async-only saver: `areplay` reads it
        return None, f"{_unreadable(start, exc)}; async-only checkpointers need `areplay`"
    if found is None:
        return None, _missing(start)
    target = saver.put(_new_thread(start), found.checkpoint, found.metadata, found.checkpoint["channel_versions"])
    for task_id, writes in _writes_by_task(found).items():
        saver.put_writes(target, writes, task_id)
    return _run_config(target), None


async def afork_config(graph: Any, start: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """`fork_config` with the checkpointer's async methods (for async-only savers)."""
    saver, source, reason = _source(graph, start)
    if source is None:
        return None, reason
    try:
        found = await saver.aget_tuple(source)
    except Exception as exc:
        return None, _unreadable(start, exc)
    if found is None:
        return None, _missing(start)
    target = await saver.aput(_new_thread(start), found.checkpoint, found.metadata,
                              found.checkpoint["channel_versions"])
    for task_id, writes in _writes_by_task(found).items():
        await saver.aput_writes(target, writes, task_id)
    return _run_config(target), None


def _run_config(target: Mapping[str, Any]) -> dict[str, Any]:
    """The new thread without a checkpoint id: the run continues from its latest (the copied) checkpoint."""
    return {k: v for k, v in target["configurable"].items() if k != "checkpoint_id"}


_THREAD_KEYS = frozenset({"thread_id", "checkpoint_ns", "checkpoint_id", "checkpoint_map"})
"""Configurable keys that say where the run's thread is: `thread_start` records that, and replay forks it."""


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def recorded_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What of a run config an episode records so that replay runs with it (`Episode.metadata['run_config']`):
    the `configurable` entries that are JSON values (other than the thread's place and LangGraph's private
    `__...` keys), under `configurable`; `recursion_limit`; under `omitted`, the names of configurable entries
    with no JSON form (a client object), which replay cannot pass. None when there is nothing to record."""
    config = dict(config or {})
    kept, omitted = {}, []
    for key, value in (config.get("configurable") or {}).items():
        if key in _THREAD_KEYS or str(key).startswith("__"):
            continue
        if _json_value(value):
            kept[str(key)] = value
        else:
            omitted.append(str(key))
    recorded: dict[str, Any] = {"configurable": kept} if kept else {}
    if "recursion_limit" in config:
        recorded["recursion_limit"] = config["recursion_limit"]
    if omitted:
        recorded["omitted"] = sorted(omitted)
    return recorded or None


def replay_config(recorded: Mapping[str, Any] | None, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config replay runs with: the recorded run config (`recorded_config`) under the caller's `config`
    (the caller's entries win)."""
    config = dict(config or {})
    if not recorded:
        return config
    configurable = {**(recorded.get("configurable") or {}), **(config.get("configurable") or {})}
    if configurable:
        config["configurable"] = configurable
    if "recursion_limit" in recorded:
        config.setdefault("recursion_limit", recorded["recursion_limit"])
    return config
