"""`instrument(graph, policies)`: serve every node's LLM calls from trainable policies and record them.

The graph is not modified. Each run (`invoke`, `stream`, `rollout`, ...) installs an `_EpisodeRecorder`
in a context variable (see `_intercept`); every chat-model call made inside the run is attributed to an
agent (`drmas_agent` run metadata > `agent:<name>` entry of `agents` > first matching node glob > node path,
see `_routing`), rendered with that agent's policy's chat template, generated, parsed back into an
`AIMessage`, and recorded as a `Turn`. `rollout` runs the thread again while the caller answers interrupts
or continues a conversation (`_segments`).

`InstrumentedGraph` is a LangChain `Runnable`: every way of running it (`with_config`, `with_retry`,
`with_listeners`, `batch`, `astream_events`, `astream_log`, `|` ...) ends in its own `invoke`/`ainvoke`/
`stream`/`astream`, so each run is an instrumented episode. Only read-only attributes of the graph are
forwarded (`get_state`, `get_graph`, `nodes`, ...); `app.graph` is the uninstrumented graph.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.outputs import ChatResult
from langchain_core.runnables import Runnable

from drmas_graph.instrumentation import _threads
from drmas_graph.instrumentation._intercept import ACTIVE_HANDLER, CallSite, app_models, register_run, unregister_run
from drmas_graph.instrumentation._http import install
from drmas_graph.instrumentation._limits import Backstop
from drmas_graph.instrumentation._outcomes import note_stop
from drmas_graph.instrumentation._routing import AgentRouter, under_node
from drmas_graph.instrumentation._streams import StreamFold
from drmas_graph.instrumentation._segments import (
    DEFAULT_MAX_RESUMES,
    Continuation,
    EpisodeInterruptedError,
    SegmentRunner,
)
from drmas_graph.instrumentation._recorder import _cut_at_stop, _EpisodeRecorder, served_message, structured_parts  # noqa: F401
from drmas_graph.instrumentation._recorder import _Recorder
from drmas_graph.errors import (
    ConfigError,
    NoLLMCallError,
    RolloutError,
    StrictModeError,
    UnservedCallWarning,
)
from drmas_graph.policy import Policy
from drmas_graph.types import Episode, SamplingParams

__all__ = ["instrument", "InstrumentedGraph", "app_models", "served_message",
           "structured_parts"]


def instrument(graph: Any = None, policies: Mapping[str, Policy] | None = None, *,
               agents: Mapping[str, str] | None = None, strict: bool = False, store: Any = None) -> Any:
    """Route a LangGraph app's LLM calls to trainable policies and record them per agent.

    Args:
        graph: a compiled LangGraph graph, or a `StateGraph` builder (compiled here). Omit it to use
            `instrument` as a decorator on a function that builds and returns the graph.
        policies: agent name -> Policy. One Policy object may serve several agents (a shared model);
            distinct policies need distinct names. An agent that is no node path is reached by calls
            carrying `with_config(metadata={"drmas_agent": name})` (a warning after the first episode
            if it never acted).
        agents: node-path glob -> agent name (first match wins), e.g. {"research/*": "researcher"}, and
            "agent:<glob>" -> agent name over LangChain agent names (`create_agent(name=...)`, Deep Agents
            sub-agents), e.g. {"agent:calculator": "calc"}, which go before node globs. Without a match the
            agent is the node path itself ('outer/inner' inside subgraphs). See `_routing`.
        strict: raise `StrictModeError` when a call's agent has no policy, or when a call made while this
            run is active cannot be attributed to it (a plain thread); the episode fails even if the app
            catches the error. Default: the app's own model answers (the turn is recorded as
            non-trainable; an unattributable call warns with `UnservedCallWarning`).
        store: a `TraceStore`; every finished episode (ok or failed) is written to it.
    """
    if policies is None:
        raise ConfigError("instrument() needs policies={agent name: Policy}")
    if graph is None:
        def decorator(factory: Callable[..., Any]) -> Callable[..., InstrumentedGraph]:
            @functools.wraps(factory)
            def build(*args: Any, **kwargs: Any) -> InstrumentedGraph:
                return InstrumentedGraph(factory(*args, **kwargs), policies, agents=agents, strict=strict,
                                         store=store)
            return build
        return decorator
    return InstrumentedGraph(graph, policies, agents=agents, strict=strict, store=store)


def graph_node_paths(graph: Any) -> list[str]:
    """Node paths of a compiled graph, subgraph nodes as 'outer/inner' (LangGraph's xray view)."""
    try:
        ids = list(graph.get_graph(xray=True).nodes)
    except Exception:  # noqa: BLE001 - a graph that cannot draw itself still has top-level nodes
        ids = list(getattr(graph, "nodes", {}))
    paths = [i.replace(":", "/") for i in ids]
    return [p for p in paths if p.rsplit("/", 1)[-1] not in ("__start__", "__end__")]


_READ_ONLY = frozenset({
    "get_state", "aget_state", "get_state_history", "aget_state_history", "get_subgraphs", "aget_subgraphs",
    "aget_graph", "nodes", "channels", "builder", "checkpointer", "store", "cache", "stream_mode", "stream_eager",
    "stream_channels", "output_channels", "input_channels", "interrupt_before_nodes", "interrupt_after_nodes",
    "debug", "config", "step_timeout", "retry_policy", "cache_policy", "context_schema", "trigger_to_nodes",
    "get_context_jsonschema", "stream_channels_list", "stream_channels_asis", "name",
})
"""Graph attributes an InstrumentedGraph forwards: they read the graph or its checkpoints and run no node."""


def check_unique_policy_names(policies: Mapping[str, Any]) -> None:
    """Two distinct policy objects must not share a name: names key traces (`Turn.policy`), checkpoints and
    the trainer's models, so the second would silently stand for the first."""
    seen: dict[str, tuple[str, Any]] = {}
    for agent, policy in policies.items():
        first = seen.setdefault(getattr(policy, "name", None), (agent, policy))
        if first[1] is not policy:
            raise ConfigError(
                f"policies[{first[0]!r}] and policies[{agent!r}] are two different policy objects with the same name "
                f"{policy.name!r}; policy names key traces, checkpoints and trained models, so they must be unique. "
                f"Name each one (e.g. TransformersPolicy.from_pretrained(path, name={agent!r})), or pass the same "
                "object for both agents to share one model.")


class InstrumentedGraph(Runnable):
    """A compiled graph whose LLM calls are served by policies. A LangChain Runnable with the graph's run
    methods (every one records an episode: `invoke`, `stream`, `batch`, `with_config(...)`, `with_retry()`,
    `astream_events`, ...), plus `rollout`/`arollout`, which return the run as an `Episode`. Read-only
    attributes pass through to the graph (`get_state`, `get_graph`, `nodes`, ...); `.graph` is the graph."""

    def __init__(self, graph: Any, policies: Mapping[str, Policy], *, agents: Mapping[str, str] | None = None,
                 strict: bool = False, store: Any = None) -> None:
        if not hasattr(graph, "invoke") and hasattr(graph, "compile"):
            graph = graph.compile()
        if not hasattr(graph, "invoke") or not hasattr(graph, "get_graph"):
            raise ConfigError(f"instrument() needs a compiled LangGraph graph or a StateGraph, got {type(graph).__name__}")
        self.graph = graph
        self.runnable = _uncached(graph)
        """What every instrumented run (and replay) executes: `graph` with LangGraph's node cache off, so that
        a node with a `CachePolicy` is never served another episode's sampled reply."""
        self.policies: dict[str, Policy] = dict(policies)
        self.agents: dict[str, str] = dict(agents or {})
        self.strict = strict
        self.store = store
        self.nodes: list[str] = graph_node_paths(graph)
        self.sampling: dict[str, SamplingParams] = {}
        """Per-agent sampling overrides; an agent without one uses its policy's `sampling`."""
        self._unbound: set[str] = set()
        """Agents named in `policies` that no node path or `agents` entry leads to (only `drmas_agent` can)."""
        self._first_episode_checked = False
        self._validate()
        install()

    def __getattr__(self, name: str) -> Any:
        if name in _READ_ONLY and "graph" in self.__dict__:
            return getattr(self.graph, name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}: it forwards only read-only graph attributes "
            f"({', '.join(sorted(_READ_ONLY))}), so that nothing runs the graph outside the instrumentation. "
            f"Use app.graph.{name} to reach the uninstrumented graph on purpose.")

    def __repr__(self) -> str:
        return f"InstrumentedGraph(agents={sorted(self.policies)}, nodes={self.nodes})"

    # ---- the graph's introspection (Runnable defines these for itself; here they describe the graph) ----
    def get_graph(self, *args: Any, **kwargs: Any) -> Any:
        return self.graph.get_graph(*args, **kwargs)

    def get_name(self, *args: Any, **kwargs: Any) -> str:
        return self.graph.get_name(*args, **kwargs)

    @property
    def InputType(self) -> Any:  # noqa: N802 - LangChain's name
        return self.graph.InputType

    @property
    def OutputType(self) -> Any:  # noqa: N802 - LangChain's name
        return self.graph.OutputType

    @property
    def input_schema(self) -> Any:
        return self.graph.input_schema

    @property
    def output_schema(self) -> Any:
        return self.graph.output_schema

    @property
    def config_specs(self) -> Any:
        return self.graph.config_specs

    def get_input_schema(self, config: Any = None) -> Any:
        return self.graph.get_input_schema(config)

    def get_output_schema(self, config: Any = None) -> Any:
        return self.graph.get_output_schema(config)

    def get_input_jsonschema(self, config: Any = None) -> Any:
        return self.graph.get_input_jsonschema(config)

    def get_output_jsonschema(self, config: Any = None) -> Any:
        return self.graph.get_output_jsonschema(config)

    def config_schema(self, *, include: Sequence[str] | None = None) -> Any:
        return self.graph.config_schema(include=include)

    def get_config_jsonschema(self, *, include: Sequence[str] | None = None) -> Any:
        return self.graph.get_config_jsonschema(include=include)

    # ---- validation and routing -------------------------------------------------------------
    def _validate(self) -> None:
        self.router = AgentRouter(self.agents, self.nodes)  # refuses a glob that can match no node path
        for name, policy in self.policies.items():
            if not isinstance(policy, Policy):
                raise ConfigError(f"policies[{name!r}] is a {type(policy).__name__}, not a drmas_graph Policy; "
                                  "wrap the model, e.g. TransformersPolicy.from_pretrained(path)")
        check_unique_policy_names(self.policies)
        known = set(self.nodes) | set(self.agents.values())
        self._unbound = {name for name in self.policies
                         if name not in known and not any(under_node(n, name) for n in self.nodes)}

    def agent_for_node(self, node: str) -> str:
        """The agent of calls made by `node` outside any named agent (without a `drmas_agent` override)."""
        return self.router.agent_of({}, node)

    def agent_of(self, site: CallSite) -> str:
        """The agent of a call: `drmas_agent` metadata > `agent:<name>` entries > node-path globs > node path."""
        return self.router.agent_of(site.metadata, site.node)

    def _route(self, site: CallSite) -> tuple[str, Policy | None]:
        agent = self.agent_of(site)
        policy = self.policies.get(agent)
        if policy is None and self.strict:
            raise StrictModeError(
                f"node {site.node or '<outside any node>'!r} made an LLM call for agent {agent!r}, which has no "
                f"policy (strict=True); known agents: {sorted(self.policies)}. Add it to policies= or map the "
                "node to a known agent with agents=.")
        return agent, policy

    def _sampling_for(self, agent: str, policy: Policy, stop: Sequence[str] | None) -> SamplingParams:
        params = self.sampling.get(agent, policy.sampling)
        if stop:
            params = params.replace(stop=tuple(params.stop) + tuple(s for s in stop if s not in params.stop))
        return params

    def _check_unbound(self, episode: Episode) -> None:
        """After the first episode: warn about agents that only `drmas_agent` metadata could reach and that
        did not act, and about `agents` entries that only a run could check and that matched no call (a typo
        in `policies=` or `agents=` shows up here)."""
        if self._first_episode_checked:
            return
        self._first_episode_checked = True
        idle = sorted(self._unbound - set(episode.agents))
        if idle:
            warnings.warn(
                f"policies: agent(s) {idle} made no LLM call in the first episode. They are neither node paths "
                f"(nodes: {self.nodes}) nor mapped by agents=, so only calls carrying "
                "with_config(metadata={'drmas_agent': <name>}) reach them; check the names.", UserWarning,
                stacklevel=4)
        unmatched = self.router.unmatched()
        if unmatched:
            warnings.warn(
                f"agents: {unmatched} matched no LLM call in the first episode; calls came from node paths "
                f"{sorted({t.node for t in episode.turns})} and LangChain agent names "
                f"{sorted(self.router.names_seen)}; check the patterns.", UserWarning, stacklevel=4)

    # ---- running ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _recording(self, episode: Episode) -> Iterator[_Recorder]:
        recorder = _Recorder(self, episode)
        token = ACTIVE_HANDLER.set(recorder)
        register_run(recorder)
        episode._start_clock()
        try:
            yield recorder
            _raise_swallowed_refusal(recorder)
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ACTIVE_HANDLER.reset(token)
            unregister_run(recorder)
            recorder.finish()

    def _finish(self, episode: Episode, output: Any, *, require_calls: bool) -> Episode:
        episode.final_state = output
        if require_calls and not episode.turns:
            episode.error = "NoLLMCallError: the run made no LLM call"
        self._write(episode)
        if episode.error and require_calls:
            raise NoLLMCallError(
                f"episode {episode.id} (task {episode.task_id}) made no LLM call: no node called a LangChain "
                f"chat model inside this run (nodes: {self.nodes}); there is nothing to train on", episode)
        return episode

    def _failed(self, episode: Episode, exc: BaseException) -> RolloutError:
        note_stop(episode, exc)  # truncated by a limit, a model error, or failed (`_outcomes`)
        self._write(episode)
        verb = "failed" if episode.error else "stopped"
        kind = EpisodeInterruptedError if isinstance(exc, EpisodeInterruptedError) else RolloutError
        return kind(f"episode {episode.id} (task {episode.task_id}) {verb} after {len(episode.turns)} LLM "
                    f"call(s): {episode.stop_reason}", episode)

    def _write(self, episode: Episode) -> None:
        if self.store is not None:
            self.store.write_episode(episode)
        self._check_unbound(episode)

    def _new_episode(self, input: Any, config: Any, task_id: str | None, group_id: str | None,
                     metadata: dict[str, Any] | None = None, *, start: Any = _threads.LOOK_UP,
                     context: Any = None) -> Episode:
        thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
        metadata = dict(metadata or {})
        if thread_id is not None:
            metadata["thread_id"] = thread_id
        run_config = _threads.recorded_config(config)  # configurable values replay runs with again
        if run_config is not None:
            metadata["run_config"] = run_config
        if context is not None:  # LangGraph's `context=` (Runtime.context), stored in its JSON form
            metadata["context"] = context
        if start is _threads.LOOK_UP:  # the thread checkpoint replay starts from (async runs pass it)
            start = _threads.thread_start(self.graph, config)
        if start is not None:
            metadata["thread_start"] = start
        return Episode(task_id=task_id, group_id=group_id, input=input, metadata=metadata)

    def rollout(self, input: Any, config: Any = None, *, task_id: str | None = None,
                group_id: str | None = None, metadata: dict[str, Any] | None = None,
                resume: Callable[[Episode, list[Any]], Any] | None = None,
                next_input: Callable[[Episode], Any] | None = None,
                max_resumes: int = DEFAULT_MAX_RESUMES, context: Any = None) -> Episode:
        """Run the graph once and return the run as an Episode (final_state = what invoke returns).

        A graph that stops at `interrupt()` is resumed on the same thread with `Command(resume=...)` while
        `resume(episode, interrupts)` answers; after a run that finished, `next_input(episode)` may continue
        the thread with the next user input (a conversation). All runs are one episode, at most
        `max_resumes` after the first (see `_segments`).

        Raises `RolloutError` (with `.episode`, also written to the store) if the graph raises (or refused a
        call in strict mode, even if the app caught that error), `EpisodeInterruptedError` (a RolloutError)
        if it is left paused at an interrupt, and `NoLLMCallError` if the run made no LLM call. `metadata` is
        stored with the episode; so are the config's `configurable` values and `context` (LangGraph's
        `Runtime.context`, passed to every run of the thread), which replay runs with again.
        """
        continuation = Continuation(resume, next_input, max_resumes)
        SegmentRunner.check(self.graph, config, continuation)
        episode = self._new_episode(input, config, task_id, group_id, metadata, context=context)
        try:
            with self._recording(episode) as recorder:
                output = SegmentRunner(self.runnable, episode, recorder, config, continuation, context).run(input)
        except Exception as exc:
            raise self._failed(episode, exc) from exc
        return self._finish(episode, output, require_calls=True)

    async def arollout(self, input: Any, config: Any = None, *, task_id: str | None = None,
                       group_id: str | None = None, metadata: dict[str, Any] | None = None,
                       resume: Callable[[Episode, list[Any]], Any] | None = None,
                       next_input: Callable[[Episode], Any] | None = None,
                       max_resumes: int = DEFAULT_MAX_RESUMES, context: Any = None) -> Episode:
        """Async `rollout`: many can run concurrently in one event loop without cross-talk. The hooks may be
        `async def`; sync ones run in worker threads."""
        continuation = Continuation(resume, next_input, max_resumes)
        SegmentRunner.check(self.graph, config, continuation)
        episode = self._new_episode(input, config, task_id, group_id, metadata,
                                    start=await _threads.athread_start(self.graph, config), context=context)
        recorder = None
        try:
            with self._recording(episode) as recorder:
                output = await SegmentRunner(self.runnable, episode, recorder, config, continuation, context).arun(input)
        except Exception as exc:
            raise self._failed(episode, exc) from exc
        except asyncio.CancelledError as exc:  # stored with its turns so far and the reason
            backstop = next((a for a in exc.args if isinstance(a, Backstop)), None)
            if backstop is None or recorder is None:
                self._write(episode)
                raise
            stop = backstop.stop(episode, recorder.in_llm_call)  # the trainer's backstop: truncated, or stuck
            self._write(episode)
            asyncio.current_task().uncancel()  # the cancel is answered by the episode's outcome
            raise stop from None
        return self._finish(episode, output, require_calls=True)

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        episode = self._new_episode(input, config, None, None, context=kwargs.get("context"))
        try:
            with self._recording(episode):
                output = self.runnable.invoke(input, config, **kwargs)
        except Exception as exc:
            note_stop(episode, exc)
            self._write(episode)
            raise
        self._finish(episode, output, require_calls=False)
        return output

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        episode = self._new_episode(input, config, None, None, start=await _threads.athread_start(self.graph, config),
                                    context=kwargs.get("context"))
        try:
            with self._recording(episode):
                output = await self.runnable.ainvoke(input, config, **kwargs)
        except Exception as exc:
            note_stop(episode, exc)
            self._write(episode)
            raise
        self._finish(episode, output, require_calls=False)
        return output

    def _episode_context(self, input: Any, config: Any, context: Any) -> tuple[Episode, _EpisodeRecorder,
                                                                               contextvars.Context]:
        """A new episode, its recorder, and a context in which the recorder is the active handler."""
        episode = self._new_episode(input, config, None, None, context=context)
        recorder = _EpisodeRecorder(self, episode)
        ctx = contextvars.copy_context()
        ctx.run(ACTIVE_HANDLER.set, recorder)
        register_run(recorder)
        episode._start_clock()
        return episode, recorder, ctx

    def _end_stream(self, episode: Episode, recorder: _EpisodeRecorder, cancelled: bool) -> None:
        """A stream its consumer closed early is no episode (the run did not finish): nothing is stored."""
        unregister_run(recorder)
        recorder.finish()
        if cancelled:
            episode.error = "cancelled: the consumer closed the stream before the run finished"
        else:
            self._write(episode)

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        """The graph's `stream`, recorded as one episode. Each step runs in the episode's own context; the
        episode's final_state is what `invoke` would have returned (`_streams`). Closing the stream early (a
        `break`) cancels the run; no episode is stored for it."""
        episode, recorder, ctx = self._episode_context(input, config, kwargs.get("context"))
        fold = StreamFold(self.graph, kwargs)  # the run's output, as invoke returns it (the episode's final_state)
        cancelled = False
        try:
            chunks = ctx.run(self.runnable.stream, input, config, **fold.kwargs)
            try:
                while True:
                    try:
                        chunk = fold.feed(ctx.run(next, chunks))
                    except StopIteration:
                        break
                    if not fold.skipped(chunk):
                        yield chunk
                _raise_swallowed_refusal(recorder)
                episode.final_state = fold.output
            finally:
                ctx.run(chunks.close)
        except GeneratorExit:
            cancelled = True
            raise
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._end_stream(episode, recorder, cancelled)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The graph's `astream`, recorded as one episode. Each step runs as a task in the episode's context.
        Closing the stream early cancels the run; no episode is stored for it."""
        episode, recorder, ctx = self._episode_context(input, config, kwargs.get("context"))
        fold = StreamFold(self.graph, kwargs)  # the run's output, as invoke returns it (the episode's final_state)
        chunks = self.runnable.astream(input, config, **fold.kwargs)
        cancelled = False

        async def step() -> Any:
            return await chunks.__anext__()

        try:
            try:
                while True:
                    try:
                        chunk = fold.feed(await asyncio.get_running_loop().create_task(step(), context=ctx))
                    except StopAsyncIteration:
                        break
                    if not fold.skipped(chunk):
                        yield chunk
                _raise_swallowed_refusal(recorder)
                episode.final_state = fold.output
            finally:
                await chunks.aclose()
        except (GeneratorExit, asyncio.CancelledError):
            cancelled = True
            raise
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._end_stream(episode, recorder, cancelled)

    def stream_events(self, input: Any, config: Any = None, *, version: str = "v2", **kwargs: Any) -> Any:
        _no_v3(version)
        return super().stream_events(input, config, version=version, **kwargs)

    def astream_events(self, input: Any, config: Any = None, *, version: str = "v2", **kwargs: Any) -> Any:
        _no_v3(version)
        return super().astream_events(input, config, version=version, **kwargs)

    # ---- state edits: they run no node, but may run conditional edges (routers) ------------------
    def update_state(self, *args: Any, **kwargs: Any) -> Any:
        with _outside_episode(self, "update_state"):
            return self.graph.update_state(*args, **kwargs)

    async def aupdate_state(self, *args: Any, **kwargs: Any) -> Any:
        with _outside_episode(self, "aupdate_state"):
            return await self.graph.aupdate_state(*args, **kwargs)

    def bulk_update_state(self, *args: Any, **kwargs: Any) -> Any:
        with _outside_episode(self, "bulk_update_state"):
            return self.graph.bulk_update_state(*args, **kwargs)

    async def abulk_update_state(self, *args: Any, **kwargs: Any) -> Any:
        with _outside_episode(self, "abulk_update_state"):
            return await self.graph.abulk_update_state(*args, **kwargs)


def _uncached(graph: Any) -> Any:
    """`graph` without its node cache (`compile(cache=...)`): LangGraph keys a cached node by its input, so
    the episodes of one GRPO group (one input) would share the first one's sampled reply, with no turn."""
    if getattr(graph, "cache", None) is None or not callable(getattr(graph, "copy", None)):
        return graph
    return graph.copy(update={"cache": None})


