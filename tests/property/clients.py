"""The client dimension of the generated apps (issue 47 item 6): a call site's call made, instead of through the
app's LangChain model, through

- the OpenAI SDK at its default base URL: sync, async (`AsyncOpenAI` under `asyncio.run`), streamed;
- the Anthropic SDK's `messages.create`: sync, async, and `messages.stream`;
- LiteLLM's `completion` and `acompletion`;
- a raw `httpx` POST to a `/v1/chat/completions` URL on 127.0.0.1 (recognised by its path; port 1, where
  nothing listens);
- the run-scoped local endpoint: the OpenAI SDK pointed at `ENDPOINT[0]()` (the test puts
  `drmas_graph.llm_base_url` there; the URL's port is noted in `ENDPOINT_PORTS`, the one connect the tests'
  network guard lets through).

A plain call sends the site's messages; a structured one asks for the schema the way each API does: a forced
tool call (OpenAI `tool_choice`, Anthropic `tool_choice={"type": "tool"}`, the only structured form Anthropic
has here) or an OpenAI `response_format` json_schema. Like `apps`, this module never imports drmas_graph: a
request the instrumentation did not serve goes to the network, which the tests refuse and count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any
from urllib.parse import urlsplit

from langchain_core.messages import SystemMessage
from pydantic import BaseModel

__all__ = ["CLIENTS", "ENDPOINT", "ENDPOINT_PORTS", "RAW_URL", "ask_sdk"]

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its price list at import

CLIENTS = ("langchain", "openai", "openai-stream", "openai-async", "anthropic", "anthropic-async",
           "anthropic-stream", "litellm", "litellm-async", "httpx", "endpoint")
"""Where a call site's calls go: the app's LangChain model, or one of the clients above."""
RAW_URL = "http://127.0.0.1:1/v1/chat/completions"
ENDPOINT: list[Any] = []
"""[the function giving this node's local endpoint base URL] (`drmas_graph.llm_base_url`, put here by the test)."""
ENDPOINT_PORTS: set[int] = set()
"""Ports of the local endpoint URLs handed out (the network guard's only allowed connect)."""
KEYS = {"api_key": "sk-never-sent", "max_retries": 0, "timeout": 5}
_SDKS: dict[str, Any] = {}


def _sdk(kind: str) -> Any:
    """One SDK client of each kind per process (a client's SSL setup costs ~0.1 s). The async ones serve
    `asyncio.run` after `asyncio.run`: a served request opens no connection, so their pools stay empty."""
    if kind not in _SDKS:
        import anthropic
        import openai

        _SDKS[kind] = {"openai": openai.OpenAI, "openai-async": openai.AsyncOpenAI, "anthropic": anthropic.Anthropic,
                       "anthropic-async": anthropic.AsyncAnthropic}[kind](**KEYS)
    return _SDKS[kind]


def ask_sdk(call: Any, messages: list, schemas: dict[str, type[BaseModel]]) -> str:
    """The call site's call through `call.client`; a structured answer comes back as its sorted JSON."""
    system = next(m.content for m in messages if isinstance(m, SystemMessage))
    turns = [{"role": "user", "content": m.content} for m in messages if not isinstance(m, SystemMessage)]
    schema = schemas[call.schema] if call.kind == "structured" else None
    if call.client.startswith("anthropic"):
        content, arguments = _anthropic(call.client, system, turns, schema)
        tool = True
    else:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": system}, *turns]}
        tool = schema is not None and call.method == "tool"
        if tool:
            body["tools"] = [{"type": "function", "function": {"name": schema.__name__,
                                                               "parameters": schema.model_json_schema()}}]
            body["tool_choice"] = {"type": "function", "function": {"name": schema.__name__}}
        elif schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": schema.__name__,
                                                                              "schema": schema.model_json_schema()}}
        content, arguments = _openai_like(call.client, body)
    if schema is None:
        return content
    return json.dumps(schema.model_validate_json(arguments if tool else content).model_dump(), sort_keys=True)


def _openai_like(client: str, body: dict) -> tuple[str, str]:
    """(content, the first tool call's arguments) of a Chat Completions call through `client`."""
    if client == "openai-stream":
        content, arguments = "", ""
        for chunk in _sdk("openai").chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                arguments += "".join(t.function.arguments or "" for t in choice.delta.tool_calls or ())
        return content, arguments
    if client == "openai-async":
        return _message(asyncio.run(_sdk("openai-async").chat.completions.create(**body)).choices[0].message)
    if client in ("litellm", "litellm-async"):
        import litellm

        # its logging worker warns at each new event loop (asyncio.run per call): noise here, not a finding
        logging.getLogger("LiteLLM").setLevel(logging.ERROR)
        if client == "litellm":
            return _message(litellm.completion(**body, num_retries=0, api_key=KEYS["api_key"]).choices[0].message)
        reply = asyncio.run(litellm.acompletion(**body, num_retries=0, api_key=KEYS["api_key"]))
        return _message(reply.choices[0].message)
    if client == "httpx":
        import httpx

        response = httpx.post(RAW_URL, json=body, headers={"authorization": "Bearer sk-never-sent"}, timeout=5)
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        return message.get("content") or "", calls[0]["function"]["arguments"] if calls else ""
    if client == "endpoint":
        url = ENDPOINT[0]()
        ENDPOINT_PORTS.add(urlsplit(url).port)
        sdk = _sdk("openai").with_options(base_url=url)
        return _message(sdk.chat.completions.create(**body).choices[0].message)
    assert client == "openai", f"unknown client {client!r}; known: {CLIENTS}"
    return _message(_sdk("openai").chat.completions.create(**body).choices[0].message)


def _message(message: Any) -> tuple[str, str]:
    calls = message.tool_calls or []
    return message.content or "", calls[0].function.arguments if calls else ""


def _anthropic(client: str, system: str, turns: list[dict], schema: type[BaseModel] | None) -> tuple[str, str]:
    """(text, the forced tool call's input as JSON) of a Messages call through the Anthropic SDK."""
    body: dict[str, Any] = {"model": "claude-3-5-haiku-latest", "max_tokens": 256, "system": system,
                            "messages": turns}
    if schema is not None:
        body["tools"] = [{"name": schema.__name__, "description": f"Answer as {schema.__name__}.",
                          "input_schema": schema.model_json_schema()}]
        body["tool_choice"] = {"type": "tool", "name": schema.__name__}
    if client == "anthropic":
        message = _sdk("anthropic").messages.create(**body)
    elif client == "anthropic-async":
        message = asyncio.run(_sdk("anthropic-async").messages.create(**body))
    else:
        with _sdk("anthropic").messages.stream(**body) as stream:
            message = stream.get_final_message()
    text = "".join(b.text for b in message.content if b.type == "text")
    used = [b.input for b in message.content if b.type == "tool_use"]
    return text, json.dumps(used[0]) if used else ""
