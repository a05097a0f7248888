"""Deterministic replay: re-run a graph with every LLM call answered from a recorded episode.

No model is loaded and nothing leaves the machine. Calls are matched by node instance (`call_key`: node
path with the `Send` / `@task` call index of the call's task and of every enclosing task) and their order within it,
never by global arrival order, so parallel branches and `Send` fan-outs (into subgraphs too) replay
exactly; calls made concurrently inside one node instance are matched by prompt. When the graph has
changed, the first call whose prompt differs from the recording (or that has no recording, or whose
recording is never asked for) is reported as a `Divergence` with a readable diff; replay then stops
(every later call stops too), or, with `policies=`, continues live. A truncated recording (a limit stopped
it at an LLM call) stops the replay at that same call, without a divergence.

An episode that continued a checkpointed thread starts from the thread's recorded checkpoint, copied to a
new thread (`drmas_graph.instrumentation._threads`); when that checkpoint is not available the result says so
(`ReplayResult.unreproducible`). `areplay` runs graphs whose nodes are async-only.

An episode of several runs of its thread (interrupts the environment answered, a conversation's next inputs:
`Episode.segments`) is replayed run by run on one new thread: each run gets the recorded `Command(resume=...)`
or next input (interrupt ids in a resume map are translated to the new thread's, which differ), and where a
run stopped at other interrupts than recorded (node or value) the divergence is `interrupt_changed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.types import Command, Interrupt

from drmas_graph.instrumentation import _segments, _threads
from drmas_graph._chat import ParsedResponse, _text, parse_hermes
from drmas_graph.instrumentation._intercept import ACTIVE_HANDLER, CallSite, install
from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.instrumentation.instrumented import InstrumentedGraph, _cut_at_stop, _EpisodeRecorder, served_message
from drmas_graph.instrumentation.instrumented import structured_parts
from drmas_graph.policy import Policy
from drmas_graph.types import Episode, Segment, Turn

__all__ = ["replay", "areplay", "replay_episode", "areplay_episode", "ReplayResult", "Divergence", "render_prompt",
           "comparable"]


@dataclass(frozen=True)
class Divergence:
    """Where the re-run stopped agreeing with the recording."""

    kind: Literal["prompt_changed", "tools_changed", "unrecorded_call", "missing_call", "interrupt_changed"]
    """What differs: the prompt, the bound tools, a call the recording lacks, a recorded call never made, or
    the interrupts a run of the thread stopped at (then `call_index` is the run's `Segment` position)."""
    agent: str
    """Agent of the call (from the recording when there is one)."""
    node: str
    """Node path of the call."""
    call_key: str
    """Node instance: node path, '[i]' after each task that was the i-th Send (or @task call)."""
    call_index: int
    """Position of the call among the calls of that node instance."""
    diff: str
    """Unified diff of the recorded and the new prompt ('' when one side is missing)."""

    def __str__(self) -> str:
        head = f"{self.kind} at agent {self.agent!r}, node {self.node!r}, call {self.call_key}#{self.call_index}"
        return head + (f"\n{self.diff}" if self.diff else "")


@dataclass
class ReplayResult:
    """Outcome of a replay."""

    final_state: Any
    """What the graph returned (None when it raised because replay stopped at a divergence)."""
    turns: list[Turn]
    """The calls of the re-run: recorded answers, then live ones after a divergence (with policies=)."""
    divergences: list[Divergence] = field(default_factory=list)
    """Every divergence found, first one first."""
    recorded: Episode | None = None
    """The episode that was replayed."""
    stopped: bool = False
    """True when replay stopped at the first divergence, or where a limit stopped a truncated recording (in
    stop mode; also when the graph caught the stop and carried on: every call it made afterwards was refused
    too)."""
    wall_s: float = 0.0
    """Time the re-run took."""
    unreproducible: str | None = None
    """Why the recorded run cannot be reproduced (it continued a thread whose starting checkpoint is not
    available, or its input could not be stored); None when replay started where the recording did."""

    @property
    def state_matches(self) -> bool:
        """The re-run returned the recorded final state, up to generated ids (see `comparable`)."""
        return self.recorded is not None and comparable(self.final_state) == comparable(self.recorded.final_state)

    @property
    def state_diff(self) -> str:
        """Unified diff of the recorded and the new final state (generated ids renumbered); '' when equal."""
        if self.recorded is None or self.state_matches:
            return ""
        return _diff(_state_text(self.recorded.final_state), _state_text(self.final_state),
                     "recorded final state", "new final state")


class _StopReplay(DrmasError):
    pass


class AsyncOnlyGraphError(ConfigError):
    """`replay` was given a graph with async-only nodes: use `areplay`."""


def render_prompt(messages: Sequence[BaseMessage], tools: Sequence[dict] = ()) -> str:
    """A prompt as readable lines: one 'role: content' block per message, tool calls and tool names."""
    lines = []
    for m in messages:
        lines.append(f"[{m.type}] {_text(m.content)}")
        for call in getattr(m, "tool_calls", None) or ():
            lines.append(f"  -> tool call {call['name']}({json.dumps(call.get('args', {}), sort_keys=True)})")
    if tools:
        lines.append("[tools] " + ", ".join(t.get("function", {}).get("name", "?") for t in tools))
    return "\n".join(lines)


def _diff(recorded: str, new: str, old_name: str = "recorded prompt", new_name: str = "new prompt") -> str:
    return "\n".join(difflib.unified_diff(recorded.splitlines(), new.splitlines(), old_name, new_name, lineterm=""))


class _ReplayHandler:
    """CallHandler that answers each call from the recording while prompts agree."""

    def __init__(self, recorded: Episode, live: _EpisodeRecorder | None, continue_live: bool,
                 agent_of: Callable[[CallSite], str]) -> None:
        self.by_key = {(t.call_key, t.node_call_index): t for t in recorded.turns}
        self.used: set[tuple[str, int]] = set()
        self.live = live
        self.continue_live = continue_live
        self.agent_of = agent_of
        self.divergences: list[Divergence] = []
        self.truncated = recorded.truncated
        self.ended = False
        """A truncated recording was used up: the re-run reached the call the limit stopped (no divergence)."""
        self.turns: list[Turn] = []
        self._per_key: dict[str, int] = {}
        self._lock = threading.Lock()

    def _match(self, site: CallSite) -> Turn | None:
        """The recorded answer for this call; None once the run has diverged and continues live. In stop
        mode every call after the first divergence stops (none reaches a model)."""
        with self._lock:
            n = self._per_key.get(site.call_key, 0)
            self._per_key[site.call_key] = n + 1
            if self.divergences:
                if self.continue_live:
                    return None
                raise _StopReplay(f"replay stopped at the first divergence: {self.divergences[0]}")
            turn = self._same_call(site, n)
            if turn is not None:
                self.used.add((turn.call_key, turn.node_call_index))
                self.turns.append(turn)
                return turn
            if self.truncated and len(self.used) == len(self.by_key):  # where the limit stopped the recording
                self.ended = True
                if self.continue_live:
                    return None
                raise _StopReplay(f"the recording ends here, where a limit stopped it: {self.truncated}")
            d = self._divergence(site, n)
            self.divergences.append(d)
        if not self.continue_live:
            raise _StopReplay(str(d))
        return None

    def _same_call(self, site: CallSite, n: int) -> Turn | None:
        """The n-th recorded call of this node instance if it has the same prompt and tools; else an unused
        recorded call of the instance that does (calls a node makes concurrently arrive in any order)."""
        expected = self.by_key.get((site.call_key, n))
        if expected is not None and (site.call_key, n) not in self.used and _same_prompt(expected, site):
            return expected
        others = (t for (key, i), t in sorted(self.by_key.items(), key=lambda kv: kv[0][1])
                  if key == site.call_key and (key, i) not in self.used)
        return next((t for t in others if _same_prompt(t, site)), None)

    def _divergence(self, site: CallSite, n: int) -> Divergence:
        turn = self.by_key.get((site.call_key, n))
        if turn is not None and (site.call_key, n) in self.used:  # its recording went to a concurrent call
            turn = next((t for (key, i), t in sorted(self.by_key.items())
                         if key == site.call_key and (key, i) not in self.used), None)
        new_prompt = render_prompt(site.messages, site.tools)
        if turn is None:
            return Divergence("unrecorded_call", self.agent_of(site), site.node, site.call_key, n,
                              _diff("", new_prompt))
        kind = "prompt_changed" if render_prompt(turn.messages) != render_prompt(site.messages) else "tools_changed"
        return Divergence(kind, turn.agent, site.node, site.call_key, turn.node_call_index,
                          _diff(render_prompt(turn.messages, turn.tools), new_prompt))

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        turn = self._match(site)
        if turn is None:
            return self.live.handle(site, _no_original(site))
        return _recorded_answer(turn)

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        turn = self._match(site)
        if turn is None:
            return await self.live.ahandle(site, _no_original(site))
        return _recorded_answer(turn)

    def missing_calls(self) -> list[Divergence]:
        return [Divergence("missing_call", t.agent, t.node, t.call_key, t.node_call_index, "")
                for key, t in sorted(self.by_key.items(), key=lambda kv: kv[1].index) if key not in self.used]


def _same_prompt(turn: Turn, site: CallSite) -> bool:
    return render_prompt(turn.messages) == render_prompt(site.messages) and (
        [t.get("function", t) for t in turn.tools] == [t.get("function", t) for t in site.tools])


def _no_original(site: CallSite) -> Callable[[], Any]:
    def refuse() -> Any:
        raise ConfigError(f"replay continued live at node {site.node!r}, but no policy serves its agent; pass "
                          "policies= covering every agent that acts after the divergence")
    return refuse


def _recorded_answer(turn: Turn) -> ChatResult:
    """Rebuild the AIMessage the node received when the episode was recorded (Hermes tool-call markup)."""
    content, invalid = turn.response_text, []
    if turn.trainable:
        parsed = parse_hermes(_cut_at_stop(turn.response_text, turn.sampling.stop if turn.sampling else ()))
        content, invalid = parsed.content, parsed.invalid_tool_calls
    answer = ParsedResponse(content=content, tool_calls=[dict(c) for c in turn.tool_calls], invalid_tool_calls=invalid)
    extra: dict = {}
    if turn.trainable and turn.response_format:  # structured output: the same answer (or the same error) again
        answer, extra = structured_parts(turn, parse_hermes)
    message = served_message(answer, finish=turn.finish_reason, policy_name=turn.policy,
                             policy_version=turn.policy_version, agent=turn.agent, index=turn.index,
                             n_prompt=len(turn.prompt_ids), n_response=len(turn.response_ids),
                             message_id=turn.message_id, additional_kwargs=extra)
    return ChatResult(generations=[ChatGeneration(message=message)])


@dataclass
class _Run:
    """One replay in progress: what `replay_episode` and `areplay_episode` share."""

    app: InstrumentedGraph
    handler: _ReplayHandler
    live: _EpisodeRecorder
    live_episode: Episode
    config: dict | None
    unreproducible: str | None = None
    start: float = 0.0


def _prepare(graph: Any, episode: Episode, policies: Mapping[str, Policy] | None, agents: Mapping[str, str] | None,
             on_divergence: str, config: dict | None) -> _Run:
    if on_divergence not in ("stop", "continue"):
        raise ConfigError(f"on_divergence must be 'stop' or 'continue', got {on_divergence!r}")
    if on_divergence == "continue" and not policies:
        raise ConfigError("on_divergence='continue' needs policies= to serve the calls after the divergence")
    app = InstrumentedGraph(graph, policies or {}, agents=agents)
    install()
    live_episode = Episode(task_id=episode.task_id, group_id=episode.group_id, input=episode.input)
    live = _EpisodeRecorder(app, live_episode)
    handler = _ReplayHandler(episode, live, on_divergence == "continue", app.agent_of)
    return _Run(app, handler, live, live_episode, dict(config or {}), _unstorable_input(episode))


def _own_thread(run: _Run) -> bool:
    """The caller named the thread to replay on (then no copy of the recorded start is made)."""
    return "thread_id" in (run.config.get("configurable") or {})


def _thread_config(run: _Run, forked: dict | None, reason: str | None) -> None:
    """Run on the copy of the recorded thread start, else on a fresh thread (never the recorded one)."""
    run.unreproducible = run.unreproducible or reason
    if getattr(run.app.graph, "checkpointer", None) and not _own_thread(run):
        configurable = run.config.setdefault("configurable", {})
        configurable.update(forked or {"thread_id": f"replay-{uuid.uuid4().hex}"})
        configurable.pop("checkpoint_id", None)


def _finish(run: _Run, episode: Episode, final_state: Any, stopped: bool) -> ReplayResult:
    run.live.finish()
    handler = run.handler
    stopped = stopped or ((bool(handler.divergences) or handler.ended) and not handler.continue_live)
    if not stopped and not handler.divergences:
        handler.divergences.extend(handler.missing_calls())
    return ReplayResult(final_state=final_state, turns=handler.turns + run.live_episode.turns,
                        divergences=handler.divergences, recorded=episode, stopped=stopped,
                        wall_s=time.perf_counter() - run.start, unreproducible=run.unreproducible)


@dataclass
class _Outcome:
    final_state: Any = None
    stopped: bool = False
    """True when the replay stopped the run at a divergence (stop mode)."""


@contextlib.contextmanager
def _serving(run: Any) -> Iterator[_Outcome]:
    """The block runs the graph with the replay handler answering its calls; the replay's own stop ends the
    block quietly (`outcome.stopped`), any other exception propagates."""
    outcome = _Outcome()
    token = ACTIVE_HANDLER.set(run.handler)
    run.start = time.perf_counter()
    try:
        yield outcome
    except Exception as exc:
        if not _stopped(exc):
            raise
        outcome.stopped = True
    finally:
        ACTIVE_HANDLER.reset(token)


def _stopped(exc: BaseException) -> bool:
    """True for the replay's own stop; re-raises anything else (a sync-only run of async nodes, explained)."""
    if _caused_by(exc, _StopReplay):
        return True
    if isinstance(exc, TypeError) and "No synchronous function provided" in str(exc):
        raise AsyncOnlyGraphError(f"the graph has async-only nodes ({exc}); replay it with `await areplay(...)` or "
                          "`await areplay_episode(...)`") from exc
    return False


_END = object()


class _Runs:
    """The recorded runs of a multi-run episode (`Episode.segments`), fed to the replay one after another."""

    def __init__(self, run: _Run, episode: Episode) -> None:
        self.run, self.segments, self.k = run, episode.segments, 0
        if len(self.segments) > 1 and getattr(run.app.graph, "checkpointer", None) is None:
            raise ConfigError(f"episode {episode.id} is {len(self.segments)} runs of one thread (interrupts answered "
                              "or a conversation continued); replaying it needs the graph compiled with a "
                              "checkpointer (e.g. compile(checkpointer=InMemorySaver()))")

    @property
    def recorded(self) -> bool:
        """Whether the episode recorded its runs (else it ran once to the end: nothing to check between runs)."""
        return bool(self.segments)

    def after(self, pending: Any) -> Any:
        """The input of the next run once run k stopped at `pending`; `_END` when the replay is done."""
        recorded = self.segments[self.k]
        live = pending.records if pending is not None else []
        if _interrupts_text(recorded.interrupts) != _interrupts_text(live):
            d = Divergence("interrupt_changed", "", (list(recorded.interrupts) or live or [{"node": ""}])[0]["node"],
                           "", self.k, _diff(_interrupts_text(recorded.interrupts), _interrupts_text(live),
                                             "recorded interrupts", "new interrupts"))
            self.run.handler.divergences.append(d)
            if not self.run.handler.continue_live:
                raise _StopReplay(str(d))
            return _END
        if self.k + 1 >= len(self.segments):
            return _END
        self.k += 1
        self.run.live.segment = self.k
        return _translated(self.segments[self.k], recorded.interrupts, live)


def _interrupts_text(records: Sequence[Mapping[str, Any]]) -> str:
    """Interrupts as lines of node and value (ids differ from thread to thread: they are left out)."""
    return "\n".join(f"{r['node']}: {json.dumps(comparable(r['value']), sort_keys=True, default=repr)}"
                     for r in records)


def _translated(segment: Segment, recorded: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]]) -> Any:
    """The segment's input for the new thread: a resume map keyed by recorded interrupt ids is re-keyed by the
    ids of the new thread's interrupts, matched by position."""
    value = segment.input
    if isinstance(value, Command) and isinstance(value.resume, Mapping) and value.resume:
        ids = {r["id"]: n["id"] for r, n in zip(recorded, live) if r["id"] is not None}
        if all(key in ids for key in value.resume):
            return dataclasses.replace(value, resume={ids[key]: v for key, v in value.resume.items()})
    return value


