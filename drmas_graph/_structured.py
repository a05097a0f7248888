"""Structured output: what a call's bound kwargs ask the response to be, and the answer LangChain expects.

`with_structured_output` and `bind_tools(tool_choice=...)` only bind keyword arguments to the model call;
the provider's API is what enforces them. A policy has no such API, so here the request is (1) read from
the call's kwargs into a JSON-able spec that is recorded on the Turn (`Turn.response_format`), (2)
rendered into the prompt the policy sees (an instruction appended to the system message, see `instruction`),
and (3) checked on the way back: the answer is the message LangChain's parsers expect (`parsed` in
`additional_kwargs` for OpenAI's `response_format` path, a tool call for a forced `tool_choice`), or a
`InvalidReplyError` (a `StructuredOutputError`) naming the agent and node when the generated text does not
satisfy the request. That error is the policy's doing (training keeps the episode as a model error); a
`StructuredOutputError` raised for a request that cannot be honoured is the app's.

Specs (the `type` key):
- `json_schema`: `{"name", "schema"}`: reply is one JSON object conforming to the schema.
- `json_object`: reply is one JSON object.
- `tool`: `{"name", "schema"}`: a forced call of one tool; the reply is the tool's JSON arguments (or a
  call of that tool in the policy's own tool-call format).
- `any_tool`: `{"names"}`: the reply must call one of the bound tools, in the policy's tool-call format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from drmas_graph._chat import ParsedResponse, tool_call_id
from drmas_graph.errors import InvalidReplyError, StructuredOutputError

__all__ = ["output_spec", "instruction", "apply_spec", "InvalidReplyError"]


_UNSUPPORTED_KWARGS = ("response_schema", "response_mime_type", "response_json_schema", "output_format",
                       "guided_json", "json_schema")


def output_spec(kwargs: dict[str, Any], tools: Sequence[dict], where: str) -> tuple[dict | None, Any]:
    """(spec, pydantic class or None) for a call's kwargs; (None, None) for free text.

    `where` ("agent 'x' (node 'y')") prefixes the error raised for a request that cannot be honoured."""
    for key in _UNSUPPORTED_KWARGS:
        if kwargs.get(key) is not None:
            raise StructuredOutputError(f"{where}: the model call binds {key}={kwargs[key]!r}, a structured-output "
                                        "option drmas-graph cannot honour; use with_structured_output(..., "
                                        "method='json_schema' | 'json_mode' | 'function_calling') on a chat model "
                                        "that binds response_format / tool_choice (ChatOpenAI does)")
    choice = _tool_choice(kwargs.get("tool_choice", _google_tool_choice(kwargs.get("tool_config"))), tools, where)
    fmt = kwargs.get("response_format", kwargs.get("format"))
    if fmt is not None and choice is not None:
        raise StructuredOutputError(f"{where}: the call forces tool_choice and response_format at once; drmas-graph "
                                    "can honour one of them per call")
    return choice or _response_format(fmt, where)


def _tool_choice(choice: Any, tools: Sequence[dict], where: str) -> tuple[dict, None] | None:
    names = [t.get("function", t).get("name") for t in tools]
    if choice in (None, False, "auto", "none") or (isinstance(choice, dict) and choice.get("type") in ("auto", "none")):
        return None
    if choice in (True, "any", "required") or (isinstance(choice, dict) and choice.get("type") in ("any", "required")):
        if not names:
            raise StructuredOutputError(f"{where}: tool_choice={choice!r} forces a tool call, but no tool is bound")
        if len(names) > 1:
            return {"type": "any_tool", "names": names}, None
        name = names[0]
    elif isinstance(choice, str):
        name = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")  # OpenAI: {"type": "function", "function": {"name": ...}}
    elif isinstance(choice, dict) and choice.get("type") == "tool":
        name = choice.get("name")  # Anthropic: {"type": "tool", "name": ...}
    else:
        raise StructuredOutputError(f"{where}: tool_choice={choice!r} is not a form drmas-graph understands "
                                    "('auto', 'none', 'any', 'required', a tool name, or {'type': 'function', "
                                    "'function': {'name': ...}})")
    if name not in names:
        raise StructuredOutputError(f"{where}: tool_choice forces tool {name!r}, which is not bound; bound tools: "
                                    f"{names}")
    schema = next(t.get("function", t) for t in tools if t.get("function", t).get("name") == name)
    return {"type": "tool", "name": name, "schema": schema.get("parameters", {})}, None


def _google_tool_choice(config: Any) -> Any:
    """Google's `tool_config={"function_calling_config": {"mode": "ANY", "allowed_function_names": [...]}}`
    as a tool_choice."""
    calling = (config or {}).get("function_calling_config") if isinstance(config, dict) else None
    if not isinstance(calling, dict) or str(calling.get("mode", "")).upper() != "ANY":
        return None
    names = calling.get("allowed_function_names") or []
    return names[0] if len(names) == 1 else "any"


def _response_format(fmt: Any, where: str) -> tuple[dict | None, Any]:
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None, None
    if fmt == "json" or (isinstance(fmt, dict) and fmt.get("type") == "json_object"):
        return {"type": "json_object"}, None
    if isinstance(fmt, type) and hasattr(fmt, "model_json_schema"):  # a pydantic class (ChatOpenAI json_schema)
        return {"type": "json_schema", "name": fmt.__name__, "schema": fmt.model_json_schema()}, fmt
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        spec = fmt["json_schema"]
        return {"type": "json_schema", "name": spec.get("name", "response"), "schema": spec.get("schema", {})}, None
    if isinstance(fmt, dict) and ("properties" in fmt or fmt.get("type") == "object"):  # a bare JSON schema
        return {"type": "json_schema", "name": fmt.get("title", "response"), "schema": fmt}, None
    raise StructuredOutputError(f"{where}: response_format={fmt!r} is not a form drmas-graph can honour "
                                "({'type': 'json_schema', 'json_schema': {...}}, {'type': 'json_object'}, "
                                "{'type': 'text'} or a pydantic class)")


def instruction(spec: dict | None) -> str | None:
    """The sentence appended to the system prompt so the policy knows what shape to reply in."""
    if spec is None:
        return None
    kind = spec["type"]
    if kind == "json_object":
        return "Reply with only a JSON object, and no other text."
    if kind == "json_schema":
        return ("Reply with only a JSON object, and no other text, that conforms to this JSON schema:\n"
                + json.dumps(spec["schema"], sort_keys=True))
    if kind == "tool":
        return (f"Call the tool {spec['name']!r}: reply with only its arguments as a JSON object, and no other "
                "text, conforming to this JSON schema:\n" + json.dumps(spec["schema"], sort_keys=True))
    return f"You must call one of these tools: {', '.join(spec['names'])}."


_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _json_object(text: str) -> dict | None:
    body = text.strip()
    fenced = _FENCE_RE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def apply_spec(spec: dict, model_class: Any, text: str, parse: Callable[[str], ParsedResponse], where: str
               ) -> tuple[ParsedResponse, dict[str, Any]]:
    """(the message parts, additional_kwargs) for a reply to a structured-output call; raises
    `InvalidReplyError` (naming `where`) when `text` does not satisfy `spec`."""
    kind = spec["type"]
    head = text.strip()[:300]
    if kind in ("tool", "any_tool"):
        parsed = parse(text)
        wanted = [spec["name"]] if kind == "tool" else spec["names"]
        calls = [c for c in parsed.tool_calls if c["name"] in wanted]
        if calls:
            return ParsedResponse(content=parsed.content, tool_calls=calls), {}
        args = _json_object(text) if kind == "tool" else None
        if args is None:
            raise InvalidReplyError(f"{where}: the call forces a call of tool {' or '.join(map(repr, wanted))}, "
                                        f"but the policy's reply is not one: {head!r}. The turn is recorded.")
        call = {"name": spec["name"], "args": args, "id": tool_call_id(text, 0), "type": "tool_call"}
        return ParsedResponse(content="", tool_calls=[call]), {}
    obj = _json_object(text)
    if obj is None:
        raise InvalidReplyError(f"{where}: the call asks for a JSON object ({kind}), but the policy's reply "
                                    f"is not one: {head!r}. The turn is recorded.")
    content = text.strip()
    if kind == "json_object":
        return ParsedResponse(content=content), {}
    parsed_value: Any = obj
    if model_class is not None:
        try:
            parsed_value = model_class.model_validate(obj)
        except ValueError as exc:
            raise InvalidReplyError(f"{where}: the policy's JSON reply does not validate against "
                                        f"{model_class.__name__}: {exc}. Reply: {head!r}. The turn is recorded.") from exc
    return ParsedResponse(content=content), {"parsed": parsed_value, "refusal": None}
