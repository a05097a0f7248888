"""The judge's reply format: pydantic models (their JSON schema is what structured output enforces), and the
parsing of a raw reply into (score, reason) pairs, one per judged item.

Items: the one episode (mode episode), the G attempts of a group in order (mode group), the agents of an
episode in the order given (mode agent). A reply that is not JSON, does not validate (a score outside [0, 1],
the wrong number of attempts) or names an attempt/agent twice raises `ReplyError`, which the judge retries.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from langchain_core.messages import AIMessage
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from drmas_graph._chat import _text

__all__ = ["ReplyError", "Verdict", "schema_for", "reply_text", "parse_reply"]

REASON_CHARS = 600
"""Longest reason accepted (a bound in the schema, so guided decoding of a rambling model ends)."""

Score = Annotated[float, Field(ge=0.0, le=1.0, description="The score, from 0 to 1.")]
Reason = Annotated[str, Field(max_length=REASON_CHARS, description="Why, in one sentence.")]


class ReplyError(ValueError):
    """A judge reply that cannot be used (the message says why); the judge retries the call."""


class Verdict(BaseModel):
    """Mode episode: the episode's score and why."""

    model_config = ConfigDict(extra="ignore")
    reason: Reason
    score: Score


@functools.lru_cache(maxsize=64)
def _group_schema(n: int) -> type[BaseModel]:
    item = create_model("AttemptVerdict", attempt=(Annotated[int, Field(ge=1, le=n)], ...), reason=(Reason, ...),
                        score=(Score, ...))
    return create_model("GroupVerdict", scores=(Annotated[list[item], Field(min_length=n, max_length=n)], ...))


@functools.lru_cache(maxsize=64)
def _agent_schema(agents: tuple[str, ...]) -> type[BaseModel]:
    item = create_model("AgentVerdict", agent=(Literal[agents], ...), reason=(Reason, ...), score=(Score, ...))
    n = len(agents)
    return create_model("AgentVerdicts", scores=(Annotated[list[item], Field(min_length=n, max_length=n)], ...))


def schema_for(mode: str, n: int, agents: Sequence[str] = ()) -> type[BaseModel]:
    """The pydantic model of a reply: `Verdict` (episode), G attempts (group, n = G), one entry per agent."""
    if mode == "group":
        return _group_schema(n)
    if mode == "agent":
        return _agent_schema(tuple(agents))
    return Verdict


def reply_text(message: Any) -> str:
    """The raw text of a judge's reply: its content, or the arguments of its tool call (models whose structured
    output is a forced tool call)."""
    if not isinstance(message, AIMessage):
        return _text(getattr(message, "content", message)) if not isinstance(message, str) else message
    text = _text(message.content)
    if not text.strip() and message.tool_calls:
        return json.dumps(message.tool_calls[0].get("args", {}), ensure_ascii=False)
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
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    raise ReplyError(f"the reply is not a JSON object: {clip_reply(text)!r}")


def clip_reply(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def parse_reply(text: str, schema: type[BaseModel], mode: str, agents: Sequence[str] = ()
                ) -> list[tuple[float, str]]:
    """(score, reason) per judged item, in the items' order; `ReplyError` saying what is wrong otherwise."""
    obj = _json_object(text)
    try:
        reply = schema.model_validate(obj)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'reply'}: {e['msg']}" for e in exc.errors()[:5])
        raise ReplyError(f"the reply does not match the format asked for ({problems}): {clip_reply(text)!r}") from None
    if mode == "episode":
        return [(float(reply.score), reply.reason)]
    keys = [item.attempt for item in reply.scores] if mode == "group" else [item.agent for item in reply.scores]
    wanted = list(range(1, len(reply.scores) + 1)) if mode == "group" else list(agents)
    if sorted(map(str, keys)) != sorted(map(str, wanted)):
        what = "attempt" if mode == "group" else "agent"
        raise ReplyError(f"the reply must score each {what} of {wanted} once, but it scores {keys}: "
                         f"{clip_reply(text)!r}")
    by_key = {item.attempt if mode == "group" else item.agent: item for item in reply.scores}
    return [(float(by_key[k].score), by_key[k].reason) for k in wanted]
