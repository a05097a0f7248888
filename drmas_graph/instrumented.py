"""`instrument(graph, policies)`: serve every node's LLM calls from trainable policies and record them.

The graph is not modified. Each run (`invoke`, `stream`, `rollout`, ...) installs an `_EpisodeRecorder`
in a context variable (see `_intercept`); every chat-model call made inside the run is attributed to an
agent (`drmas_agent` run metadata > first matching `agents` glob > node path), rendered with that agent's
policy's chat template, generated, parsed back into an `AIMessage`, and recorded as a `Turn`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import fnmatch
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from drmas_graph._chat import ParsedResponse, _text
from drmas_graph._intercept import ACTIVE_HANDLER, CallSite, install
from drmas_graph.errors import ConfigError, NoLLMCallError, RolloutError, StrictModeError, UnknownAgentError
from drmas_graph.policy import Policy
from drmas_graph.types import Episode, Generation, SamplingParams, Turn

__all__ = ["instrument", "InstrumentedGraph"]


def instrument(graph: Any = None, policies: Mapping[str, Policy] | None = None, *,
               agents: Mapping[str, str] | None = None, strict: bool = False, store: Any = None) -> Any:
    """Route a LangGraph app's LLM calls to trainable policies and record them per agent.

    Args:
        graph: a compiled LangGraph graph, or a `StateGraph` builder (compiled here). Omit it to use
            `instrument` as a decorator on a function that builds and returns the graph.
        policies: agent name -> Policy. One Policy object may serve several agents (a shared model).
        agents: node-path glob -> agent name (first match wins), e.g. {"research/*": "researcher"}.
            Without a match the agent is the node path itself ('outer/inner' inside subgraphs).
        strict: raise `StrictModeError` when a call's agent has no policy (default: the app's own model
            answers it and the turn is recorded as non-trainable).
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
    return [i.replace(":", "/") for i in ids if i not in ("__start__", "__end__")]


