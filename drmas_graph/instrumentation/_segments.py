"""Episodes that span several runs of one thread: interrupts the environment answers, and conversations.

A LangGraph app pauses at `interrupt()` (human in the loop): `invoke` returns with `__interrupt__` and the
thread waits for `Command(resume=...)`. A chat app serves one user message per `invoke` on one thread. In a
rollout the episode is the whole exchange, and the environment plays the human:

- after a run that stopped at interrupts, `resume(episode, interrupts)` answers them (a value, `{interrupt
  id: value}` for several, or a `Command`); the thread continues with `Command(resume=...)`;
- after a run that finished, `next_input(episode)` gives the user's next input on the same thread, or None
  to end the conversation;
- at most `max_resumes` runs follow the first one.

Every LLM call of every run is recorded in the one episode, in order (`Turn.segment` says which run made
it); each run is a `Segment` of `Episode.segments` (what it ran on, the interrupts it stopped at), so
replay can re-run the episode run by run. An episode left paused (no `resume`, `resume` returned None, or
the bound was hit) fails with `EpisodeInterruptedError` naming the node(s) that called `interrupt()`; a
conversation still going at the bound is truncated (`max_resumes`, `EpisodeLimitError`). A run that raises
(a limit, a model error, a failure) is a `Segment` too, and the episode's `final_state` is then its state as of
its last completed superstep (what a reward of an unfinished episode sees). The environment's hooks run with the
app's own models (`app_models()`): a user simulator's LLM is no agent of the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langgraph.types import Command

from drmas_graph.errors import ConfigError, EpisodeInterruptedError
from drmas_graph.instrumentation import _threads
from drmas_graph.instrumentation._intercept import app_models, interrupt_node
from drmas_graph.instrumentation._limits import truncate
from drmas_graph.instrumentation._streams import ainvoke_by_supersteps, invoke_by_supersteps
from drmas_graph.types import Episode, Segment

__all__ = ["EpisodeInterruptedError", "Continuation", "SegmentRunner", "continuation_from_env",
           "pending_interrupts", "apending_interrupts", "DEFAULT_MAX_RESUMES", "latest"]

DEFAULT_MAX_RESUMES = 16
"""Runs allowed after an episode's first one when the caller sets no bound (`rollout.max_resumes`)."""


@dataclass(frozen=True)
class Continuation:
    """How an episode goes on after a run of its thread ends (the environment's side of the exchange)."""

    resume: Callable[[Episode, list[Any]], Any] | None = None
    """Answers the LangGraph `Interrupt`s a run stopped at: a resume value, {interrupt id: value} for several,
    or a `Command`; None leaves the episode paused (it fails). Gets [] at a static breakpoint."""
    next_input: Callable[[Episode], Any] | None = None
    """After a run that finished: the next graph input on the same thread (a conversation's next user
    message), or None to end the episode."""
    max_resumes: int = DEFAULT_MAX_RESUMES
    """Most runs after the first (answers to interrupts and next inputs together)."""


def continuation_from_env(env: Any, task: Any, max_resumes: int) -> Continuation:
    """The environment's optional hooks `resume(task, episode, interrupts)` and `next_input(task, episode)`,
    bound to `task`."""
    resume, next_input = getattr(env, "resume", None), getattr(env, "next_input", None)
    return Continuation(
        resume=None if resume is None else _bound(resume, task),
        next_input=None if next_input is None else _bound(next_input, task),
        max_resumes=max_resumes)


def _bound(fn: Callable[..., Any], task: Any) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        async def call(*args: Any) -> Any:
            return await fn(task, *args)
    else:
        def call(*args: Any) -> Any:
            return fn(task, *args)
    call.__qualname__ = getattr(fn, "__qualname__", "hook")
    return call


@dataclass
class _Pending:
    """Where a run stopped: LangGraph's `Interrupt`s and, per interrupt (or breakpoint), its record."""

    interrupts: list[Any] = field(default_factory=list)
    """The `Interrupt` objects the resume hook answers."""
    records: list[dict] = field(default_factory=list)
    """{'node', 'id', 'value'} per interrupt; a static breakpoint is {'node': next node, 'id': None, 'value': None}."""


