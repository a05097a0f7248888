"""Where a rollout on a checkpointed thread started, and how replay starts from the same place.

A graph compiled with a checkpointer and run with ``configurable.thread_id`` continues that thread: its
state at the start (earlier messages, a pending interrupt) is part of the episode's input. `thread_start`
records the thread's checkpoint at the rollout's start in `Episode.metadata['thread_start']`;
`fork_config` copies that checkpoint into a new thread, so replay re-runs from the same state without
touching the recorded thread. When the checkpoint is not available, the reason is returned so replay can
say that the episode cannot be reproduced.

The copy is the thread as the run found it, not as the saver holds it afterwards:
- only the pending writes the checkpoint had at the start (`writes`: their task and channel) are copied.
  LangGraph saves a task's writes against the checkpoint it ran from, so a run that resumed an interrupt
  (or re-ran from an older checkpoint) added its own node's output there; copied, that node would count
  as done and never run again.
- every other checkpoint namespace of the thread (`namespaces`: a sub-agent compiled with
  `checkpointer=True` keeps its memory under its own namespace) is copied as it was at the start.
- a run that addressed a checkpoint (`checkpoint_id` in its config: time travel) runs on the copy
  addressed the same way, and when the thread had moved past that checkpoint (`superseded`), the copy is
  given a later checkpoint too: LangGraph re-runs finished tasks only from a superseded checkpoint.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from langgraph.checkpoint.base import copy_checkpoint
from langgraph.checkpoint.base.id import uuid6

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


def _write_keys(found: Any) -> list[list[str]]:
    return [[str(task_id), str(channel)] for task_id, channel, _ in found.pending_writes or ()]


def _found(start: dict[str, Any], found: Any, latest: Any, others: list[Any]) -> dict[str, Any]:
    """`start` completed from the checkpoint found (`latest`: the thread's newest, for an addressed one;
    `others`: the newest checkpoint of every other namespace of the thread)."""
    addressed = start["checkpoint_id"] is not None
    if found is None:
        if addressed:
            start["error"] = f"checkpoint {start['checkpoint_id']} is not in thread {start['thread_id']!r}"
        return start
    start["checkpoint_id"] = found.config["configurable"]["checkpoint_id"]
    start["writes"] = _write_keys(found)
    if addressed:
        start["addressed"] = True
        start["superseded"] = latest is not None and latest.checkpoint["id"] != found.checkpoint["id"]
    if others:
        start["namespaces"] = {o.config["configurable"]["checkpoint_ns"]: {
            "checkpoint_id": o.config["configurable"]["checkpoint_id"], "writes": _write_keys(o)} for o in others}
    return start


def _newest_per_namespace(tuples: Any, ns: str) -> list[Any]:
    """The newest checkpoint of every namespace but `ns` among a thread's checkpoints."""
    newest: dict[str, Any] = {}
    for t in tuples:
        other = t.config["configurable"].get("checkpoint_ns", "")
        if other != ns and (other not in newest or t.checkpoint["id"] > newest[other].checkpoint["id"]):
            newest[other] = t
    return [newest[k] for k in sorted(newest)]