class InstrumentedGraph:
    """A compiled graph whose LLM calls are served by policies. Same run methods as the graph, plus
    `rollout`/`arollout`, which return the run as an `Episode`. Other attributes pass through to the graph
    (`get_state`, `get_graph`, ...)."""

    def __init__(self, graph: Any, policies: Mapping[str, Policy], *, agents: Mapping[str, str] | None = None,
                 strict: bool = False, store: Any = None) -> None:
        if not hasattr(graph, "invoke") and hasattr(graph, "compile"):
            graph = graph.compile()
        if not hasattr(graph, "invoke") or not hasattr(graph, "get_graph"):
            raise ConfigError(f"instrument() needs a compiled LangGraph graph or a StateGraph, got {type(graph).__name__}")
        self.graph = graph
        self.policies: dict[str, Policy] = dict(policies)
        self.agents: dict[str, str] = dict(agents or {})
        self.strict = strict
        self.store = store
        self.nodes: list[str] = graph_node_paths(graph)
        self._agent_of_node: dict[str, str] = {}
        self.sampling: dict[str, SamplingParams] = {}
        """Per-agent sampling overrides; an agent without one uses its policy's `sampling`."""
        self._validate()
        install()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    def __repr__(self) -> str:
        return f"InstrumentedGraph(agents={sorted(self.policies)}, nodes={self.nodes})"

    # ---- validation and routing -------------------------------------------------------------
    def _validate(self) -> None:
        for pattern, agent in self.agents.items():
            if not any(fnmatch.fnmatchcase(n, pattern) for n in self.nodes):
                raise UnknownAgentError(
                    f"agents: pattern {pattern!r} (agent {agent!r}) matches no node; nodes found: {self.nodes}. "
                    "Patterns are globs over node paths ('outer/inner' inside subgraphs).")
        known = set(self.nodes) | set(self.agents.values())
        for name, policy in self.policies.items():
            if not isinstance(policy, Policy):
                raise ConfigError(f"policies[{name!r}] is a {type(policy).__name__}, not a drmas_graph Policy; "
                                  "wrap the model, e.g. TransformersPolicy.from_pretrained(path)")
            if name not in known:
                raise UnknownAgentError(
                    f"policies: agent {name!r} is neither a node of the graph nor mapped by `agents`; "
                    f"nodes found: {self.nodes}; agents mapped: {sorted(set(self.agents.values()))}. "
                    f"Name the agent after a node path, or map nodes to it: agents={{'<node glob>': {name!r}}}.")

    def agent_for_node(self, node: str) -> str:
        """The agent of calls made by `node` (without a `drmas_agent` override)."""
        agent = self._agent_of_node.get(node)
        if agent is None:
            agent = next((a for p, a in self.agents.items() if fnmatch.fnmatchcase(node, p)), node)
            self._agent_of_node[node] = agent
        return agent

    def _route(self, site: CallSite) -> tuple[str, Policy | None]:
        agent = site.metadata.get("drmas_agent") or self.agent_for_node(site.node)
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

    # ---- running ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _recording(self, episode: Episode) -> Iterator[_EpisodeRecorder]:
        recorder = _EpisodeRecorder(self, episode)
        token = ACTIVE_HANDLER.set(recorder)
        episode._start_clock()
        try:
            yield recorder
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ACTIVE_HANDLER.reset(token)
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
        self._write(episode)
        return RolloutError(f"episode {episode.id} (task {episode.task_id}) failed after {len(episode.turns)} LLM "
                            f"call(s): {episode.error}", episode)

    def _write(self, episode: Episode) -> None:
        if self.store is not None:
            self.store.write_episode(episode)

    @staticmethod
    def _new_episode(input: Any, config: Any, task_id: str | None, group_id: str | None,
                     metadata: dict[str, Any] | None = None) -> Episode:
        thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
        metadata = dict(metadata or {})
        if thread_id is not None:
            metadata["thread_id"] = thread_id
        return Episode(task_id=task_id, group_id=group_id, input=input, metadata=metadata)

    def rollout(self, input: Any, config: Any = None, *, task_id: str | None = None,
                group_id: str | None = None, metadata: dict[str, Any] | None = None) -> Episode:
        """Run the graph once and return the run as an Episode (final_state = what invoke returns).

        Raises `RolloutError` (with `.episode`, also written to the store) if the graph raises, and
        `NoLLMCallError` if the run made no LLM call. `metadata` is stored with the episode.
        """
        episode = self._new_episode(input, config, task_id, group_id, metadata)
        try:
            with self._recording(episode):
                output = self.graph.invoke(input, config)
        except Exception as exc:
            raise self._failed(episode, exc) from exc
        return self._finish(episode, output, require_calls=True)

    async def arollout(self, input: Any, config: Any = None, *, task_id: str | None = None,
                       group_id: str | None = None, metadata: dict[str, Any] | None = None) -> Episode:
        """Async `rollout`: many can run concurrently in one event loop without cross-talk."""
        episode = self._new_episode(input, config, task_id, group_id, metadata)
        try:
            with self._recording(episode):
                output = await self.graph.ainvoke(input, config)
        except Exception as exc:
            raise self._failed(episode, exc) from exc
        return self._finish(episode, output, require_calls=True)

    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        episode = self._new_episode(input, config, None, None)
        try:
            with self._recording(episode):
                output = self.graph.invoke(input, config, **kwargs)
        except Exception:
            self._write(episode)
            raise
        self._finish(episode, output, require_calls=False)
        return output

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        episode = self._new_episode(input, config, None, None)
        try:
            with self._recording(episode):
                output = await self.graph.ainvoke(input, config, **kwargs)
        except Exception:
            self._write(episode)
            raise
        self._finish(episode, output, require_calls=False)
        return output

    def _episode_context(self, input: Any, config: Any) -> tuple[Episode, _EpisodeRecorder, contextvars.Context]:
        """A new episode, its recorder, and a context in which the recorder is the active handler."""
        episode = self._new_episode(input, config, None, None)
        recorder = _EpisodeRecorder(self, episode)
        ctx = contextvars.copy_context()
        ctx.run(ACTIVE_HANDLER.set, recorder)
        episode._start_clock()
        return episode, recorder, ctx

    def stream(self, input: Any, config: Any = None, **kwargs: Any) -> Iterator[Any]:
        """The graph's `stream`, recorded as one episode. Each step runs in the episode's own context."""
        episode, recorder, ctx = self._episode_context(input, config)
        chunks = ctx.run(self.graph.stream, input, config, **kwargs)
        try:
            while True:
                try:
                    chunk = ctx.run(next, chunks)
                except StopIteration:
                    break
                yield chunk
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ctx.run(chunks.close)
            recorder.finish()
            self._write(episode)

    async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        """The graph's `astream`, recorded as one episode. Each step runs as a task in the episode's context."""
        episode, recorder, ctx = self._episode_context(input, config)
        chunks = self.graph.astream(input, config, **kwargs)

        async def step() -> Any:
            return await chunks.__anext__()

        try:
            while True:
                try:
                    chunk = await asyncio.get_running_loop().create_task(step(), context=ctx)
                except StopAsyncIteration:
                    break
                yield chunk
        except BaseException as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await chunks.aclose()
            recorder.finish()
            self._write(episode)

    def batch(self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[Any]:
        """`invoke` on each input concurrently in threads (`max_concurrency` in the config bounds them)."""
        if not inputs:
            return []
        configs, limit = _per_input_configs(inputs, config)
        with concurrent.futures.ThreadPoolExecutor(max_workers=limit or len(inputs)) as pool:
            futures = [pool.submit(contextvars.copy_context().run, self.invoke, x, c, **kwargs)
                       for x, c in zip(inputs, configs)]
            return [_result(f, return_exceptions) for f in futures]

    async def abatch(self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[Any]:
        configs, limit = _per_input_configs(inputs, config)
        gate = asyncio.Semaphore(limit or max(len(inputs), 1))

        async def one(x: Any, c: Any) -> Any:
            async with gate:
                return await self.ainvoke(x, c, **kwargs)

        return await asyncio.gather(*(one(x, c) for x, c in zip(inputs, configs)),
                                    return_exceptions=return_exceptions)


def _per_input_configs(inputs: Sequence[Any], config: Any) -> tuple[list[Any], int | None]:
    """One config per input (a list is taken as is), and the `max_concurrency` of the first."""
    configs = list(config) if isinstance(config, list) else [config] * len(inputs)
    return configs, ((configs[0] or {}).get("max_concurrency") if configs else None)


def _result(future: concurrent.futures.Future, return_exceptions: bool) -> Any:
    try:
        return future.result()
    except Exception as exc:
        if return_exceptions:
            return exc
        raise


class _EpisodeRecorder:
    """The CallHandler of one episode: serves calls from policies and collects Turns (thread-safe)."""

    def __init__(self, app: InstrumentedGraph, episode: Episode) -> None:
        self.app = app
        self.episode = episode
        self._lock = threading.Lock()
        self._next_index = 0
        self._per_key: dict[str, int] = {}
        self._turns: list[Turn] = []
        self._starts: dict[int, float] = {}  # call index -> unix start time

    def _begin(self, site: CallSite) -> tuple[int, int]:
        with self._lock:
            index = self._next_index
            self._starts[index] = time.time()
            self._next_index += 1
            nci = self._per_key.get(site.call_key, 0)
            self._per_key[site.call_key] = nci + 1
        return index, nci

    def _add(self, turn: Turn) -> None:
        with self._lock:
            self._turns.append(turn)

    def finish(self) -> None:
        with self._lock:
            self.episode.turns = sorted(self._turns, key=lambda t: t.index)
            self.episode.timings["turn_starts"] = [self._starts[t.index] for t in self.episode.turns]
        self.episode._stop_clock()

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        agent, policy = self.app._route(site)
        index, nci = self._begin(site)
        start = time.perf_counter()
        if policy is None:
            result = original()
            self._add(self._untrained_turn(site, agent, index, nci, result, time.perf_counter() - start))
            return result
        with policy.announce():
            prompt_ids = policy.render(site.messages, site.tools)
            params = self.app._sampling_for(agent, policy, site.stop)
        generation = policy.generate(prompt_ids, params)
        return self._served(site, agent, policy, index, nci, prompt_ids, params, generation, start)

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        agent, policy = self.app._route(site)
        index, nci = self._begin(site)
        start = time.perf_counter()
        if policy is None:
            result = await original()
            self._add(self._untrained_turn(site, agent, index, nci, result, time.perf_counter() - start))
            return result
        with policy.announce():
            prompt_ids = policy.render(site.messages, site.tools)
            params = self.app._sampling_for(agent, policy, site.stop)
        generation = await policy.agenerate(prompt_ids, params)
        return self._served(site, agent, policy, index, nci, prompt_ids, params, generation, start)

    def _served(self, site: CallSite, agent: str, policy: Policy, index: int, nci: int, prompt_ids: list[int],
                params: SamplingParams, gen: Generation, start: float) -> ChatResult:
        text = policy.decode(gen.token_ids)
        parsed = policy.parse(_cut_at_stop(text, params.stop))
        finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
        message = served_message(parsed, finish=finish, policy_name=policy.name, policy_version=gen.policy_version,
                                 agent=agent, index=index, n_prompt=len(prompt_ids), n_response=len(gen.token_ids),
                                 message_id=self._message_id(index))
        self._add(Turn(
            agent=agent, node=site.node, step=site.step, index=index, messages=tuple(site.messages),
            prompt_ids=tuple(prompt_ids), response_ids=gen.token_ids, response_logprobs=gen.logprobs,
            response_text=text, tool_calls=tuple(parsed.tool_calls), finish_reason=finish, policy=policy.name,
            policy_version=gen.policy_version, trainable=True, latency_s=time.perf_counter() - start,
            call_key=site.call_key, node_call_index=nci, sampling=params, tools=tuple(site.tools),
            message_id=message.id,
        ))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _message_id(self, index: int) -> str:
        return f"drmas-{self.episode.id}-{index}"

    def _untrained_turn(self, site: CallSite, agent: str, index: int, nci: int, result: ChatResult,
                        latency: float) -> Turn:
        message = result.generations[0].message
        if message.id is None:  # LangChain would pick a random run id; ours lets replay return the same one
            message.id = self._message_id(index)
        return Turn(
            agent=agent, node=site.node, step=site.step, index=index, messages=tuple(site.messages), prompt_ids=(),
            response_ids=(), response_logprobs=(), response_text=_text(message.content),
            tool_calls=tuple(getattr(message, "tool_calls", ()) or ()),
            finish_reason=str((message.response_metadata or {}).get("finish_reason", "stop")), policy=None,
            policy_version=None, trainable=False, latency_s=latency, call_key=site.call_key, node_call_index=nci,
            tools=tuple(site.tools), message_id=message.id,
        )


def served_message(parsed: ParsedResponse, *, finish: str, policy_name: str | None, policy_version: int | None,
                   agent: str, index: int, n_prompt: int, n_response: int, message_id: str | None) -> AIMessage:
    """The AIMessage a node receives for a policy-served call (replay rebuilds it from the Turn)."""
    return AIMessage(
        content=parsed.content, tool_calls=parsed.tool_calls, invalid_tool_calls=parsed.invalid_tool_calls,
        id=message_id,
        response_metadata={"finish_reason": finish, "model_name": policy_name, "policy_version": policy_version,
                           "drmas_agent": agent, "drmas_turn": index},
        usage_metadata={"input_tokens": n_prompt, "output_tokens": n_response, "total_tokens": n_prompt + n_response},
    )


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Message content ends before the first stop string (OpenAI semantics); the Turn keeps the full text."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
