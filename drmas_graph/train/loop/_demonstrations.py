"""The warm start's demonstrations: where they come from, and how they become the policy's own token ids.

Two sources, each giving `Demonstration`s (one assistant reply of one agent, with the request that asked for it):

- `read_jsonl`: OpenAI's fine-tuning format, one conversation per line, `{"messages": [...], "tools": [...]}`. Every
  assistant message is a demonstration (its prompt: the messages before it), except those with `"weight": 0`; its
  `tool_calls` carry `function.arguments` as a JSON string. A record may also say what its request asked for, as the
  Chat Completions request would: `"response_format"` (json_object, json_schema) and `"tool_choice"`. Its agent is
  the file's (`warm_start.demonstrations: {agent: file}`) or the record's `"agent"` key (one file for all).
- `read_traces`: a trace store of episodes recorded by running the app with its own models (agents without a policy:
  the app's API model answers, recorded as turns that are not trainable), kept when their reward reaches a threshold;
  every turn of a warm-started agent in a kept episode is a demonstration. Episodes of the held-out split's tasks are
  left out (they score the warm start).

`tokenise` turns one into the ids the policy would see and sample: prompt ids = `policy.render(messages, tools,
response_format)` (the template, the tools and the structured-output note of the agent's call in the app, generation
prompt appended); response ids = the reply as the policy would write it (`reply_text`: JSON written with the keys in
its schema's order, tool calls in the policy's own syntax, `TOOL_CALL_WRITERS`, which its `tool_parser` reads back),
then the end-of-turn token. A recorded turn the same policy sampled for the same prompt keeps its sampled ids. The
grammar the call is decoded under (`policy.grammar_for`, or the one the turn recorded) goes with it: `disallowed`
says why a reply is not allowed by it (such a demonstration is reported and left out, never trained against the
grammar).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from drmas_graph._chat import get_tool_parser, normalize_tools
from drmas_graph._structured import output_spec
from drmas_graph.env import BadRewardError
from drmas_graph.errors import ConfigError, GrammarError, StructuredOutputError
from drmas_graph.policy import Policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop import _scoring
from drmas_graph.types import Sample, Turn

__all__ = ["Demonstration", "Example", "TOOL_CALL_WRITERS", "read_jsonl", "read_traces", "reply_text", "tokenise",
           "disallowed"]


@dataclass(frozen=True)
class Demonstration:
    """One assistant reply of one agent, with the request that asked for it."""

    agent: str
    """The agent it teaches."""
    messages: tuple[BaseMessage, ...]
    """The prompt: the conversation before the reply."""
    content: str
    """The reply's text (without tool calls)."""
    tool_calls: tuple[dict, ...] = ()
    """The reply's tool calls, LangChain style: {'name', 'args', 'id'}."""
    tools: tuple[dict, ...] = ()
    """The tools the request offered (OpenAI function form)."""
    response_format: dict | None = None
    """What the request asked the reply to be (`_structured.output_spec`'s spec, as `Turn.response_format`)."""
    tool_choice: Any = None
    """The request's `tool_choice` (None: auto)."""
    source: str = ""
    """Where it comes from: 'demos.jsonl line 3, message 4' or 'traces.db episode <id>, turn 2'."""
    grammar: str | None = None
    """The grammar the recorded turn was decoded under (`SamplingParams.grammar`); None: the policy's for the call."""
    sampled: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
    """(policy name, prompt ids, response ids) of a turn a policy sampled: kept when the same policy renders the same
    prompt."""


@dataclass(frozen=True)
class Example:
    """A demonstration in one policy's token ids."""

    agent: str
    """The agent it teaches."""
    prompt_ids: tuple[int, ...]
    """`policy.render(messages, tools, response_format)`."""
    response_ids: tuple[int, ...]
    """The reply as the policy would generate it, end-of-turn token included (the trained tokens)."""
    grammar: str | None
    """The grammar the call is decoded under (its logprobs are computed under its masks); None: free text."""
    source: str
    """Where the demonstration comes from."""

    def sample(self, index: int) -> Sample:
        """The `Sample` the supervised update trains on (no old logprobs or advantage: those are RL's)."""
        return Sample(prompt_ids=self.prompt_ids, response_ids=self.response_ids,
                      old_logprobs=(0.0,) * len(self.response_ids), advantage=1.0, agent=self.agent,
                      temperature=1.0, episode_id=self.source, turn_index=index, grammar=self.grammar)