def replay_episode(graph: Any, episode: Episode, *, policies: Mapping[str, Policy] | None = None,
                   agents: Mapping[str, str] | None = None, on_divergence: Literal["stop", "continue"] = "stop",
                   config: dict | None = None) -> ReplayResult:
    """Replay an in-memory `Episode` (see `replay`)."""
    run = _prepare(graph, episode, policies, agents, on_divergence, config)
    runs = _Runs(run, episode)
    start = None if _own_thread(run) else episode.metadata.get("thread_start")
    _thread_config(run, *_threads.fork_config(run.app.graph, start))
    with _serving(run) as outcome:
        output = run.app.graph.invoke(episode.input, run.config or None)
        while runs.recorded:
            nxt = runs.after(_segments.pending_interrupts(run.app.graph, run.config, output))
            if nxt is _END:
                break
            output = run.app.graph.invoke(nxt, run.config)
        outcome.final_state = output
    return _finish(run, episode, outcome.final_state, outcome.stopped)


async def areplay_episode(graph: Any, episode: Episode, *, policies: Mapping[str, Policy] | None = None,
                          agents: Mapping[str, str] | None = None,
                          on_divergence: Literal["stop", "continue"] = "stop", config: dict | None = None
                          ) -> ReplayResult:
    """`replay_episode` through the graph's async API (`ainvoke`): for graphs with async-only nodes."""
    run = _prepare(graph, episode, policies, agents, on_divergence, config)
    runs = _Runs(run, episode)
    start = None if _own_thread(run) else episode.metadata.get("thread_start")
    _thread_config(run, *await _threads.afork_config(run.app.graph, start))
    with _serving(run) as outcome:
        output = await run.app.graph.ainvoke(episode.input, run.config or None)
        while runs.recorded:
            nxt = runs.after(await _segments.apending_interrupts(run.app.graph, run.config, output))
            if nxt is _END:
                break
            output = await run.app.graph.ainvoke(nxt, run.config)
        outcome.final_state = output
    return _finish(run, episode, outcome.final_state, outcome.stopped)