def _no_v3(version: str) -> None:
    if version == "v3":
        raise ConfigError("stream_events/astream_events(version='v3') is not supported on an instrumented graph "
                          "(LangGraph's experimental protocol drives the graph's own stream); use version='v2', "
                          "stream() or astream()")


def _raise_swallowed_refusal(recorder: _EpisodeRecorder) -> None:
    """A refused call fails its episode even when the application caught the StrictModeError."""
    if recorder.refusal is not None:
        raise StrictModeError(f"{recorder.refusal} (the application caught this error and went on; the episode "
                              "fails anyway)") from recorder.refusal


class _OutsideEpisode:
    """Handler for graph code that runs outside any episode (`update_state` runs routing functions): an LLM
    call there is refused in strict mode, and answered by the app's model with a warning otherwise."""

    def __init__(self, app: InstrumentedGraph, method: str) -> None:
        self.app, self.method = app, method

    def _check(self, site: CallSite) -> None:
        message = (f"an LLM call from {site.node or 'a routing function'!r} during {self.method}(), which is not "
                   "an episode: no policy serves it")
        if self.app.strict:
            raise StrictModeError(message + " (strict=True)")
        warnings.warn(UnservedCallWarning(message + "; the app's own model answers it"), stacklevel=6)

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        self._check(site)
        return original()

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        self._check(site)
        return await original()


@contextlib.contextmanager
def _outside_episode(app: InstrumentedGraph, method: str) -> Iterator[None]:
    token = ACTIVE_HANDLER.set(_OutsideEpisode(app, method))
    try:
        yield
    finally:
        ACTIVE_HANDLER.reset(token)