def latest(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run config later runs (and state reads) use: the thread's latest checkpoint, not a fixed one."""
    config = dict(config or {})
    config["configurable"] = {k: v for k, v in (config.get("configurable") or {}).items() if k != "checkpoint_id"}
    return config


def _checkpointed(graph: Any, config: Mapping[str, Any]) -> bool:
    """The run keeps a thread whose state can be read: a real saver (not `compile(checkpointer=False)` or
    True, which only a parent graph's saver would give a subgraph) and a `configurable.thread_id`."""
    return _threads._checkpointer(graph) is not None and "thread_id" in (config.get("configurable") or {})


def _from_state(state: Any) -> _Pending:
    pending = _Pending()
    for node, interrupt in _walk(state, ""):
        pending.interrupts.append(interrupt)
        pending.records.append({"node": interrupt_node(interrupt, node), "id": interrupt.id, "value": interrupt.value})
    if not pending.records:  # stopped at interrupt_before / interrupt_after
        pending.records = [{"node": name, "id": None, "value": None} for name in state.next]
    return pending


def _walk(state: Any, prefix: str) -> list[tuple[str, Any]]:
    """(node path, Interrupt) of every pending interrupt, at the innermost subgraph task that raised it."""
    out = []
    for task in state.tasks:
        path = prefix + task.name
        inner = task.state if hasattr(task.state, "tasks") else None  # a subgraph's StateSnapshot
        deeper = _walk(inner, path + "/") if inner is not None else []
        out.extend(deeper or [(path, i) for i in task.interrupts])
    return out


def _from_output(output: Any) -> _Pending | None:
    """Interrupts in a run's output (a graph without a checkpointer cannot be asked for its state)."""
    found = output.get("__interrupt__") if isinstance(output, Mapping) else None
    if not found:
        return None
    return _Pending(list(found), [{"node": interrupt_node(i, ""), "id": getattr(i, "id", None),
                                   "value": getattr(i, "value", i)} for i in found])


def pending_interrupts(graph: Any, config: Mapping[str, Any], output: Any) -> _Pending | None:
    """Where the run on `config`'s thread stopped; None when it finished."""
    if not _checkpointed(graph, config):
        return _from_output(output)
    if not graph.get_state(config).next:
        return None
    return _from_state(graph.get_state(config, subgraphs=True))


async def apending_interrupts(graph: Any, config: Mapping[str, Any], output: Any) -> _Pending | None:
    """`pending_interrupts` through the checkpointer's async API."""
    if not _checkpointed(graph, config):
        return _from_output(output)
    if not (await graph.aget_state(config)).next:
        return None
    return _from_state(await graph.aget_state(config, subgraphs=True))


def _describe(records: Sequence[dict]) -> str:
    parts = []
    for r in records:
        parts.append(f"a breakpoint before node {r['node']!r}" if r["id"] is None and r["value"] is None
                     else f"node {r['node']!r} (value {r['value']!r})")
    return "interrupted at " + ", ".join(parts)


_DONE = object()


class SegmentRunner:
    """Runs one episode's thread run after run (see the module docstring); `run`/`arun` return the last
    run's output. Keeps `Episode.segments`, `Episode.final_state` (of a run that raised: its state as of its last
    completed superstep, `_streams.invoke_by_supersteps`) and the recorder's segment up to date."""

    @staticmethod
    def check(graph: Any, config: Any, continuation: Continuation) -> None:
        """Refuse, before the episode starts, a continuation this graph and config cannot carry out."""
        if continuation.next_input is not None and not _checkpointed(graph, dict(config or {})):
            raise ConfigError("next_input continues a conversation on the episode's thread: the graph needs a "
                              "checkpointer (compile(checkpointer=InMemorySaver())) and the run config a "
                              "configurable.thread_id")
        if continuation.max_resumes < 0:
            raise ConfigError(f"max_resumes must be >= 0, got {continuation.max_resumes}")

    def __init__(self, graph: Any, episode: Episode, recorder: Any, config: Any, continuation: Continuation,
                 context: Any = None) -> None:
        self.graph, self.episode, self.recorder, self.cont = graph, episode, recorder, continuation
        self.config = config
        self.kwargs = {} if context is None else {"context": context}
        """Keyword arguments of every run (LangGraph's `context=`)."""
        self.thread = latest(config)
        self.kind, self.input = "start", None
        """The run in progress: how it was started and on what (None for the episode's input)."""
        self.segments: list[Segment] = []
        self._pending: _Pending | None = None
        """Where the last run stopped, while its interrupts are being answered."""
        self._state: tuple[Any] | None = None
        """(the run in progress's output as of its last completed superstep,), None before its first."""

    def run(self, input: Any) -> Any:
        with self._recorded_if_it_raises():
            output = invoke_by_supersteps(self.graph, input, self.config, self._keep, **self.kwargs)
        while True:
            ask = self._ended(output, pending_interrupts(self.graph, self.thread, output))
            if ask is None:
                return output
            fn, args = ask
            nxt = self._answered(_call_hook(fn, args), fn)
            if nxt is _DONE:
                return output
            with self._recorded_if_it_raises():
                output = invoke_by_supersteps(self.graph, nxt, self.thread, self._keep, **self.kwargs)

    async def arun(self, input: Any) -> Any:
        with self._recorded_if_it_raises():
            output = await ainvoke_by_supersteps(self.graph, input, self.config, self._keep, **self.kwargs)
        while True:
            ask = self._ended(output, await apending_interrupts(self.graph, self.thread, output))
            if ask is None:
                return output
            fn, args = ask
            nxt = self._answered(await _acall_hook(fn, args), fn)
            if nxt is _DONE:
                return output
            with self._recorded_if_it_raises():
                output = await ainvoke_by_supersteps(self.graph, nxt, self.thread, self._keep, **self.kwargs)

    def _keep(self, state: Any) -> None:
        self._state = (state,)

    @contextlib.contextmanager
    def _recorded_if_it_raises(self) -> Iterator[None]:
        """A run that raises (a limit stopped it, the policy's output broke the app, a cancelled episode) is a
        `Segment` too: its input is part of the trace, its turns point at it, and replay re-runs it. Its state as
        of its last completed superstep becomes the episode's `final_state` (what a reward of an unfinished
        episode sees; a run that raised before any keeps the previous run's output)."""
        self._state = None
        try:
            yield
        except BaseException:
            self._record(())
            if self._state is not None:
                self.episode.final_state = self._state[0]
            raise

    def _record(self, records: Sequence[dict]) -> None:
        """Add the run in progress, which stopped at `records` (none: it finished or raised), to the segments."""
        self.segments.append(Segment(kind=self.kind, input=self.input, interrupts=tuple(records)))
        self.episode.segments = list(self.segments) if len(self.segments) > 1 or records else []

    def _ended(self, output: Any, pending: _Pending | None) -> tuple[Callable[..., Any], tuple] | None:
        """Record the run that ended; the hook to ask next and its arguments, or None when the episode is done.
        Raises `EpisodeInterruptedError` when the run stopped at interrupts nobody may answer."""
        records = pending.records if pending else []
        self._record(records)
        if self.recorder.refusal is not None or (pending is None and self.cont.next_input is None):
            return None  # done (a refused call fails the episode when the recording ends)
        self.episode.final_state = output  # what the hooks see (and a paused episode keeps)
        self.recorder.sync_turns()
        if pending is None:
            return self.cont.next_input, (self.episode,)
        where, later_runs = _describe(records), len(self.segments) - 1
        if self.cont.resume is None:
            raise self._paused(f"{where}, and nothing answers interrupts (give the environment "
                               "resume(task, episode, interrupts), or rollout(..., resume=fn))")
        if later_runs >= self.cont.max_resumes:
            raise self._paused(f"{where} after {later_runs} resume(s)/input(s), the bound "
                               f"(rollout.max_resumes={self.cont.max_resumes})")
        self._pending = pending
        return self.cont.resume, (self.episode, list(pending.interrupts))

    def _answered(self, answer: Any, fn: Callable[..., Any]) -> Any:
        """The next run's input from the hook's answer, or _DONE."""
        if fn is self.cont.resume:
            if answer is None:
                raise self._paused(f"{_describe(self._pending.records)}, and resume() returned None (return "
                                   "Command(resume=None) to resume with None)")
            self.kind, self.input = "resume", self._resume_command(answer)
        else:
            if answer is None:
                return _DONE
            later_runs = len(self.segments) - 1
            if later_runs >= self.cont.max_resumes:
                truncate(self.episode, "max_resumes",
                         f"episode {self.episode.id} (task {self.episode.task_id}) was still going after {later_runs} "
                         f"resume(s)/input(s), the bound (rollout.max_resumes={self.cont.max_resumes}); raise it or "
                         "end the conversation sooner (next_input returns None)")
            self.kind, self.input = "input", answer
        self.recorder.segment = len(self.segments)
        return self.input

    def _resume_command(self, answer: Any) -> Command:
        """The Command that answers the pending interrupts with the resume hook's `answer`. LangGraph reads
        `Command(resume=None)` as no resume value at all (an empty Command, which it refuses): that answer
        becomes a resume map giving the pending interrupt None."""
        if not isinstance(answer, Command):
            return Command(resume=answer)
        if answer != Command(resume=None):
            return answer
        interrupts = self._pending.interrupts
        if len(interrupts) > 1:
            raise ConfigError(
                f"episode {self.episode.id} (task {self.episode.task_id}): resume() returned Command(resume=None) "
                f"while {_describe(self._pending.records)}; with several pending interrupts say which one(s) to "
                "answer: return {interrupt.id: value} (e.g. {i.id: None for i in interrupts})")
        return Command(resume={i.id: None for i in interrupts})  # {} at a breakpoint: the run just goes on

    def _paused(self, reason: str) -> EpisodeInterruptedError:
        return EpisodeInterruptedError(f"episode {self.episode.id} (task {self.episode.task_id}) {reason}",
                                       self.episode)


def _call_hook(fn: Callable[..., Any], args: tuple) -> Any:
    with app_models():  # a user simulator's own LLM is not one of the episode's agents
        if inspect.iscoroutinefunction(fn):
            raise ConfigError(f"{fn.__qualname__} is async; a sync rollout() needs sync resume/next_input hooks "
                              "(use arollout)")
        return fn(*args)


async def _acall_hook(fn: Callable[..., Any], args: tuple) -> Any:
    if inspect.iscoroutinefunction(fn):
        with app_models():
            return await fn(*args)
    return await asyncio.to_thread(_call_hook, fn, args)  # a slow simulator must not stall the other episodes
