"""`_EpisodeRecorder`: the call handler of one episode. It serves each intercepted chat-model call from the
agent's policy (or lets the app's own model answer it), and records every call as a `Turn`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import ensure_config

from drmas_graph._chat import EpisodeCallIds, ParsedResponse, _text, with_call_ids
from drmas_graph.instrumentation import _task_paths
from drmas_graph.instrumentation._intercept import CallSite, policy_requests
from drmas_graph.instrumentation._limits import enforce_limits
from drmas_graph.instrumentation._wire import UNSERVED_KEY
from drmas_graph.instrumentation._seeds import prompt_digest, seeded
from drmas_graph._structured import InvalidReplyError, apply_spec, output_spec
from drmas_graph.errors import GrammarError, StrictModeError
from drmas_graph.policy import Policy
from drmas_graph.types import Episode, Generation, SamplingParams, Turn

__all__ = ["_EpisodeRecorder", "_Recorder", "served_message", "_cut_at_stop", "_stop_hit", "structured_parts", "RAW_BRANCH_TAG",
           "enclosing_node", "own_site", "check_tools_rendered", "capped", "call_sampling"]

RAW_BRANCH_TAG = "map:key:raw"
"""Run tag of the model call inside `with_structured_output(..., include_raw=True)` (LangChain runs it as the
`raw` step of a RunnableMap): there a reply that fails the request is returned, and LangChain's own parser
reports it as `parsing_error`, instead of raising."""


class _EpisodeRecorder:
    """The CallHandler of one episode: serves calls from policies and collects Turns (thread-safe)."""

    def __init__(self, app: Any, episode: Episode) -> None:
        self.app = app
        self.episode = episode
        self.strict = bool(getattr(app, "strict", False))
        self.refusal: StrictModeError | None = None
        """The first call this run refused (strict mode); the episode fails even if the app caught it."""
        self._lock = threading.Lock()
        self._next_index = 0
        self._per_key: dict[str, int] = {}
        self._per_prompt: dict[tuple[str, str, str], int] = {}  # (call_key, agent, prompt digest) -> calls (seeds)
        self._turns: list[Turn] = []
        self._call_ids = EpisodeCallIds()  # tool-call ids unique in the episode
        self._starts: dict[int, float] = {}  # call index -> unix start time
        self.segment = 0
        """The run of the episode's thread now in progress (`Turn.segment` of its calls)."""
        self.base = enclosing_node()
        """Node path of the node of another graph this run was started from ('' at top level): an
        instrumented app run inside a node of another graph (a sub-app) names its own nodes without it."""

    def refused(self, error: StrictModeError) -> None:
        with self._lock:
            self.refusal = self.refusal or error

    def note_unserved(self, request: dict[str, str]) -> None:
        """An LLM API request of this episode that no policy served ({node, client, url, refused})."""
        with self._lock:
            self.episode.metadata.setdefault(UNSERVED_KEY, []).append(dict(request))

    def _begin(self, site: CallSite) -> tuple[int, int]:
        with self._lock:
            index = self._next_index
            self._starts[index] = time.time()
            self._next_index += 1
            nci = self._per_key.get(site.call_key, 0)
            self._per_key[site.call_key] = nci + 1
        enforce_limits(self.episode, index)  # rollout.max_llm_calls / timeout_s (set by the trainer)
        return index, nci

    def _add(self, turn: Turn) -> None:
        with self._lock:
            self._turns.append(turn)

    def sync_turns(self) -> None:
        """Put the calls recorded so far on the episode, in call order (between runs of a multi-run episode)."""
        with self._lock:
            self.episode.turns = sorted(self._turns, key=lambda t: t.index)

    def finish(self) -> None:
        self.sync_turns()
        with self._lock:
            self.episode.timings["turn_starts"] = [self._starts[t.index] for t in self.episode.turns]
        self.episode._stop_clock()

    def _route(self, site: CallSite) -> tuple[str, Policy | None]:
        try:
            return self.app._route(site)
        except StrictModeError as exc:
            self.refused(exc)
            raise

    def _prepare(self, site: CallSite, agent: str, policy: Policy) -> tuple[list[int], SamplingParams, Any]:
        where = f"agent {agent!r} (node {site.node or '<outside any node>'!r})"
        spec, model_class = output_spec(site.kwargs, site.tools, where)
        with policy.announce():
            if site.prompt is None:
                prompt_ids = policy.render(site.messages, site.tools, spec)
                # an error in a strict run of the app; a warning in training (its episodes carry their phase),
                # which goes on without the tools rather than fail every episode
                refuse = self.strict and "phase" not in self.episode.metadata
                try:
                    check_tools_rendered(policy, prompt_ids, site, spec, where, refuse)
                except StrictModeError as exc:
                    self.refused(exc)  # the episode fails even if the app catches the error
                    raise
            else:  # a text prompt (the legacy Completions API): the model reads it as it is
                prompt_ids = list(policy.tokenizer.encode(site.prompt, add_special_tokens=False))
            own = self.app.agent_for_node(site.node) == agent  # the node's own agent: seeds without the agent
            params = seeded(capped(self.app._sampling_for(agent, policy, site.stop), site.kwargs),
                            self.episode.metadata, site.call_key,
                            *self._prompt_occurrence(site.call_key, agent, prompt_ids), None if own else agent)
        if params.constrain and site.prompt is None:  # the format the call asks for, guaranteed as the API would
            try:
                params = params.replace(grammar=policy.grammar_for(spec, site.tools, site.kwargs))
            except GrammarError as exc:
                raise GrammarError(f"{where}: {exc}") from exc
        return prompt_ids, params, (spec, model_class, where)

    def _prompt_occurrence(self, call_key: str, agent: str, prompt_ids: list[int]) -> tuple[int, str]:
        """(earlier calls of node instance `call_key` by `agent` with this prompt, the prompt's digest): what a
        call's seed is derived from besides its key, the same whatever order concurrent calls arrive in
        (`_seeds`)."""
        digest = prompt_digest(prompt_ids)
        with self._lock:
            k = self._per_prompt.get((call_key, agent, digest), 0)
            self._per_prompt[(call_key, agent, digest)] = k + 1
        return k, digest

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        site = own_site(site, self.base)
        agent, policy = self._route(site)
        index, nci = self._begin(site)
        start = time.perf_counter()
        if policy is None:
            result = original()
            self._add(self._untrained_turn(site, agent, index, nci, result, time.perf_counter() - start))
            return result
        prompt_ids, params, structured = self._prepare(site, agent, policy)
        with policy_requests():  # a policy's own HTTP requests (a vLLM server) are not calls of the app
            generation = policy.generate(prompt_ids, params)
        return self._served(site, agent, policy, index, nci, prompt_ids, params, generation, start, structured)

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        site = own_site(site, self.base)
        agent, policy = self._route(site)
        index, nci = self._begin(site)
        start = time.perf_counter()
        if policy is None:
            result = await original()
            self._add(self._untrained_turn(site, agent, index, nci, result, time.perf_counter() - start))
            return result
        prompt_ids, params, structured = self._prepare(site, agent, policy)
        with policy_requests():
            generation = await policy.agenerate(prompt_ids, params)
        return self._served(site, agent, policy, index, nci, prompt_ids, params, generation, start, structured)

    def _served(self, site: CallSite, agent: str, policy: Policy, index: int, nci: int, prompt_ids: list[int],
                params: SamplingParams, gen: Generation, start: float, structured: tuple) -> ChatResult:
        spec, model_class, where = structured
        text = policy.decode(gen.token_ids)
        reply = _cut_at_stop(text, params.stop)
        failure, extra = None, {}
        if spec is None:
            parsed = policy.parse(reply)
        else:
            try:
                parsed, extra = apply_spec(spec, model_class, reply, policy.parse, where)
            except InvalidReplyError as exc:
                failure, parsed = exc, ParsedResponse(content=reply.strip())
        finish = "tool_calls" if parsed.tool_calls and gen.finish_reason == "stop" else gen.finish_reason
        parsed = self._call_ids.assign(parsed, reply, site.call_key, agent, prompt_digest(prompt_ids))
        message = served_message(parsed, finish=finish, policy_name=policy.name, policy_version=gen.policy_version,
                                 agent=agent, index=index, n_prompt=len(prompt_ids), n_response=len(gen.token_ids),
                                 message_id=self._message_id(index), additional_kwargs=extra)
        self._add(Turn(
            agent=agent, node=site.node, step=site.step, index=index, messages=tuple(site.messages),
            prompt_ids=tuple(prompt_ids), response_ids=gen.token_ids, response_logprobs=gen.logprobs,
            response_text=text, tool_calls=tuple(parsed.tool_calls), finish_reason=finish, policy=policy.name,
            policy_version=gen.policy_version, trainable=True, latency_s=time.perf_counter() - start,
            call_key=site.call_key, node_call_index=nci, sampling=params, tools=tuple(site.tools),
            message_id=message.id, response_format=spec, format_error=_format_error(failure, parsed, site.tools),
            agent_name=site.agent_name, segment=self.segment, tool_parser=policy.tool_parser,
            call_sampling=call_sampling(site),
        ))
        if gen.prefill_s or gen.decode_s:
            self._add_engine_time(agent, gen)
        if failure is not None:
            failure.turn_index = index
            if RAW_BRANCH_TAG not in site.tags:
                raise failure
        # the reply as generated (cut at a stop string, not stripped): a legacy Completions answer's text
        info = {"text": reply, "stop_sequence": _stop_hit(text, params.stop)}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _add_engine_time(self, agent: str, gen: Generation) -> None:
        """Add a call's engine seconds to its agent's in `episode.timings['engine']`."""
        with self._lock:
            spent = self.episode.timings.setdefault("engine", {}).setdefault(agent, {"prefill_s": 0.0, "decode_s": 0.0})
            spent["prefill_s"] += gen.prefill_s
            spent["decode_s"] += gen.decode_s

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
            tools=tuple(site.tools), message_id=message.id, agent_name=site.agent_name, segment=self.segment,
            call_sampling=call_sampling(site),
            format_error=_format_error(None, ParsedResponse("", invalid_tool_calls=list(
                getattr(message, "invalid_tool_calls", ()) or ())), site.tools),  # tool calls the API cut or botched
        )


