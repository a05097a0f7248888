"""LLM API requests caught at the HTTP layer, read into what a LangChain chat-model call carries.

`parse_request` recognises a POST by its URL path and JSON body and returns a `WireCall`: the prompt as
LangChain messages (the same ones a LangChain chat model of that provider would be called with, so the
policy's chat template renders the same prompt ids), the bound tools in OpenAI function form, the
structured-output and length options under the names `_structured.output_spec` and the recorder read
(`tool_choice`, `response_format`, `max_tokens`), stop strings, `n`, and whether a stream was asked for.

Recognised (the path's end, and the body's key that the API requires):

- OpenAI Chat Completions: `.../chat/completions`, `messages` (also what LiteLLM, Azure OpenAI, Groq,
  Together, Mistral, OpenRouter and vLLM's OpenAI server speak).
- OpenAI Completions (legacy): `.../completions`, `prompt` (a string: the prompt is the text, no chat template).
- OpenAI Responses: `.../responses`, `input`.
- Anthropic Messages: `.../v1/messages` (or `.../messages` with an `anthropic-version` header), `messages`.

The agent of a call may be named on the request: the header `X-Drmas-Agent` (any client: `extra_headers=`
on the OpenAI and Anthropic SDKs, `extra_headers`/`headers` in LiteLLM), or `metadata.drmas_agent` in an
OpenAI body. It has the precedence of `drmas_agent` run metadata (see `_routing`).

A request that uses what a policy cannot honour (images, audio, files) raises `ConfigError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage, convert_to_messages

from drmas_graph._chat import normalize_tools
from drmas_graph.errors import ConfigError

__all__ = ["WireCall", "CHAT", "COMPLETIONS", "RESPONSES", "ANTHROPIC", "AGENT_HEADER", "parse_request",
           "is_llm_url", "LLM_HOSTS", "UNSERVED_KEY"]

CHAT, COMPLETIONS, RESPONSES, ANTHROPIC = "openai.chat", "openai.completions", "openai.responses", "anthropic.messages"
AGENT_HEADER = "x-drmas-agent"
"""Request header naming the agent of a call (case-insensitive), like `drmas_agent` run metadata."""

UNSERVED_KEY = "unserved_calls"
"""`Episode.metadata` key: the LLM API requests of the episode that no policy served ({node, client, url,
refused}: refused in strict mode, else sent to the remote API with a warning)."""

LLM_HOSTS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com", "api.mistral.ai",
             "api.groq.com", "api.together.xyz", "openrouter.ai")
"""Hosts of LLM APIs: a request to one of them inside an instrumented run is served or refused, never sent
silently; so is one to `*.openai.azure.com` or to a path in `LLM_PATHS`."""
LLM_HOST_SUFFIXES = (".openai.azure.com",)
LLM_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


@dataclass(frozen=True)
class WireCall:
    """One LLM API request, as a chat-model call."""

    protocol: str
    """`CHAT`, `COMPLETIONS`, `RESPONSES` or `ANTHROPIC`: also the protocol of the answer."""
    messages: list[BaseMessage]
    """The prompt as LangChain messages."""
    tools: list[dict]
    """Tool schemas, OpenAI function form."""
    kwargs: dict[str, Any]
    """`tool_choice`, `response_format`, `max_tokens`: the request's own values where it set them."""
    stop: list[str] | None
    """Stop strings."""
    n: int
    """Number of choices asked for (each is one served call, one Turn)."""
    stream: bool
    """The client asked for a server-sent event stream."""
    model: str
    """The model name the client asked for (echoed in the answer)."""
    agent: str | None = None
    """The agent named on the request (header or metadata), if any."""
    prompt: str | None = None
    """Legacy Completions only: the prompt text, encoded as is (no chat template)."""
    options: dict[str, Any] = field(default_factory=dict)
    """What the answer needs besides the reply: `include_usage` (OpenAI stream usage chunk)."""