# ---- the reply as the policy writes it ------------------------------------------------------------------


def _ordered(value: Any, schema: Any) -> Any:
    """`value` with the keys of every object in its JSON schema's `properties` order (then the others), as a
    grammar-constrained policy writes them (the grammar keeps the schema's order)."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: _ordered(value[k], props.get(k)) for k in keys}
    if isinstance(value, list):
        return [_ordered(v, schema.get("items")) for v in value]
    return value


def _arguments(call: Mapping[str, Any], tools: Sequence[dict]) -> dict:
    tool = next((t.get("function", t) for t in tools if t.get("function", t).get("name") == call["name"]), {})
    return _ordered(call["args"], tool.get("parameters"))


def _hermes(content: str, calls: Sequence[Mapping[str, Any]], tools: Sequence[dict]) -> str:
    tags = [f"<tool_call>{json.dumps({'name': c['name'], 'arguments': _arguments(c, tools)}, ensure_ascii=False)}"
            "</tool_call>" for c in calls]
    return "\n".join(([content] if content else []) + tags)


def _mistral(content: str, calls: Sequence[Mapping[str, Any]], tools: Sequence[dict]) -> str:
    listed = [{"name": c["name"], "arguments": _arguments(c, tools)} for c in calls]
    return " ".join(([content] if content else []) + ["[TOOL_CALLS]", json.dumps(listed, ensure_ascii=False)])


TOOL_CALL_WRITERS: dict[str, Callable[[str, Sequence[Mapping[str, Any]], Sequence[dict]], str]] = {
    "hermes": _hermes, "mistral": _mistral}
"""Tool parser -> how a reply with tool calls is written in its syntax (the inverse of `_chat.TOOL_PARSERS`):
hermes `text\\n<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, mistral `text [TOOL_CALLS] [{...}]`."""


def reply_text(demo: Demonstration, tool_parser: str) -> str:
    """The reply as a policy with `tool_parser` generates it for the demonstration's request: a forced tool's
    arguments as one JSON object; a JSON reply (json_object, json_schema) re-written with its schema's key order;
    else the text, then the tool calls in the parser's syntax."""
    kind = (demo.response_format or {}).get("type")
    if kind == "tool":  # the reply is the forced tool's arguments (`grammar.grammar_for`)
        if len(demo.tool_calls) != 1 or demo.content.strip():
            raise ConfigError(f"{demo.source}: the request forces tool {demo.response_format['name']!r}, so the reply "
                              "must be exactly one call of it and no text; fix the demonstration")
        return json.dumps(_arguments(demo.tool_calls[0], demo.tools), ensure_ascii=False)
    if kind in ("json_object", "json_schema") and not demo.tool_calls:
        try:
            value = json.loads(demo.content)
        except ValueError:
            return demo.content  # not JSON: the grammar check reports it
        return json.dumps(_ordered(value, demo.response_format.get("schema")), ensure_ascii=False)
    if not demo.tool_calls:
        return demo.content
    writer = TOOL_CALL_WRITERS.get(tool_parser)
    if writer is None:
        raise ConfigError(f"{demo.source}: the reply of agent {demo.agent!r} calls tools, but its policy reads tool "
                          f"calls with tool_parser {tool_parser!r}, which has no tool-call syntax (writers: "
                          f"{sorted(TOOL_CALL_WRITERS)}); give the policy a tool parser, or drop the demonstration")
    return writer(demo.content, demo.tool_calls, demo.tools)


def tokenise(demo: Demonstration, policy: Policy, *, constrain: bool) -> Example:
    """The demonstration in `policy`'s ids (module docstring). `constrain`: the agent's calls are decoded under
    the grammar of their format (`agents.<a>.constrain`; the policy's own `constrain` also applies)."""
    prompt = tuple(policy.render(demo.messages, demo.tools, demo.response_format))
    if demo.sampled is not None and demo.sampled[0] == policy.name and demo.sampled[1] == prompt:
        response = demo.sampled[2]
    else:
        end = getattr(policy.tokenizer, "eos_token_id", None)
        if end is None:
            raise ConfigError(f"policy {policy.name!r}: its tokenizer has no eos_token_id, the token that ends a "
                              "reply; set one on the tokenizer")
        text = reply_text(demo, policy.tool_parser)
        response = (*policy.tokenizer.encode(text, add_special_tokens=False), int(end))
    grammar = None
    if constrain:
        kwargs = {} if demo.tool_choice is None else {"tool_choice": demo.tool_choice}
        grammar = demo.grammar if demo.grammar is not None and policy.constrain else policy.grammar_for(
            demo.response_format, list(demo.tools), kwargs)
    return Example(demo.agent, prompt, tuple(int(t) for t in response), grammar, demo.source)


def disallowed(example: Example, policy: Policy) -> str | None:
    """Why the example's reply is not allowed by its grammar (the first token it refuses), or None."""
    if example.grammar is None:
        return None
    try:
        policy.grammars.masks(example.grammar, example.response_ids)
    except GrammarError as exc:
        return str(exc).split("; grammar:")[0]
    return None


# ---- OpenAI's fine-tuning format ------------------------------------------------------------------------


def read_jsonl(path: str | Path, *, agent: str | None, agents: Collection[str], key: str) -> list[Demonstration]:
    """The demonstrations of a fine-tuning JSONL file. `agent`: the file's agent (None: each record names its own in
    `"agent"`); `agents`: the valid names; `key`: the config key naming the file (errors start with it)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{key}: demonstrations file {str(path)!r} does not exist (looked for "
                          f"{str(file.resolve())!r}; a relative path is relative to the working directory)")
    out: list[Demonstration] = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            out += _record(line, f"{file.name} line {n}", agent, agents, key)
    if not out:
        raise ConfigError(f"{key}: {path} holds no assistant message to learn from")
    return out


def _record(line: str, where: str, agent: str | None, agents: Collection[str], key: str) -> list[Demonstration]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{key}: {where} is not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise ConfigError(f"{key}: {where} must be an object with a non-empty list of \"messages\"")
    if "functions" in record or "function_call" in record:
        raise ConfigError(f"{key}: {where} uses the legacy \"functions\" format; write them as \"tools\" "
                          "([{\"type\": \"function\", \"function\": {...}}]) and assistant \"tool_calls\"")
    named = record.get("agent")
    if agent is not None and named is not None and named != agent:
        raise ConfigError(f"{key}: {where} names agent {named!r}, but the file is agent {agent!r}'s; fix the record")
    if agent is None and named is None:
        raise ConfigError(f"{key}: {where} has no \"agent\" key: give each record one of {sorted(agents)}, or map a "
                          "file to each agent (warm_start.demonstrations: {agent: file})")
    who = agent or named
    if who not in agents:
        raise ConfigError(f"{key}: {where} is for agent {who!r}, which is no agent of the run; agents: "
                          f"{sorted(agents)}")
    tools = tuple(normalize_tools(record.get("tools")))
    try:
        spec, _ = output_spec({"response_format": record.get("response_format"),
                               "tool_choice": record.get("tool_choice")}, tools, f"{key}: {where}")
    except StructuredOutputError as exc:
        raise ConfigError(str(exc)) from None
    messages: list[BaseMessage] = []
    out = []
    for i, m in enumerate(record["messages"]):
        here = f"{where}, message {i}"
        message = _message(m, here, key)
        weight = m.get("weight", 1)
        if "weight" in m and (m.get("role") != "assistant" or weight not in (0, 1)):
            raise ConfigError(f"{key}: {here}: \"weight\" is 0 or 1, on assistant messages only (got {weight!r})")
        if isinstance(message, AIMessage) and weight == 1:
            out.append(Demonstration(who, tuple(messages), _text(m.get("content"), here, key),
                                     tuple(dict(c) for c in message.tool_calls), tools, spec, record.get("tool_choice"),
                                     here))
        messages.append(message)
    return out


def _text(content: Any, where: str, key: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ConfigError(f"{key}: {where}: content must be a string or a list of text parts ({{\"type\": \"text\", "
                      "\"text\": ...}}); images and audio are not demonstrations a text policy can learn")


def _message(m: Any, where: str, key: str) -> BaseMessage:
    """An OpenAI chat message as the LangChain message the app's call would carry."""
    role = m.get("role") if isinstance(m, dict) else None
    if role in ("system", "developer"):
        return SystemMessage(_text(m.get("content"), where, key))
    if role == "user":
        return HumanMessage(_text(m.get("content"), where, key))
    if role == "tool":
        if not m.get("tool_call_id"):
            raise ConfigError(f"{key}: {where}: a tool message needs the \"tool_call_id\" of the call it answers")
        return ToolMessage(_text(m.get("content"), where, key), tool_call_id=m["tool_call_id"], name=m.get("name"))
    if role == "assistant":
        calls = [_call(c, f"{where}, tool call {j}", key) for j, c in enumerate(m.get("tool_calls") or [])]
        return AIMessage(_text(m.get("content"), where, key), tool_calls=calls)
    raise ConfigError(f"{key}: {where}: role {role!r} is not one of system, developer, user, assistant, tool")


def _call(call: Any, where: str, key: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ConfigError(f"{key}: {where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}}}")
    args = function.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError as exc:
        raise ConfigError(f"{key}: {where}: function.arguments is not a JSON string ({exc})") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{key}: {where}: function.arguments must encode a JSON object")
    return {"name": function["name"], "args": args, "id": str(call.get("id") or f"call_{where.split()[-1]}")}


# ---- episodes recorded with the app's own models ----------------------------------------------------------


def read_traces(path: str | Path, env: Any, *, agents: Collection[str], min_reward: float, reward: str,
                held_out: Collection[str], rollout: Any, invalid_penalty: float
                ) -> tuple[list[Demonstration], dict[str, int]]:
    """The warm-started agents' turns of the stored episodes whose team reward (`reward`: env = `env.reward` on the
    task of the 'train' split with the episode's task id, scored as training scores; stored = the store's) is at
    least `min_reward`, leaving out failed episodes, those of the `held_out` task ids, turns whose reply broke their
    format and the turn that caused a model error; and how many of each were left out."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"warm_start.traces: trace store {str(path)!r} does not exist (a relative path is relative "
                          "to the working directory)")
    tasks = {t.id: t for t in env.tasks("train")} if reward == "env" else {}
    counts = dict.fromkeys(("episodes", "kept", "below_min_reward", "failed", "held_out", "no_reward", "no_task",
                            "turns_left_out"), 0)
    out: list[Demonstration] = []
    store = TraceStore(file, readonly=True)
    try:
        for summary in store.episodes():
            counts["episodes"] += 1
            if summary.error is not None:
                counts["failed"] += 1
                continue
            if summary.task_id in held_out:
                counts["held_out"] += 1
                continue
            episode = store.load_episode(summary.id)
            if reward == "stored":
                team = summary.reward
            elif (task := tasks.get(summary.task_id)) is None:
                counts["no_task"] += 1
                continue
            else:
                score = _scoring.score_episodes(env, [(task, episode)], invalid_penalty=invalid_penalty,
                                                truncated_reward=rollout.truncated_reward,
                                                model_error_reward=rollout.model_error_reward)[0]
                team = None if isinstance(score, BadRewardError) else score.team
            if team is None:
                counts["no_reward"] += 1
                continue
            if team < min_reward:
                counts["below_min_reward"] += 1
                continue
            counts["kept"] += 1
            for i, turn in enumerate(episode.turns):
                if turn.agent not in agents:
                    continue
                if turn.format_error or i == episode.model_error_turn:
                    counts["turns_left_out"] += 1
                    continue
                out.append(_from_turn(turn, f"{file.name} episode {episode.id}, turn {i}"))
    finally:
        store.close()
    return out, counts


def _from_turn(turn: Turn, source: str) -> Demonstration:
    """A recorded turn as a demonstration: the app model's reply (content and tool calls), or a policy's reply
    read back with its parser, with its sampled ids."""
    content, sampled, grammar = turn.response_text, None, None
    if turn.trainable:  # the raw reply: its text without the tool calls (a forced tool's reply is its arguments)
        forced = (turn.response_format or {}).get("type") == "tool"
        content = "" if forced else get_tool_parser(turn.tool_parser or "none")(turn.response_text).content
        if turn.policy is not None:
            sampled = (turn.policy, turn.prompt_ids, turn.response_ids)
        grammar = turn.sampling.grammar if turn.sampling is not None else None
    calls = tuple({"name": c["name"], "args": dict(c.get("args") or {}), "id": c.get("id")} for c in turn.tool_calls)
    return Demonstration(turn.agent, tuple(turn.messages), content, calls, tuple(turn.tools), turn.response_format,
                         None, source, grammar, sampled)
