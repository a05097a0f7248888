"""The judge's reply format: pydantic models (their JSON schema is what structured output enforces), and the
parsing of a raw reply into (score, reason) pairs, one per judged item.

Items: the one episode (mode episode), the G attempts of a group in order (mode group: keys 'attempt_1' ...
'attempt_G'), the agents of an episode in the order given (mode agent: keys the agents' names); each item a
{"reason", "score"} object. A reply that is not JSON or does not validate (a score outside [0, 1], an attempt
or agent missing, an unknown key) raises `ReplyError`, which the judge retries.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from drmas_graph._chat import _text
from drmas_graph.errors import DrmasError

__all__ = ["ReplyError", "Verdict", "schema_for", "group_keys", "json_schema", "reply_text", "parse_reply"]

REASON_CHARS = 600
"""Longest reason accepted (a bound in the schema, so guided decoding of a rambling model ends)."""

Score = Annotated[float, Field(ge=0.0, le=1.0, description="The score, from 0 to 1.")]
Reason = Annotated[str, Field(max_length=REASON_CHARS, description="Why, in one sentence.")]


class ReplyError(DrmasError, ValueError):
    """A judge reply that cannot be used (the message says why); the judge retries the call."""


class Verdict(BaseModel):
    """One score and why: of an episode, of an attempt of a group, of an agent."""

    model_config = ConfigDict(extra="ignore")
    reason: Reason
    score: Score


def _keyed_schema(name: str, keys: Sequence[str]) -> type[BaseModel]:
    """An object with one required `Verdict` per key, in order, and no other key: guided decoding (and any
    structured-output backend) then writes each attempt/agent exactly once."""
    fields: dict[str, Any] = {f"k{i}": (Verdict, Field(alias=key)) for i, key in enumerate(keys)}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


@functools.lru_cache(maxsize=64)
def _group_schema(n: int) -> type[BaseModel]:
    return _keyed_schema("GroupVerdict", group_keys(n))


@functools.lru_cache(maxsize=64)
def _agent_schema(agents: tuple[str, ...]) -> type[BaseModel]:
    return _keyed_schema("AgentVerdicts", agents)


def group_keys(n: int) -> list[str]:
    """The reply's keys in group mode: 'attempt_1' ... 'attempt_n'."""
    return [f"attempt_{i}" for i in range(1, n + 1)]


def schema_for(mode: str, n: int, agents: Sequence[str] = ()) -> type[BaseModel]:
    """The pydantic model of a reply: `Verdict` (episode); {"attempt_1": Verdict, ...} for the n attempts of a
    group; {agent: Verdict} for the agents of an episode."""
    if mode == "group":
        return _group_schema(n)
    if mode == "agent":
        return _agent_schema(tuple(agents))
    return Verdict


def json_schema(schema: type[BaseModel]) -> dict[str, Any]:
    """The reply format as a JSON schema dict: what `with_structured_output` is given, rather than the pydantic
    class, so that the model's reply comes back as raw text even when it does not validate (OpenAI's SDK
    parses a class's reply inside the call and raises, losing the text); `parse_reply` validates it."""
    return schema.model_json_schema()


def reply_text(message: Any) -> str:
    """The raw text of a judge's reply: its content, or the arguments of its tool call (models whose structured
    output is a forced tool call)."""
    text = _text(getattr(message, "content", ""))
    calls = getattr(message, "tool_calls", None)
    if not text.strip() and calls:
        return json.dumps(calls[0].get("args", {}), ensure_ascii=False)
    return text


_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _json_object(text: str) -> dict:
    """The JSON object in `text`: the whole text, a ```json fence, or the span from the first '{' to the last
    '}' (models without structured output often wrap the JSON in a sentence)."""
    fenced = _FENCE_RE.search(text)
    candidates = [text.strip()] + ([fenced.group(1)] if fenced else [])
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{"): text.rindex("}") + 1])
    for candidate in candidates:
        try:
            value = json.loads(candidate, strict=False)  # control characters inside strings are tolerated
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    raise ReplyError(f"the reply is not a JSON object: {clip_reply(text)!r}")


def clip_reply(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def parse_reply(text: str, schema: type[BaseModel]) -> list[tuple[float, str]]:
    """(score, reason) per judged item, in the items' order; `ReplyError` saying what is wrong otherwise."""
    obj = _json_object(text)
    try:
        reply = schema.model_validate(obj)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'reply'}: {e['msg']}" for e in exc.errors()[:5])
        raise ReplyError(f"the reply does not match the format asked for ({problems}): {clip_reply(text)!r}") from None
    if isinstance(reply, Verdict):
        return [(float(reply.score), reply.reason)]
    verdicts = [getattr(reply, name) for name in type(reply).model_fields]  # in the keys' order
    return [(float(v.score), v.reason) for v in verdicts]