def _split(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.path.rstrip("/")


def is_llm_url(url: str) -> bool:
    """True for a URL of a known LLM API (a host in `LLM_HOSTS`, Azure OpenAI, or an `LLM_PATHS` path)."""
    host, path = _split(url)
    return (host in LLM_HOSTS or host.endswith(LLM_HOST_SUFFIXES)
            or any(path.endswith(p) for p in LLM_PATHS))


def parse_request(method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> WireCall | None:
    """The request as a `WireCall`, or None when it is no LLM API request this module recognises."""
    if method.upper() != "POST" or not body:
        return None
    host, path = _split(url)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    lower = {str(k).lower(): str(v) for k, v in headers.items()}
    agent = lower.get(AGENT_HEADER) or None
    if path.endswith("/chat/completions") and isinstance(data.get("messages"), list):
        return _chat(data, agent)
    if path.endswith("/completions") and "prompt" in data and "suffix" not in data:  # (a fill-in-the-middle
        # request, `suffix`, is no prompt-in text-out call: unserved)
        return _completions(data, agent, url)
    if path.endswith("/responses") and "input" in data:
        return _responses(data, agent)
    anthropic = path.endswith("/v1/messages") or (path.endswith("/messages") and (
        "anthropic-version" in lower or host == "api.anthropic.com"))
    if anthropic and isinstance(data.get("messages"), list):
        return _anthropic(data, agent)
    return None


def _stops(value: Any) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else [str(s) for s in value] or None


def _openai_agent(data: dict, agent: str | None) -> str | None:
    meta = data.get("metadata")
    return agent or (str(meta["drmas_agent"]) if isinstance(meta, dict) and meta.get("drmas_agent") else None)


def _max_tokens(*values: Any) -> dict[str, Any]:
    found = next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)
    return {} if found is None else {"max_tokens": found}


def _chat(data: dict, agent: str | None) -> WireCall:
    messages = [_check_content(m, "chat.completions") for m in data["messages"]]
    tools = [t for t in data.get("tools") or () if isinstance(t, dict)]
    kwargs: dict[str, Any] = _max_tokens(data.get("max_completion_tokens"), data.get("max_tokens"))
    for key in ("tool_choice", "response_format"):
        if data.get(key) is not None:
            kwargs[key] = data[key]
    if data.get("functions"):  # the deprecated form of tools
        tools += [{"type": "function", "function": f} for f in data["functions"]]
    options = {"include_usage": bool((data.get("stream_options") or {}).get("include_usage"))}
    return WireCall(CHAT, convert_to_messages(messages), normalize_tools(tools), kwargs, _stops(data.get("stop")),
                    int(data.get("n") or 1), bool(data.get("stream")), str(data.get("model", "")),
                    _openai_agent(data, agent), options=options)


def _check_content(message: Any, api: str) -> Any:
    """An OpenAI message whose content a policy can read (text parts); media parts are refused by name."""
    if not isinstance(message, dict):
        raise ConfigError(f"{api}: a message is a {type(message).__name__}, not an object")
    content = message.get("content")
    if isinstance(content, list):
        kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - {"text"})
        if kinds:
            raise ConfigError(f"{api}: a {message.get('role')!r} message has content parts of type {kinds}; a "
                              "policy reads text only. Send text parts, or keep this call on the app's own model "
                              "(drmas_graph.app_models()).")
    if message.get("role") == "function":  # the deprecated form of a tool result
        return {"role": "tool", "content": content or "", "tool_call_id": message.get("name", "")}
    if message.get("role") == "assistant" and content is None:  # the API makes it optional next to tool_calls
        return {**message, "content": ""}
    return message


def _completions(data: dict, agent: str | None, url: str) -> WireCall:
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ConfigError(f"completions ({url}): the prompt is a {type(prompt).__name__}; a policy serves one "
                          "prompt string per request (send token ids to a policy's own server outside the run)")
    return WireCall(COMPLETIONS, [HumanMessage(prompt)], [], _max_tokens(data.get("max_tokens")),
                    _stops(data.get("stop")), int(data.get("n") or 1), bool(data.get("stream")),
                    str(data.get("model", "")), _openai_agent(data, agent), prompt=prompt,
                    options={"include_usage": bool((data.get("stream_options") or {}).get("include_usage"))})


# ---- OpenAI Responses ---------------------------------------------------------------------------------
def _responses(data: dict, agent: str | None) -> WireCall:
    for key in ("previous_response_id", "conversation", "prompt"):
        if data.get(key):
            raise ConfigError(f"responses: {key}={data[key]!r} refers to state stored on OpenAI's servers, which a "
                              "policy does not have; send the whole conversation in `input` instead")
    messages: list[BaseMessage] = []
    if data.get("instructions"):
        messages.append(SystemMessage(str(data["instructions"])))
    items = data["input"]
    messages += [HumanMessage(items)] if isinstance(items, str) else _response_items(items)
    tools = []
    for t in data.get("tools") or ():
        if t.get("type") != "function":
            raise ConfigError(f"responses: tool type {t.get('type')!r} (a hosted tool) cannot run on a policy; "
                              "only function tools can")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                       if k in t}})
    kwargs: dict[str, Any] = _max_tokens(data.get("max_output_tokens"))
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        kwargs["tool_choice"] = choice
    fmt = (data.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                                            "schema": fmt.get("schema", {})}}
    elif fmt is not None:
        kwargs["response_format"] = fmt
    return WireCall(RESPONSES, messages, normalize_tools(tools), kwargs, None, 1, bool(data.get("stream")),
                    str(data.get("model", "")), _openai_agent(data, agent))