class _Recorder(_EpisodeRecorder):
    """A rollout's recorder, which also knows whether the episode is inside an LLM call (the trainer's backstop
    truncates an episode cancelled there, and fails one cancelled between calls)."""

    def __init__(self, app: Any, episode: Episode) -> None:
        super().__init__(app, episode)
        self._calls_lock = threading.Lock()
        self._calls_under_way = 0
        self._cancelled_in_call = False

    @property
    def in_llm_call(self) -> bool:
        """A call is being served now (a sync node's thread keeps generating), or the episode's cancellation
        reached it inside one."""
        with self._calls_lock:
            return self._cancelled_in_call or self._calls_under_way > 0

    @contextlib.contextmanager
    def _under_way(self) -> Iterator[None]:
        with self._calls_lock:
            self._calls_under_way += 1
        try:
            yield
        except asyncio.CancelledError:
            self._cancelled_in_call = True
            raise
        finally:
            with self._calls_lock:
                self._calls_under_way -= 1

    def handle(self, site: CallSite, original: Callable[[], ChatResult]) -> ChatResult:
        with self._under_way():
            return super().handle(site, original)

    async def ahandle(self, site: CallSite, original: Callable[[], Any]) -> ChatResult:
        with self._under_way():
            return await super().ahandle(site, original)