def _load(store_or_path: Any, episode_id: str) -> Episode:
    from drmas_graph.traces.store import TraceStore

    if isinstance(store_or_path, TraceStore):
        return store_or_path.load_episode(episode_id)
    with TraceStore(store_or_path, readonly=True) as store:
        return store.load_episode(episode_id)


def replay(graph: Any, store_or_path: Any, episode_id: str, *, policies: Mapping[str, Policy] | None = None,
           agents: Mapping[str, str] | None = None, on_divergence: Literal["stop", "continue"] = "stop",
           config: dict | None = None) -> ReplayResult:
    """Re-run `graph` on a stored episode's input with every LLM call answered from the recording.

    Args:
        graph: the (possibly edited) compiled graph or StateGraph builder.
        store_or_path: a `TraceStore` or the path of its file.
        episode_id: the episode to replay.
        policies: live policies (agent -> Policy) that serve calls after a divergence when
            on_divergence='continue'.
        agents: node-path glob -> agent, as for `instrument`.
        on_divergence: 'stop' (default) returns at the first divergence (no later call is answered or
            reaches a model); 'continue' goes on live.
        config: the run config (e.g. `recursion_limit`). A graph with a checkpointer runs on a new thread
            (a copy of the thread checkpoint the recording started from, if it continued a thread) unless
            `configurable.thread_id` names one.

    Graphs whose nodes are async-only need `areplay`; calling `replay` on them raises a ConfigError
    saying so. From inside a running event loop, use `await areplay(...)`.
    """
    return replay_episode(graph, _load(store_or_path, episode_id), policies=policies, agents=agents,
                          on_divergence=on_divergence, config=config)