def _response_items(items: list) -> list[BaseMessage]:
    out: list[BaseMessage] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                kinds = sorted({str(p.get("type")) for p in content} - {"input_text", "output_text", "text"})
                if kinds:
                    raise ConfigError(f"responses: input parts of type {kinds}; a policy reads text only")
                content = "".join(str(p.get("text", "")) for p in content)
            out.extend(convert_to_messages([{"role": item.get("role", "user"), "content": content or ""}]))
        elif kind == "function_call":
            call = {"name": item["name"], "args": json.loads(item.get("arguments") or "{}"),
                    "id": item.get("call_id"), "type": "tool_call"}
            last = out[-1] if out else None
            if isinstance(last, AIMessage) and (last.tool_calls or not last.content):
                out[-1] = AIMessage(content=last.content, tool_calls=[*last.tool_calls, call])
            else:
                out.append(AIMessage(content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(ToolMessage(content=output if isinstance(output, str) else json.dumps(output),
                                   tool_call_id=str(item.get("call_id"))))
        elif kind == "reasoning":
            continue  # a reasoning model's summary: no part of the chat template's prompt
        else:
            raise ConfigError(f"responses: input item type {kind!r} cannot be read into a policy's prompt")
    return out


# ---- Anthropic Messages -------------------------------------------------------------------------------
def _anthropic(data: dict, agent: str | None) -> WireCall:
    messages: list[BaseMessage] = []
    system = data.get("system")
    if system:
        messages.append(SystemMessage(system if isinstance(system, str) else _blocks_text(system, "system")))
    for m in data["messages"]:
        messages += _anthropic_message(m)
    tools = []
    for t in data.get("tools") or ():
        if "input_schema" not in t:
            raise ConfigError(f"messages: tool {t.get('name')!r} of type {t.get('type')!r} (a server tool) cannot "
                              "run on a policy; only custom tools (name, input_schema) can")
        tools.append(t)
    kwargs: dict[str, Any] = _max_tokens(data.get("max_tokens"))
    if data.get("tool_choice") is not None:
        kwargs["tool_choice"] = data["tool_choice"]
    return WireCall(ANTHROPIC, messages, normalize_tools(tools), kwargs, _stops(data.get("stop_sequences")), 1,
                    bool(data.get("stream")), str(data.get("model", "")), agent)


def _blocks_text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    kinds = sorted({str(b.get("type")) for b in blocks} - {"text"})
    if kinds:
        raise ConfigError(f"messages: {where} content blocks of type {kinds}; a policy reads text only")
    return "".join(str(b.get("text", "")) for b in blocks)


def _anthropic_message(message: dict) -> list[BaseMessage]:
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str):
        return [AIMessage(content) if role == "assistant" else HumanMessage(content)]
    if role == "assistant":
        text = "".join(str(b.get("text", "")) for b in content if b.get("type") == "text")
        calls = [{"name": b["name"], "args": dict(b.get("input") or {}), "id": b.get("id"), "type": "tool_call"}
                 for b in content if b.get("type") == "tool_use"]
        other = sorted({str(b.get("type")) for b in content} - {"text", "tool_use", "thinking", "redacted_thinking"})
        if other:
            raise ConfigError(f"messages: assistant content blocks of type {other} cannot be read into a prompt")
        return [AIMessage(content=text, tool_calls=calls)]
    out: list[BaseMessage] = []
    text: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind == "tool_result":
            result = block.get("content")
            out.append(ToolMessage(content=_blocks_text(result or "", "tool_result"),
                                   tool_call_id=str(block.get("tool_use_id")), status="error" if block.get(
                                       "is_error") else "success"))
        elif kind == "text":
            text.append(str(block.get("text", "")))
        else:
            raise ConfigError(f"messages: user content block of type {kind!r}; a policy reads text only")
    if text:
        out.append(HumanMessage("".join(text)))
    return out