_RENDERS_TOOLS: weakref.WeakKeyDictionary[Policy, bool] = weakref.WeakKeyDictionary()
"""Per policy: whether its chat template renders bound tools at all (found at its first call with tools)."""
_REPORTED: weakref.WeakKeyDictionary[Policy, set[str]] = weakref.WeakKeyDictionary()
"""Per policy, the tools already warned about (a warning once per tool)."""


def check_tools_rendered(policy: Policy, prompt_ids: Sequence[int], site: CallSite, spec: dict | None, where: str,
                         strict: bool) -> None:
    """Tools bound to a call that the policy's chat template leaves out of the prompt (a template without tool
    support drops them without a word; found once per policy by rendering the call without its tools): a
    `StrictModeError` in strict mode, else a warning (once per policy and tool). The model would never see the
    tool it is meant to call. `strict`: raise instead of warning."""
    if not site.tools:
        return
    renders = _RENDERS_TOOLS.get(policy)
    if renders is None:
        renders = _RENDERS_TOOLS[policy] = list(prompt_ids) != policy.render(site.messages, None, spec)
    if renders:
        return
    names = [t.get("function", t).get("name") for t in site.tools]
    message = (f"{where}: the chat template of policy {policy.name!r} does not render the bound tool(s) "
               f"{names}: the prompt the model sees has no schema for them, so it cannot learn to call them. "
               "Give the model a chat template that renders `tools` (in the YAML `models.<name>.chat_template: "
               "<a template file>` or `builtin:smollm2-tools` for SmolLM2 and other ChatML models; in Python "
               "Policy(chat_template=...), e.g. builtin_chat_template('smollm2-tools')) or use a model whose "
               "template does.")
    if strict:
        raise StrictModeError(message + " (strict=True)")
    seen = _REPORTED.setdefault(policy, set())
    if not set(names) <= seen:
        seen.update(names)
        warnings.warn(message, UserWarning, stacklevel=5)


