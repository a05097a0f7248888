"""The client dimension of the generated apps (issue 47): a call site's call made through the OpenAI SDK at its
default base URL instead of the app's LangChain model, as plain, structured (response_format json_schema, or a
forced tool call) or streamed requests. Like `apps`, it never imports drmas_graph: a request the instrumentation
did not serve would go to api.openai.com and fail the run."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import SystemMessage
from pydantic import BaseModel

__all__ = ["ask_sdk"]

_SDK: list[Any] = []


def ask_sdk(call: Any, messages: list, schemas: dict[str, type[BaseModel]]) -> str:
    """The call through the OpenAI SDK (sync, or streamed and put together from its chunks)."""
    import openai

    if not _SDK:
        _SDK.append(openai.OpenAI(api_key="sk-never-sent", max_retries=0, timeout=5))
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [
        {"role": "system" if isinstance(m, SystemMessage) else "user", "content": m.content} for m in messages]}
    schema = schemas[call.schema] if call.kind == "structured" else None
    if schema is not None and call.method == "tool":
        body["tools"] = [{"type": "function", "function": {"name": schema.__name__,
                                                           "parameters": schema.model_json_schema()}}]
        body["tool_choice"] = {"type": "function", "function": {"name": schema.__name__}}
    elif schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": schema.__name__,
                                                                          "schema": schema.model_json_schema()}}
    if call.client == "openai":
        message = _SDK[0].chat.completions.create(**body).choices[0].message
        content = message.content or ""
        arguments = message.tool_calls[0].function.arguments if message.tool_calls else ""
    else:
        content, arguments = "", ""
        for chunk in _SDK[0].chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                arguments += "".join(t.function.arguments or "" for t in choice.delta.tool_calls or ())
    if schema is None:
        return content
    raw = arguments if call.method == "tool" else content
    return json.dumps(schema.model_validate_json(raw).model_dump(), sort_keys=True)
