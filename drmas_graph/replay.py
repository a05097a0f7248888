"""Deterministic replay: re-run a graph with every LLM call answered from a recorded episode.

No model is loaded and nothing leaves the machine. Calls are matched by node instance (`call_key`: node
path, plus the `Send` index) and their order within it, never by global arrival order, so parallel
branches and `Send` fan-outs replay exactly. When the graph has changed, the first call whose prompt
differs from the recording (or that has no recording, or whose recording is never asked for) is reported
as a `Divergence` with a readable diff; replay then stops, or, with `policies=`, continues live.
"""

from __future__ import annotations

import difflib
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from drmas_graph._chat import ParsedResponse, _text, parse_hermes
from drmas_graph._intercept import ACTIVE_HANDLER, CallSite, install
from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.instrumented import InstrumentedGraph, _cut_at_stop, _EpisodeRecorder, served_message
from drmas_graph.instrumented import structured_parts
from drmas_graph.policy import Policy
from drmas_graph.types import Episode, Turn

__all__ = ["replay", "replay_episode", "ReplayResult", "Divergence", "render_prompt"]


@dataclass(frozen=True)
class Divergence:
    """Where the re-run stopped agreeing with the recording."""

    kind: Literal["prompt_changed", "tools_changed", "unrecorded_call", "missing_call"]
    """What differs: the prompt, the bound tools, a call the recording lacks, a recorded call never made."""
    agent: str
    """Agent of the call (from the recording when there is one)."""
    node: str
    """Node path of the call."""
    call_key: str
    """Node instance (node path, plus '[i]' for the i-th Send)."""
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
    """What the graph returned (None when replay stopped at a divergence)."""
    turns: list[Turn]
    """The calls of the re-run: recorded answers, then live ones after a divergence (with policies=)."""
    divergences: list[Divergence] = field(default_factory=list)
    """Every divergence found, first one first."""
    recorded: Episode | None = None
    """The episode that was replayed."""
    stopped: bool = False
    """True when replay stopped at the first divergence."""
    wall_s: float = 0.0
    """Time the re-run took."""

    @property
    def state_matches(self) -> bool:
        """The re-run returned the recorded final state (message ids that LangGraph draws at random ignored)."""
        return self.recorded is not None and comparable(self.final_state) == comparable(self.recorded.final_state)


class _StopReplay(DrmasError):
    pass


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


def _diff(recorded: str, new: str) -> str:
    return "\n".join(difflib.unified_diff(recorded.splitlines(), new.splitlines(), "recorded prompt", "new prompt",
                                          lineterm=""))


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
        self.turns: list[Turn] = []
        self._per_key: dict[str, int] = {}
        self._lock = threading.Lock()

    def _match(self, site: CallSite) -> Turn | None:
        """The recorded answer for this call, or None once the run has diverged (then the call goes live)."""
        with self._lock:
            n = self._per_key.get(site.call_key, 0)
            self._per_key[site.call_key] = n + 1
            if self.divergences:
                return None
            turn = self.by_key.get((site.call_key, n))
            new_prompt = render_prompt(site.messages, site.tools)
            if turn is None:
                d = Divergence("unrecorded_call", self.agent_of(site), site.node, site.call_key, n,
                               _diff("", new_prompt))
            elif render_prompt(turn.messages) != render_prompt(site.messages):
                d = Divergence("prompt_changed", turn.agent, site.node, site.call_key, n,
                               _diff(render_prompt(turn.messages, turn.tools), new_prompt))
            elif [t.get("function", t) for t in turn.tools] != [t.get("function", t) for t in site.tools]:
                d = Divergence("tools_changed", turn.agent, site.node, site.call_key, n,
                               _diff(render_prompt(turn.messages, turn.tools), new_prompt))
            else:
                self.used.add((site.call_key, n))
                self.turns.append(turn)
                return turn
            self.divergences.append(d)
        if not self.continue_live:
            raise _StopReplay(str(d))
        return None

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


def replay_episode(graph: Any, episode: Episode, *, policies: Mapping[str, Policy] | None = None,
                   agents: Mapping[str, str] | None = None, on_divergence: Literal["stop", "continue"] = "stop",
                   config: dict | None = None) -> ReplayResult:
    """Replay an in-memory `Episode` (see `replay`)."""
    if on_divergence not in ("stop", "continue"):
        raise ConfigError(f"on_divergence must be 'stop' or 'continue', got {on_divergence!r}")
    if on_divergence == "continue" and not policies:
        raise ConfigError("on_divergence='continue' needs policies= to serve the calls after the divergence")
    app = InstrumentedGraph(graph, policies or {}, agents=agents)
    install()
    live_episode = Episode(task_id=episode.task_id, group_id=episode.group_id, input=episode.input)
    live = _EpisodeRecorder(app, live_episode)
    handler = _ReplayHandler(episode, live, on_divergence == "continue",
                             lambda site: site.metadata.get("drmas_agent") or app.agent_for_node(site.node))
    config = dict(config or {})
    if getattr(app.graph, "checkpointer", None):  # a fresh thread, so replay never resumes the recorded one
        config.setdefault("configurable", {}).setdefault("thread_id", f"replay-{uuid.uuid4().hex}")
    token = ACTIVE_HANDLER.set(handler)
    start = time.perf_counter()
    final_state, stopped = None, False
    try:
        final_state = app.graph.invoke(episode.input, config or None)
    except Exception as exc:
        if not _caused_by(exc, _StopReplay):
            raise
        stopped = True
    finally:
        ACTIVE_HANDLER.reset(token)
    live.finish()
    if not stopped and not handler.divergences:
        handler.divergences.extend(handler.missing_calls())
    turns = handler.turns + live_episode.turns
    return ReplayResult(final_state=final_state, turns=turns, divergences=handler.divergences, recorded=episode,
                        stopped=stopped, wall_s=time.perf_counter() - start)


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
        on_divergence: 'stop' (default) returns at the first divergence; 'continue' goes on live.
    """
    from drmas_graph.store import TraceStore

    if isinstance(store_or_path, TraceStore):
        episode = store_or_path.load_episode(episode_id)
    else:
        with TraceStore(store_or_path, readonly=True) as store:
            episode = store.load_episode(episode_id)
    return replay_episode(graph, episode, policies=policies, agents=agents, on_divergence=on_divergence,
                          config=config)


def _caused_by(exc: BaseException, kind: type) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def comparable(value: Any) -> Any:
    """A JSON-like form of a graph state for equality: LangChain messages as dicts without their `id`
    (LangGraph's add_messages reducer draws ids at random for messages that have none)."""
    if isinstance(value, BaseMessage):
        data = value.model_dump()
        data.pop("id", None)
        return {"__message__": comparable(data)}
    if isinstance(value, Mapping):
        return {str(k): comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if hasattr(value, "model_dump"):
        return comparable(value.model_dump())
    return value