async def areplay(graph: Any, store_or_path: Any, episode_id: str, *, policies: Mapping[str, Policy] | None = None,
                  agents: Mapping[str, str] | None = None, on_divergence: Literal["stop", "continue"] = "stop",
                  config: dict | None = None) -> ReplayResult:
    """`replay` through the graph's async API (`ainvoke`): for graphs whose nodes are async-only (any graph
    works; sync nodes run in LangGraph's executor). Same arguments and result as `replay`."""
    episode = await asyncio.to_thread(_load, store_or_path, episode_id)
    return await areplay_episode(graph, episode, policies=policies, agents=agents, on_divergence=on_divergence,
                                 config=config)


def _unstorable_input(episode: Episode) -> str | None:
    """Why the stored input cannot be replayed (a value with no JSON form, e.g. `Command(resume=...)`)."""
    if '"__unserializable__"' in json.dumps(episode.input, default=str):
        return ("the episode's input had no JSON form and was stored as its repr (e.g. a Command resuming an "
                "interrupt); replay ran on that repr")
    return None


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


_GENERATED_ID_KEYS = frozenset({"id", "tool_call_id"})
"""Keys inside a message whose values are drawn at random: the message id (LangGraph's add_messages
reducer, LangChain's run ids), tool-call ids (drawn by parsers and by third-party code such as
langgraph-supervisor's handoff messages) and the ToolMessage's reference to one."""


