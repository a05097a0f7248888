"""Deterministic replay: re-run a graph with every LLM call answered from a recorded episode.

No model is loaded and nothing leaves the machine. Calls are matched by node instance (`call_key`: node
path with the `Send` / `@task` call index of the call's task and of every enclosing task) and their order within it,
never by global arrival order, so parallel branches and `Send` fan-outs (into subgraphs too) replay
exactly; calls made concurrently inside one node instance are matched by prompt. When the graph has
changed, the first call whose request differs from the recording (its prompt, its tools, or the structured
output it asks for; or that has no recording, or whose recording is never asked for) is reported as a
`Divergence` with a readable diff; replay then stops (every later call stops too), or, with `policies=`,
continues live. Recorded and live values are compared in the trace store's form (`_compare`).

A truncated recording (a limit stopped it at an LLM call) stops the replay where the limit stopped it,
without a divergence. Which call the limit refused depends on timing when branches run in parallel, so
every call the recording lacks is refused as the limit refused it, and the verdict waits for the end of
the run: the limit refuses only calls made after every call it let through, so the truncation is
reproduced when every recorded call was asked for; otherwise the first refused call is the divergence.
(An async graph's other branches are cancelled by LangGraph when a call is refused; one cut before its
recorded call makes that call missing, and the replay reports the divergence.)

A run that raised is reproduced when the re-run raises the error the recording ended with (a model error,
a failure, the recursion limit): `ReplayResult.error` says how it raised, worded as `Episode.stop_reason`.
Another error, an error where the recording finished, or finishing where it raised, is an
`outcome_changed` divergence (a failed recording's error may come from outside the graph, a pause nobody
answered or a hang: a re-run that finishes it is not compared). An error scoring stored after the run (a
reward function that raised: 'BadRewardError: ...') is not how the run ended: the run is compared as it
ended (finished, truncated, a model error). Replay never lets an exception of the app escape (only its own
`ConfigError`s).

An episode that continued a checkpointed thread starts from the thread's recorded checkpoint, copied to a
new thread (`drmas_graph.instrumentation.replaying.fork_config`); when that checkpoint is not available the result says so
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
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.outputs import ChatResult
from langgraph.types import Command

from drmas_graph.env import BadRewardError
from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.instrumentation import replaying
from drmas_graph.instrumentation.instrumented import InstrumentedGraph
from drmas_graph.instrumentation.replaying import CallSite, EpisodeRecorder, install, note_stop
from drmas_graph.policy import Policy
from drmas_graph.traces import _serde
from drmas_graph.traces._answers import recorded_answer
from drmas_graph.traces._compare import Request, comparable, diff, interrupts_text, render_prompt, state_text
from drmas_graph.types import Episode, Segment, Turn

__all__ = ["replay", "areplay", "replay_episode", "areplay_episode", "ReplayResult", "Divergence", "render_prompt",
           "comparable", "AsyncOnlyGraphError"]


@dataclass(frozen=True)
class Divergence:
    """Where the re-run stopped agreeing with the recording."""

    kind: Literal["prompt_changed", "tools_changed", "format_changed", "sampling_changed", "unrecorded_call",
                  "missing_call", "interrupt_changed", "outcome_changed"]
    """What differs: the prompt, the bound tools, the structured output the call asks for (`response_format`,
    a forced `tool_choice`, its JSON schema: `Turn.response_format`), the stop strings or max_tokens the call
    passes (`Turn.call_sampling`; the diff names the parameter, old and new value), a call the recording
    lacks, a recorded call never made, the interrupts a run of the thread stopped at (then `call_index` is
    the run's `Segment` position), or how the run ended (`outcome_changed`: another error than the
    recording's, an error where it finished, or finished where it raised or a limit stopped it (a failed
    recording that the re-run finishes is not compared: its error may come from outside the graph; an error
    scoring stored after the run is not the run's); agent, node and call are those of the turn a model error
    names, else empty with `call_index` the run's `Segment` position)."""
    agent: str
    """Agent of the call (from the recording when there is one)."""
    node: str
    """Node path of the call."""
    call_key: str
    """Node instance: node path, '[i]' after each task that was the i-th Send (or @task call)."""
    call_index: int
    """Position of the call among the calls of that node instance."""
    diff: str
    """Unified diff of the recorded and the new prompt, tools, structured output and stop strings / max_tokens
    ('' for a missing call); of the interrupts or of the outcomes for those kinds."""

    def __str__(self) -> str:
        head = f"{self.kind} at agent {self.agent!r}, node {self.node!r}, call {self.call_key}#{self.call_index}"
        return head + (f"\n{self.diff}" if self.diff else "")


@dataclass
class ReplayResult:
    """Outcome of a replay."""

    final_state: Any
    """What the graph returned: the output of its last run that returned; of a run that raised, or that replay
    stopped, its state as of its last completed superstep (as the recording's `Episode.final_state`)."""
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
    error: str | None = None
    """How the re-run raised, worded as the recording's `Episode.stop_reason` (a model error names its turn);
    None when it returned or replay stopped it. Equal to the recording's: the error was reproduced."""

    @property
    def state_matches(self) -> bool:
        """The re-run returned the recorded final state, up to generated ids (see `comparable`)."""
        return self.recorded is not None and comparable(self.final_state) == comparable(self.recorded.final_state)

    @property
    def state_diff(self) -> str:
        """Unified diff of the recorded and the new final state (generated ids renumbered); '' when equal."""
        if self.recorded is None or self.state_matches:
            return ""
        return diff(state_text(self.recorded.final_state), state_text(self.final_state),
                    "recorded final state", "new final state")


class _StopReplay(DrmasError):
    pass


class AsyncOnlyGraphError(ConfigError):
    """`replay` was given a graph with async-only nodes: use `areplay`."""


class _ReplayHandler:
    """CallHandler that answers each call from the recording while the calls' requests agree."""

    offline = True
    """Replay never sends a request: an LLM API request it cannot answer is refused (`instrumentation._http`)."""

    def __init__(self, recorded: Episode, live: EpisodeRecorder | None, continue_live: bool,
                 agent_of: Callable[[CallSite], str]) -> None:
        self.by_key = {(t.call_key, t.node_call_index): t for t in recorded.turns}
        self.requests = {key: Request.of_turn(t) for key, t in self.by_key.items()}
        self.used: set[tuple[str, int]] = set()
        self.live = live
        self.continue_live = continue_live
        self.agent_of = agent_of
        self.divergences: list[Divergence] = []
        self.truncated = recorded.truncated
        self.refused: list[Divergence] = []
        """Calls a truncated recording lacks, refused as its limit refused them; each would be a divergence
        if the recording turns out not to be used up (`settle`)."""
        self.turns: list[Turn] = []
        self.stopping = False
        """The handler refused a call to stop the replay: the run's error then is that stop, whatever form a
        client gave it (the local endpoint answers the stop as an HTTP 500, which its client raises afresh)."""
        self._per_key: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def ended(self) -> bool:
        """The re-run reached a call where the limit stopped the truncated recording."""
        return bool(self.refused)

    def _match(self, site: CallSite) -> Turn | None:
        """The recorded answer for this call; None once the run has diverged and continues live. In stop
        mode every call after the first divergence stops (none reaches a model)."""
        request = Request.of_call(site)
        with self._lock:
            n = self._per_key.get(site.call_key, 0)
            self._per_key[site.call_key] = n + 1
            if self.divergences:
                if self.continue_live:
                    return None
                raise self._stop(f"replay stopped at the first divergence: {self.divergences[0]}")
            turn = self._same_call(site, n, request)
            if turn is not None:
                self.used.add((turn.call_key, turn.node_call_index))
                self.turns.append(turn)
                return turn
            d = self._divergence(site, n, request)
            if self.truncated:  # maybe where the limit stopped the recording: `settle` decides at the end
                self.refused.append(d)
                if self.continue_live:
                    return None
                raise self._stop(f"the recording ends here, where a limit stopped it: {self.truncated}")
            self.divergences.append(d)
        if not self.continue_live:
            raise self._stop(str(d))
        return None

    def _stop(self, message: str) -> _StopReplay:
        self.stopping = True
        return _StopReplay(message)

    def settle(self) -> None:
        """Once the run is over: the limit let every recorded call through before it refused one, so calls
        refused as the limit's reproduce the truncation only if every recorded call was asked for; if not,
        the first of them is the divergence."""
        with self._lock:
            if self.refused and not self.divergences and len(self.used) < len(self.by_key):
                self.divergences.append(self.refused[0])

    def _candidates(self, key: str, n: int) -> list[Turn]:
        """The unused recorded calls of a node instance, its n-th first (concurrent calls arrive in any order)."""
        unused = [t for (k, i), t in sorted(self.by_key.items(), key=lambda kv: kv[0][1])
                  if k == key and (k, i) not in self.used]
        return sorted(unused, key=lambda t: t.node_call_index != n)

    def _live(self, site: CallSite, request: Request, turn: Turn) -> Request:
        """The live request as it compares with `turn`: with its structured output if a policy served the turn,
        without its stop strings and max_tokens if the turn predates their recording (`Turn.call_sampling`)."""
        live = request.with_format(site, turn.agent) if turn.trainable else request
        return live if turn.call_sampling is not None else live.without_sampling()

    def _same_call(self, site: CallSite, n: int, request: Request) -> Turn | None:
        """The n-th recorded call of this node instance if its request is the same; else an unused recorded
        call of the instance whose request is."""
        return next((t for t in self._candidates(site.call_key, n)
                     if self._live(site, request, t) == self.requests[(t.call_key, t.node_call_index)]), None)

    def _divergence(self, site: CallSite, n: int, request: Request) -> Divergence:
        """Against the unused recorded call of the node instance that is closest (the same prompt, then the
        same tools; the n-th among equals): concurrent calls of one node arrive in any order, so a changed
        schema is reported as `format_changed` against the call with the same prompt."""
        candidates = self._candidates(site.call_key, n)
        if not candidates:
            return Divergence("unrecorded_call", self.agent_of(site), site.node, site.call_key, n,
                              diff("", request.text()))

        def distance(t: Turn) -> tuple[bool, bool]:
            recorded = self.requests[(t.call_key, t.node_call_index)]
            return request.prompt != recorded.prompt, request.tools != recorded.tools

        turn = min(candidates, key=distance)
        live, recorded = self._live(site, request, turn), self.requests[(turn.call_key, turn.node_call_index)]
        shown = live.set_sampling(recorded)  # a parameter either side set: named on both sides, old and new
        return Divergence(live.changed(recorded), turn.agent, site.node, site.call_key, turn.node_call_index,
                          diff(recorded.text(shown), live.text(shown)))

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        turn = self._match(site)
        if turn is None:
            return self.live.handle(site, _no_original(site))
        return recorded_answer(turn, site)

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        turn = self._match(site)
        if turn is None:
            return await self.live.ahandle(site, _no_original(site))
        return recorded_answer(turn, site)

    def missing_calls(self) -> list[Divergence]:
        return [Divergence("missing_call", t.agent, t.node, t.call_key, t.node_call_index, "")
                for key, t in sorted(self.by_key.items(), key=lambda kv: kv[1].index) if key not in self.used]


def _no_original(site: CallSite) -> Callable[[], Any]:
    def refuse() -> Any:
        raise ConfigError(f"replay continued live at node {site.node!r}, but no policy serves its agent; pass "
                          "policies= covering every agent that acts after the divergence")
    return refuse


@dataclass
class _Run:
    """One replay in progress: what `replay_episode` and `areplay_episode` share."""

    app: InstrumentedGraph
    handler: _ReplayHandler
    live: EpisodeRecorder
    live_episode: Episode
    config: dict | None
    unreproducible: str | None = None
    start: float = 0.0
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of every run: the recorded `context=`."""


def _prepare(graph: Any, episode: Episode, policies: Mapping[str, Policy] | None, agents: Mapping[str, str] | None,
             on_divergence: str, config: dict | None) -> _Run:
    if on_divergence not in ("stop", "continue"):
        raise ConfigError(f"on_divergence must be 'stop' or 'continue', got {on_divergence!r}")
    if on_divergence == "continue" and not policies:
        raise ConfigError("on_divergence='continue' needs policies= to serve the calls after the divergence")
    app = InstrumentedGraph(graph, policies or {}, agents=agents)
    install()
    live_episode = Episode(task_id=episode.task_id, group_id=episode.group_id, input=episode.input)
    live = EpisodeRecorder(app, live_episode)
    handler = _ReplayHandler(episode, live, on_divergence == "continue", app.agent_of)
    config = replaying.replay_config(episode.metadata.get("run_config"), config)  # the recorded configurable values
    kwargs = {"context": episode.metadata["context"]} if episode.metadata.get("context") is not None else {}
    return _Run(app, handler, live, live_episode, config, _unstorable_input(episode), kwargs=kwargs)


def _own_thread(run: _Run) -> bool:
    """The caller named the thread to replay on (then no copy of the recorded start is made)."""
    return "thread_id" in (run.config.get("configurable") or {})


def _thread_config(run: _Run, forked: dict | None, reason: str | None) -> None:
    """Run on the copy of the recorded thread start, else on a fresh thread (never the recorded one)."""
    run.unreproducible = run.unreproducible or reason
    if replaying.checkpointer(run.app.graph) is not None and not _own_thread(run):
        configurable = run.config.setdefault("configurable", {})
        configurable.pop("checkpoint_id", None)
        configurable.update(forked or {"thread_id": f"replay-{uuid.uuid4().hex}"})  # addressed as recorded


def _finish(run: _Run, episode: Episode, outcome: _Outcome, segment: int) -> ReplayResult:
    run.live.finish()
    handler = run.handler
    handler.settle()
    cut = bool(handler.divergences) and not handler.continue_live  # replay stopped the run at a divergence
    stopped = outcome.stopped or cut or (handler.ended and not handler.continue_live)
    error, error_turn = _stop_reason(run, episode, outcome.error) if outcome.error is not None else (None, None)
    if not cut:
        handler.divergences.extend(_outcome_changed(episode, error or (episode.truncated if handler.ended else None),
                                                    error_turn, segment))
    if not stopped and not handler.divergences:
        handler.divergences.extend(handler.missing_calls())
    return ReplayResult(final_state=outcome.final_state, turns=handler.turns + run.live_episode.turns,
                        divergences=handler.divergences, recorded=episode, stopped=stopped,
                        wall_s=time.perf_counter() - run.start, unreproducible=run.unreproducible, error=error)


def _stop_reason(run: _Run, episode: Episode, exc: BaseException) -> tuple[str | None, Turn | None]:
    """How the recording words a run that raised `exc` (`_outcomes.note_stop` on the re-run's calls, in
    recorded order), and the turn a model error names."""
    turns = sorted(run.handler.turns, key=lambda t: t.index) + run.live_episode.turns
    rerun = Episode(id=episode.id, task_id=episode.task_id, turns=turns)
    note_stop(rerun, exc)
    return rerun.stop_reason, None if rerun.model_error_turn is None else turns[rerun.model_error_turn]


def _outcome_changed(episode: Episode, new: str | None, new_turn: Turn | None, segment: int) -> list[Divergence]:
    """[] when the re-run ended as the recording did (`new`: how it stopped, None when it finished; the
    recording's error is the run's own, `_run_error`), else the `outcome_changed` divergence. A failed
    recording that the re-run finishes is not one: its error may come from outside the graph (a pause nobody
    answered, a hang, a policy's backend)."""
    error = _run_error(episode)
    recorded = error or episode.truncated or episode.model_error
    if new in (recorded, episode.stop_reason) or (new is None and error is not None):
        return []
    turn = new_turn or (None if episode.model_error_turn is None else episode.turns[episode.model_error_turn])
    where = (turn.agent, turn.node, turn.call_key, turn.node_call_index) if turn else ("", "", "", segment)
    return [Divergence("outcome_changed", *where, diff(recorded or "finished", new or "finished",
                                                       "recorded outcome", "new outcome"))]


_SCORING_ERROR = f"{BadRewardError.__name__}: "
"""How scoring words the error it stores for an episode whose reward failed (`Unscored.message`)."""


def _run_error(episode: Episode) -> str | None:
    """The error the recorded run ended with (`Episode.error`), None when it did not fail. An error scoring
    stored after the run (a reward function or judge that failed: 'BadRewardError: ...') is not how the run
    ended: a finished, truncated or model-error run whose reward failed is compared as that run."""
    scoring = episode.error is not None and episode.error.startswith(_SCORING_ERROR)
    return None if scoring else episode.error


@dataclass
class _Outcome:
    final_state: Any = None
    """The output of the last run that returned; of a run that raised (or that replay stopped), its state as of its
    last completed superstep, as the recording keeps it (`replaying.invoke_by_supersteps`)."""
    stopped: bool = False
    """True when the replay stopped the run (a divergence in stop mode, where a limit stopped the recording)."""
    error: Exception | None = None
    """What the app raised (a model error, a failure, the recursion limit): compared with the recording."""

    def keep(self, state: Any) -> None:
        self.final_state = state


@contextlib.contextmanager
def _serving(run: Any) -> Iterator[_Outcome]:
    """The block runs the graph with the replay handler answering its calls; the replay's own stop ends the
    block quietly (`outcome.stopped`), so does any exception of the app (`outcome.error`); replay's own
    `ConfigError`s (no policy to continue live, async-only nodes) propagate."""
    outcome = _Outcome()
    token = replaying.start_replay(run.handler)  # (the endpoint's URLs made in the replay work until the end)
    run.start = time.perf_counter()
    try:
        yield outcome
    except Exception as exc:
        if _stopped(exc) or run.handler.stopping:  # (a client's own error for the stop: the local endpoint's)
            outcome.stopped = True
        elif isinstance(exc, ConfigError):
            raise
        else:
            outcome.error = exc
    finally:
        replaying.end_replay(run.handler, token)


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
    """The recorded runs of an episode (`Episode.segments`), fed to the replay one after another. An episode
    without segments ran once and did not end paused: one run that stopped at no interrupt, so a replayed run
    that stops at one diverges (`interrupt_changed`)."""

    def __init__(self, run: _Run, episode: Episode) -> None:
        self.run, self.segments, self.k = run, episode.segments or [Segment("start")], 0
        if len(self.segments) > 1 and replaying.checkpointer(run.app.graph) is None:
            raise ConfigError(f"episode {episode.id} is {len(self.segments)} runs of one thread (interrupts answered "
                              "or a conversation continued); replaying it needs the graph compiled with a "
                              "checkpointer (e.g. compile(checkpointer=InMemorySaver()))")

    def after(self, pending: Any) -> Any:
        """The input of the next run once run k stopped at `pending`; `_END` when the replay is done."""
        recorded = self.segments[self.k]
        live = pending.records if pending is not None else []
        if interrupts_text(recorded.interrupts) != interrupts_text(live):
            d = Divergence("interrupt_changed", "", (list(recorded.interrupts) or live or [{"node": ""}])[0]["node"],
                           "", self.k, diff(interrupts_text(recorded.interrupts), interrupts_text(live),
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
    _thread_config(run, *replaying.fork_config(run.app.graph, start))
    with _serving(run) as outcome:
        outcome.final_state = replaying.invoke_by_supersteps(run.app.runnable, episode.input, run.config or None,
                                                             outcome.keep, **run.kwargs)
        thread = replaying.latest(run.config)  # later runs continue the thread's latest checkpoint
        while True:
            nxt = runs.after(replaying.pending_interrupts(run.app.graph, thread, outcome.final_state))
            if nxt is _END:
                break
            outcome.final_state = replaying.invoke_by_supersteps(run.app.runnable, nxt, thread, outcome.keep, **run.kwargs)
    return _finish(run, episode, outcome, runs.k)


async def areplay_episode(graph: Any, episode: Episode, *, policies: Mapping[str, Policy] | None = None,
                          agents: Mapping[str, str] | None = None,
                          on_divergence: Literal["stop", "continue"] = "stop", config: dict | None = None
                          ) -> ReplayResult:
    """`replay_episode` through the graph's async API (`ainvoke`): for graphs with async-only nodes."""
    run = _prepare(graph, episode, policies, agents, on_divergence, config)
    runs = _Runs(run, episode)
    start = None if _own_thread(run) else episode.metadata.get("thread_start")
    _thread_config(run, *await replaying.afork_config(run.app.graph, start))
    with _serving(run) as outcome:
        outcome.final_state = await replaying.ainvoke_by_supersteps(run.app.runnable, episode.input,
                                                                    run.config or None, outcome.keep, **run.kwargs)
        thread = replaying.latest(run.config)  # later runs continue the thread's latest checkpoint
        while True:
            nxt = runs.after(await replaying.apending_interrupts(run.app.graph, thread, outcome.final_state))
            if nxt is _END:
                break
            outcome.final_state = await replaying.ainvoke_by_supersteps(run.app.runnable, nxt, thread, outcome.keep,
                                                                        **run.kwargs)
    return _finish(run, episode, outcome, runs.k)


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
        config: the run config (e.g. `recursion_limit`), over the one the episode recorded (its
            `configurable` values and `recursion_limit`; the recorded `context=` is passed again too). A graph
            with a checkpointer runs on a new thread
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
    """Why a stored input cannot be replayed (a value with no JSON form, stored as its repr): the episode's
    input, or the input of a later run (`Segment.input`)."""
    inputs = [("the episode's input", episode.input)]
    inputs += [(f"the input of run {k} ({s.kind})", s.input) for k, s in enumerate(episode.segments) if k > 0]
    for what, value in inputs:
        if '"__unserializable__"' in _serde.to_json(value, what):
            return f"{what} had no JSON form and was stored as its repr; replay ran on that repr"
    return None


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
