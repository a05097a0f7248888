"""LangChain messages <-> chat-template dicts, and tool calls parsed back out of generated text."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_tool

from drmas_graph.errors import ConfigError

__all__ = ["to_chat_dicts", "with_system_note", "normalize_tools", "tool_signature", "ParsedResponse", "TOOL_PARSERS", "get_tool_parser",
           "tool_call_id", "with_call_ids", "EpisodeCallIds"]


def _text(content: Any) -> str:
    """Message content as plain text: string content as is, text blocks of list content joined."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Render LangChain messages as the role/content dicts that Hugging Face chat templates expect."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m.content)})
        elif isinstance(m, AIMessage):
            d: dict[str, Any] = {"role": "assistant", "content": _text(m.content)}
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": tc.get("id"), "type": "function",
                     "function": {"name": tc["name"], "arguments": tc.get("args", {})}}
                    for tc in m.tool_calls
                ]
            out.append(d)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "content": _text(m.content), "tool_call_id": m.tool_call_id,
                        "name": m.name})
        elif isinstance(m, FunctionMessage):
            out.append({"role": "tool", "content": _text(m.content), "name": m.name})
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text(m.content)})
        else:
            raise ConfigError(f"cannot render a message of type {type(m).__name__} for a chat template")
    return out


def with_system_note(dicts: list[dict[str, Any]], note: str | None) -> list[dict[str, Any]]:
    """`note` appended to the leading system message (one is added when the prompt has none)."""
    if not note:
        return dicts
    if dicts and dicts[0]["role"] == "system":
        head = dicts[0]["content"]
        return [{**dicts[0], "content": f"{head}\n\n{note}" if head else note}, *dicts[1:]]
    return [{"role": "system", "content": note}, *dicts]


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """Tool schemas bound with `bind_tools` (any format LangChain accepts) as OpenAI function dicts."""
    if not tools:
        return []
    return [convert_to_openai_tool(t) for t in tools]


def tool_signature(tool: dict[str, Any]) -> str:
    """A bound tool (OpenAI function form, as `Turn.tools` holds it) as one line: `name(param: type, ...)`,
    a parameter the schema does not list as `required` followed by '?'."""
    function = tool.get("function", tool)
    schema = function.get("parameters") or {}
    required = set(schema.get("required") or ())
    params = [f"{name}{'' if name in required else '?'}: "
              f"{spec.get('type', 'any') if isinstance(spec, dict) else 'any'}"
              for name, spec in (schema.get("properties") or {}).items()]
    return f"{function.get('name', '?')}({', '.join(params)})"