def comparable(value: Any) -> Any:
    """A JSON-like form of a graph state for equality, up to generated ids: inside LangChain messages, every
    id (message id, tool-call id, a ToolMessage's tool_call_id) is renamed '<id:k>' in order of first
    appearance, and so is the id of every LangGraph `Interrupt` (compared by value; a stored one is a dict).
    The renaming is consistent, so a ToolMessage still has to answer the same tool call as in the recording,
    while two runs that drew different uuids compare equal. Dataclasses compare as their fields."""
    return _Canonical().walk(value, in_message=False)


class _Canonical:
    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def rename(self, generated: str) -> str:
        return self.names.setdefault(generated, f"<id:{len(self.names)}>")

    def walk(self, value: Any, in_message: bool) -> Any:
        if isinstance(value, BaseMessage):
            return {"__message__": self.walk(value.model_dump(), in_message=True)}
        if isinstance(value, Interrupt):
            return self.interrupt(value.value, value.id)
        if isinstance(value, Mapping):
            if len(value) == 1 and "__message__" in value:  # a message stored as data (see _serde)
                return {"__message__": self.walk(value["__message__"], in_message=True)}
            return {str(k): self.entry(k, v, in_message) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.walk(v, in_message) for v in value]
        if hasattr(value, "model_dump") and not isinstance(value, type):
            return self.walk(value.model_dump(), in_message)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):  # stored as its fields (see _serde)
            return self.walk({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, in_message)
        return value

    def entry(self, key: Any, value: Any, in_message: bool) -> Any:
        if in_message and key in _GENERATED_ID_KEYS and isinstance(value, str):
            return self.rename(value)
        if key == "__interrupt__" and isinstance(value, (list, tuple)):  # a run that stopped at interrupt()
            return [self.interrupt(i.get("value"), i.get("id")) if isinstance(i, Mapping) else self.walk(i, in_message)
                    for i in value]
        return self.walk(value, in_message)

    def interrupt(self, value: Any, interrupt_id: Any) -> dict[str, Any]:
        """An interrupt by value: its id hashes the task's checkpoint namespace, new on every thread."""
        return {"value": self.walk(value, False),
                "id": self.rename(interrupt_id) if isinstance(interrupt_id, str) else interrupt_id}


def _state_text(state: Any) -> str:
    return json.dumps(comparable(state), indent=1, sort_keys=True, default=repr, ensure_ascii=False)