def capped(params: SamplingParams, kwargs: dict[str, Any]) -> SamplingParams:
    """`params` with `max_new_tokens` at most the call's own `max_tokens` (an SDK's `max_tokens`,
    `max_completion_tokens`, `max_output_tokens`; `llm.bind(max_tokens=...)`)."""
    cap = kwargs.get("max_tokens")
    if isinstance(cap, int) and not isinstance(cap, bool) and 0 < cap < params.max_new_tokens:
        return params.replace(max_new_tokens=cap)
    return params


def call_sampling(site: CallSite) -> dict[str, Any]:
    """`Turn.call_sampling`: the stop strings (sorted, once each) and `max_tokens` the call passed, what a policy
    honours of the call's own sampling (`capped`, `InstrumentedGraph._sampling_for`); replay compares them."""
    cap = site.kwargs.get("max_tokens")
    return {"stop": sorted(set(site.stop or ())),
            "max_tokens": cap if isinstance(cap, int) and not isinstance(cap, bool) else None}


def enclosing_node() -> str:
    """Node path of the graph node whose run config is in effect here (LangChain's `ensure_config`, which
    child runs inherit): where an instrumented app is run from inside another graph's node; '' at top level."""
    configurable = ensure_config().get("configurable") or {}
    ns = configurable.get("checkpoint_ns")
    return _task_paths.node_path(str(ns)) if ns else ""


def own_site(site: CallSite, base: str) -> CallSite:
    """`site` as the app run from node `base` of an enclosing graph names it: LangGraph runs the app as a
    subgraph of that node, so the call's node path and key start with `base` ('outer/inner'), while the
    app's own node, its policies and its replay say 'inner'."""
    if not base:
        return site
    depth = base.count("/") + 1
    names = site.node.split("/")
    if names[:depth] != base.split("/") or len(names) <= depth:
        return site
    keys = site.call_key.split("/")
    return dataclasses.replace(site, node="/".join(names[depth:]), call_key="/".join(keys[depth:]))


def served_message(parsed: ParsedResponse, *, finish: str, policy_name: str | None, policy_version: int | None,
                   agent: str, index: int, n_prompt: int, n_response: int, message_id: str | None,
                   additional_kwargs: dict[str, Any] | None = None) -> AIMessage:
    """The AIMessage a node receives for a policy-served call (replay rebuilds it from the Turn). Replay re-parses
    the calls that did not parse (a Turn keeps the parsed ones, with their ids), so their ids are made unique here,
    from what both know: the agent and the prompt's length (longer at each later call of a conversation)."""
    return AIMessage(
        content=parsed.content, tool_calls=parsed.tool_calls,
        invalid_tool_calls=with_call_ids(parsed.invalid_tool_calls, agent, n_prompt),
        id=message_id, additional_kwargs=dict(additional_kwargs or {}),
        response_metadata={"finish_reason": finish, "model_name": policy_name, "policy_version": policy_version,
                           "drmas_agent": agent, "drmas_turn": index},
        usage_metadata={"input_tokens": n_prompt, "output_tokens": n_response, "total_tokens": n_prompt + n_response},
    )


def structured_parts(turn: Turn, parse: Callable[[str], ParsedResponse]) -> tuple[ParsedResponse, dict[str, Any]]:
    """The message parts a structured-output turn returned (`parsed` as a dict: the pydantic class is not
    recorded); raises `StructuredOutputError` for a turn whose reply did not satisfy its request."""
    where = f"agent {turn.agent!r} (node {turn.node!r})"
    stops = turn.sampling.stop if turn.sampling else ()
    parts, extra = apply_spec(turn.response_format, None, _cut_at_stop(turn.response_text, stops), parse, where)
    return ParsedResponse(content=parts.content, tool_calls=[dict(c) for c in turn.tool_calls]), extra


def _format_error(failure: InvalidReplyError | None, parsed: ParsedResponse, tools: Sequence[dict]) -> str | None:
    """`Turn.format_error`: the structured-output failure, else tool calls that did not parse (tools bound)."""
    if failure is not None:
        return str(failure)
    if tools and parsed.invalid_tool_calls:
        errors = "; ".join(str(c.get("error") or c.get("args")) for c in parsed.invalid_tool_calls)
        return f"{len(parsed.invalid_tool_calls)} tool call(s) in the reply do not parse: {errors}"[:500]
    return None


def _stop_hit(text: str, stops: Sequence[str]) -> str | None:
    """The stop string `_cut_at_stop` cuts `text` at (an Anthropic answer's `stop_sequence`), else None."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Message content ends before the first stop string (OpenAI semantics); the Turn keeps the full text."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