@dataclass(frozen=True)
class ParsedResponse:
    """Generated text split into message content and tool calls."""

    content: str
    """The text without tool-call markup."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """LangChain tool calls: {'name', 'args', 'id', 'type': 'tool_call'}."""
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """Tool-call blocks that did not parse: {'name', 'args' (raw text), 'id', 'error', 'type'}."""


_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


_ID_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TOOL_CALL_ID_CHARS = 9
"""Tool-call ids are 9 alphanumeric characters: what Mistral's chat templates require (they raise on any other
length), and a valid id for every other template and API."""


def tool_call_id(*parts: Any) -> str:
    """The id of a tool call, derived from what it is (the reply that made it, its place among the reply's calls):
    the same reply gets the same ids in every run, so a template that renders them (Mistral's) gives the next
    call the same prompt, hence the same sampling seed. Base 62 of a SHA-256 digest: 62^9 ~ 1.4e16 values."""
    n = int.from_bytes(hashlib.sha256(json.dumps(parts, default=str).encode()).digest()[:8], "big")
    return "".join(_ID_ALPHABET[(n // 62**i) % 62] for i in range(TOOL_CALL_ID_CHARS))


_NAMED_CALL_RE = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)', re.DOTALL)


def _salvaged(raw: str) -> tuple[str | None, str]:
    """(tool name, arguments as written) of a Hermes call block that does not parse, as an API hands over a call
    whose arguments are not valid JSON (LangChain's `invalid_tool_calls` too); (None, the whole block) when the
    block does not open with a readable name."""
    found = _NAMED_CALL_RE.fullmatch(raw.strip())
    if found is None:
        return None, raw
    args = found.group(2).rstrip()
    if args.endswith("}") and args.count("{") < args.count("}"):  # the block's own closing brace
        args = args[:-1].rstrip()
    try:
        value = json.loads(args)
    except ValueError:
        value = None
    return json.loads(found.group(1)), value if isinstance(value, str) else args  # a string: the JSON it holds


def with_call_ids(calls: list[dict[str, Any]], *context: Any) -> list[dict[str, Any]]:
    """`calls` (tool calls or invalid ones) with ids derived from `context` as well as from the id the parser gave
    (the reply and the call's place in it): two equal replies at different places of an episode (the same call
    made twice in one conversation) get different ids, each the same in every run and in replay."""
    return [{**c, "id": tool_call_id(*context, c.get("id"))} for c in calls]


class EpisodeCallIds:
    """The tool-call ids of one episode's served replies: unique within the episode, the same in every run.

    A parser derives a call's id from the reply and the call's place in it, so the same reply twice (a model
    calling `add(1, 2)` again later in its conversation) would give two calls one id, which the API formats
    forbid and a tool result cannot tell apart. Here the id also depends on what the call is: its node instance
    (`call_key`), agent and prompt (a later call of one conversation has a longer prompt), and `k`, the number
    of earlier replies of that node instance, agent and prompt with the same text (calls that are equal in all of
    this are interchangeable, so `k` may follow arrival order). Replay returns the recorded ids (`Turn.tool_calls`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[Any, ...], int] = {}

    def assign(self, parsed: ParsedResponse, reply: str, call_key: str, agent: str, prompt: str) -> ParsedResponse:
        """`parsed` (the parse of `reply`) with its tool calls' ids made unique in the episode (`prompt`: the
        prompt's digest)."""
        if not parsed.tool_calls:
            return parsed
        key = (call_key, agent, prompt, reply)
        with self._lock:
            k = self._seen.get(key, 0)
            self._seen[key] = k + 1
        return dataclasses.replace(parsed, tool_calls=with_call_ids(parsed.tool_calls, call_key, agent, prompt, k))


def parse_hermes(text: str) -> ParsedResponse:
    """Hermes/Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text."""
    if "<tool_call>" not in text:
        return ParsedResponse(content=text.strip())
    calls, invalid = [], []
    for position, raw in enumerate(_HERMES_RE.findall(text)):
        try:
            obj = json.loads(raw)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append({"name": name, "args": args, "id": tool_call_id(text, position), "type": "tool_call"})
        except (ValueError, KeyError, TypeError) as exc:
            name, raw_args = _salvaged(raw)
            invalid.append({"name": name, "args": raw_args, "id": tool_call_id(text, position),
                            "error": f"{type(exc).__name__}: {exc}", "type": "invalid_tool_call"})
    content = _HERMES_RE.sub("", text).strip()
    return ParsedResponse(content=content, tool_calls=calls, invalid_tool_calls=invalid)


_MISTRAL_MARK = "[TOOL_CALLS]"


def parse_mistral(text: str) -> ParsedResponse:
    """Mistral style (what its chat templates render): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
    The marker is a special token, which decoding drops, so a reply that opens with such a list is one too; an
    unmarked list whose items are not all calls is content, a marked one that does not parse an invalid call."""
    body = text.strip()
    head, marked, rest = body.partition(_MISTRAL_MARK)
    listed = rest.strip() if marked else body
    try:
        items, end = json.JSONDecoder().raw_decode(listed) if listed.startswith("[") else (None, 0)
        calls = []
        for position, item in enumerate(items if isinstance(items, list) else ()):
            args = item.get("arguments", {}) if isinstance(item, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(item.get("name"), str) or not isinstance(args, dict):
                raise TypeError("each call needs a string name and object arguments")
            calls.append({"name": item["name"], "args": args, "id": tool_call_id(text, position), "type": "tool_call"})
        if not calls:
            raise TypeError("no call in the list")
    except (ValueError, TypeError, AttributeError) as exc:
        if not marked:
            return ParsedResponse(content=body)
        invalid = {"name": None, "args": rest.strip(), "id": tool_call_id(text, 0), "error": f"{type(exc).__name__}: "
                   f"{exc}", "type": "invalid_tool_call"}
        return ParsedResponse(content=head.strip(), invalid_tool_calls=[invalid])
    before = head.strip() + " " if marked else ""  # unmarked: `head` is the whole reply
    return ParsedResponse(content=(before + listed[end:].strip()).strip(), tool_calls=calls)


def parse_none(text: str) -> ParsedResponse:
    """No tool calling: the whole text is the content."""
    return ParsedResponse(content=text.strip())


TOOL_PARSERS: dict[str, Callable[[str], ParsedResponse]] = {"hermes": parse_hermes, "mistral": parse_mistral,
                                                             "none": parse_none}


def get_tool_parser(name: str) -> Callable[[str], ParsedResponse]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ConfigError(f"unknown tool parser {name!r}; valid: {sorted(TOOL_PARSERS)}") from None