def thread_start(graph: Any, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The thread checkpoint a run with `config` starts from, as JSON data; None when the run uses no
    checkpointed thread. ``checkpoint_id`` None means the thread was empty (the input alone reproduces
    the run); ``error`` says why the checkpoint could not be read."""
    saver, start = _start(graph, config)
    if start is None:
        return None
    try:
        found = saver.get_tuple(_lookup(start))
        if found is None:
            return _found(start, None, None, [])
        latest = saver.get_tuple(_lookup({**start, "checkpoint_id": None})) if start["checkpoint_id"] else None
        others = _newest_per_namespace(saver.list({"configurable": {"thread_id": start["thread_id"]}}),
                                       start["checkpoint_ns"])
        return _found(start, found, latest, others)
    except Exception as exc:  # e.g. an async-only saver read from its own event loop
        start["error"] = f"{type(exc).__name__}: {exc}"
        return start


async def athread_start(graph: Any, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`thread_start` with the checkpointer's async method (async runs; async-only savers)."""
    saver, start = _start(graph, config)
    if start is None:
        return None
    try:
        found = await saver.aget_tuple(_lookup(start))
        if found is None:
            return _found(start, None, None, [])
        latest = await saver.aget_tuple(_lookup({**start, "checkpoint_id": None})) if start["checkpoint_id"] else None
        listed = [t async for t in saver.alist({"configurable": {"thread_id": start["thread_id"]}})]
        return _found(start, found, latest, _newest_per_namespace(listed, start["checkpoint_ns"]))
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


def _writes_by_task(found: Any, keys: Any) -> dict[str, list[tuple[str, Any]]]:
    """The checkpoint's pending writes by task; with `keys` (the [task, channel] pairs it had when the run
    started), only those: the writes the recorded run added itself are left out. None: every write (an
    episode recorded before the keys were)."""
    wanted: dict[tuple[str, str], int] = defaultdict(int)
    for task_id, channel in keys or ():
        wanted[(task_id, channel)] += 1
    by_task: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for task_id, channel, value in found.pending_writes or ():
        if keys is not None:
            if wanted[(str(task_id), str(channel))] <= 0:
                continue
            wanted[(str(task_id), str(channel))] -= 1
        by_task[task_id].append((channel, value))
    return by_task


def _new_thread(start: Mapping[str, Any]) -> dict[str, Any]:
    ns = start.get("checkpoint_ns") or ""
    return {"configurable": {"thread_id": f"replay-{uuid.uuid4().hex}", "checkpoint_ns": ns}}


def _copies(start: Mapping[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """(source config, recorded write keys) of every checkpoint the fork copies: the start's own first."""
    tid = start["thread_id"]
    out = [({"configurable": {"thread_id": tid, "checkpoint_ns": start.get("checkpoint_ns") or "",
                              "checkpoint_id": start["checkpoint_id"]}}, start.get("writes"))]
    for ns, other in (start.get("namespaces") or {}).items():
        out.append(({"configurable": {"thread_id": tid, "checkpoint_ns": ns,
                                      "checkpoint_id": other["checkpoint_id"]}}, other.get("writes")))
    return out


def _successor(found: Any) -> tuple[Any, dict[str, Any]]:
    """A later checkpoint with the same state: makes the copy superseded, as the recorded start was."""
    checkpoint = copy_checkpoint(found.checkpoint)
    checkpoint["id"] = str(uuid6())
    return checkpoint, {**(found.metadata or {}), "source": "fork"}


def fork_config(graph: Any, start: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """(configurable of a new thread holding a copy of the starting checkpoint, or None when the run
    started from nothing; the reason the start cannot be reproduced, or None)."""
    saver, source, reason = _source(graph, start)
    if source is None:
        return None, reason
    thread, target = _new_thread(start)["configurable"]["thread_id"], None
    for k, (config, keys) in enumerate(_copies(start)):
        try:
            found = saver.get_tuple(config)
        except Exception as exc:  # an async-only saver: `areplay` reads it
            return None, f"{_unreadable(start, exc)}; async-only checkpointers need `areplay`"
        if found is None:
            if k == 0:
                return None, _missing(start)
            continue
        dest = {"configurable": {"thread_id": thread, "checkpoint_ns": config["configurable"]["checkpoint_ns"]}}
        put = saver.put(dest, found.checkpoint, found.metadata, found.checkpoint["channel_versions"])
        for task_id, writes in _writes_by_task(found, keys).items():
            saver.put_writes(put, writes, task_id)
        if k == 0:
            target = put
            if start.get("superseded"):
                saver.put(put, *_successor(found), found.checkpoint["channel_versions"])
    return _run_config(target, start), None


async def afork_config(graph: Any, start: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """`fork_config` with the checkpointer's async methods (for async-only savers)."""
    saver, source, reason = _source(graph, start)
    if source is None:
        return None, reason
    thread, target = _new_thread(start)["configurable"]["thread_id"], None
    for k, (config, keys) in enumerate(_copies(start)):
        try:
            found = await saver.aget_tuple(config)
        except Exception as exc:
            return None, _unreadable(start, exc)
        if found is None:
            if k == 0:
                return None, _missing(start)
            continue
        dest = {"configurable": {"thread_id": thread, "checkpoint_ns": config["configurable"]["checkpoint_ns"]}}
        put = await saver.aput(dest, found.checkpoint, found.metadata, found.checkpoint["channel_versions"])
        for task_id, writes in _writes_by_task(found, keys).items():
            await saver.aput_writes(put, writes, task_id)
        if k == 0:
            target = put
            if start.get("superseded"):
                await saver.aput(put, *_successor(found), found.checkpoint["channel_versions"])
    return _run_config(target, start), None


def _run_config(target: Mapping[str, Any], start: Mapping[str, Any]) -> dict[str, Any]:
    """The new thread; with the copy's checkpoint id when the recorded run addressed its checkpoint, else
    without one (the run continues from the thread's latest, the copied checkpoint)."""
    return {k: v for k, v in target["configurable"].items() if k != "checkpoint_id" or start.get("addressed")}


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
