"""LLM API requests caught at the HTTP layer, read into what a LangChain chat-model call carries.

`parse_request` recognises a POST by its URL path and JSON body and returns a `WireCall`: the prompt as
LangChain messages (the same ones a LangChain chat model of that provider would be called with, so the
policy's chat template renders the same prompt ids), the bound tools in OpenAI function form, the
structured-output and length options under the names `_structured.output_spec` and the recorder read
(`tool_choice`, `response_format`, `max_tokens`), stop strings, `n`, and whether a stream was asked for.

Recognised (`SHAPES`: the path's end, then the body's keys):

- OpenAI Chat Completions: `.../chat/completions`, `model` and `messages` (also what LiteLLM, Azure OpenAI,
  Groq, Together, Mistral, OpenRouter and vLLM's OpenAI server speak).
- OpenAI Completions (legacy): `.../completions`, `model` and `prompt` (a string: the prompt is the text, no
  chat template; a fill-in-the-middle request, with `suffix`, is not served).
- OpenAI Responses: `.../responses`, `model` and `input`.
- Anthropic Messages: `.../v1/messages` (or `.../messages` with an `anthropic-version` header), `model`,
  `max_tokens` and `messages`; structured outputs (`output_config.format`, what
  `messages.parse(output_format=...)` sends) as `response_format` json_schema.

The body must carry every key the API requires (above), so that a POST to some other service whose path
happens to end the same way (an app's own `/api/v1/messages` history store) is no LLM call and is sent
untouched. A request to a known LLM API host (`LLM_HOSTS`) needs only the key its reader needs (`messages`,
`prompt`, `input`): that host serves nothing else under these paths.

The agent of a call may be named on the request: the header `X-Drmas-Agent` (any client: `extra_headers=`
on the OpenAI and Anthropic SDKs, `extra_headers`/`headers` in LiteLLM), or `metadata.drmas_agent` in an
OpenAI body. It has the precedence of `drmas_agent` run metadata (see `_routing`).

A request that uses what a policy cannot honour (images, audio, files) raises `ConfigError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage, convert_to_messages

from drmas_graph._chat import normalize_tools
from drmas_graph.errors import ConfigError

__all__ = ["WireCall", "CHAT", "COMPLETIONS", "RESPONSES", "ANTHROPIC", "AGENT_HEADER", "parse_request",
           "is_llm_url", "is_llm_request", "LLM_HOSTS", "UNSERVED_KEY", "Shape", "SHAPES", "tool_call"]

CHAT, COMPLETIONS, RESPONSES, ANTHROPIC = "openai.chat", "openai.completions", "openai.responses", "anthropic.messages"
AGENT_HEADER = "x-drmas-agent"
"""Request header naming the agent of a call (case-insensitive), like `drmas_agent` run metadata."""

UNSERVED_KEY = "unserved_calls"
"""`Episode.metadata` key: the LLM API requests of the episode that no policy served ({node, client, url,
refused}: refused in strict mode, else sent to the remote API with a warning)."""

LLM_HOSTS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com", "api.mistral.ai",
             "api.groq.com", "api.together.xyz", "openrouter.ai")
"""Hosts of LLM APIs: a request to one of them (or to `*.openai.azure.com`) inside an instrumented run is
served or refused, never sent silently, whatever its shape."""
LLM_HOST_SUFFIXES = (".openai.azure.com",)


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
    """What the answer needs besides the reply: `include_usage` (OpenAI stream usage chunk), `tool_choice`
    (Responses: echoed in its own form), `echo` (Completions: the prompt goes before the text)."""


def _split(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return (parts.hostname or "").lower(), parts.path.rstrip("/")


def is_llm_url(url: str) -> bool:
    """True for a URL on the host of a known LLM API (`LLM_HOSTS`, Azure OpenAI)."""
    host, _ = _split(url)
    return host in LLM_HOSTS or host.endswith(LLM_HOST_SUFFIXES)


def is_llm_request(url: str, headers: Mapping[str, str], body: bytes | None) -> bool:
    """True for an LLM API request, served or not: one to a known LLM API host (`is_llm_url`), or one shaped like
    an API of `SHAPES` in full (its path, every key the API requires). Any other request is not touched."""
    if is_llm_url(url):
        return True
    shape, data = _shape_of(url, headers), _json_object(body)
    return shape is not None and data is not None and shape.fits(data, known_host=False)


@dataclass(frozen=True)
class Shape:
    """How one API's requests are recognised and read (one row of `SHAPES`)."""

    protocol: str
    """`CHAT`, `COMPLETIONS`, `RESPONSES` or `ANTHROPIC`."""
    path: str
    """The end of the request's URL path."""
    header: str | None
    """A header the request must carry besides the path (lower case), or None."""
    reads: dict[str, type]
    """Body keys (and their JSON types) the reader needs: enough at a known LLM API host."""
    requires: dict[str, type]
    """The other body keys the API requires: a request to any other host must carry them too."""
    refuses: tuple[str, ...]
    """Body keys that make it another kind of request, not served (a fill-in-the-middle `suffix`)."""
    read: Callable[[dict, str | None, str], WireCall]
    """(body, agent named on the request, url) -> the call."""

    def fits(self, data: dict, known_host: bool) -> bool:
        """Whether the body is a request of this API (`known_host`: only the keys the reader needs)."""
        wanted = self.reads if known_host else {**self.reads, **self.requires}
        return (all(k in data and isinstance(data[k], t) and not (t is int and isinstance(data[k], bool))
                    for k, t in wanted.items())
                and not any(k in data for k in self.refuses))


def _shape_of(url: str, headers: Mapping[str, str]) -> Shape | None:
    """The first row of `SHAPES` whose path ends the URL's path (and whose header the request carries)."""
    _, path = _split(url)
    lower = {str(k).lower() for k in headers}
    return next((s for s in SHAPES if path.endswith(s.path) and (s.header is None or s.header in lower)), None)


def _json_object(body: bytes | None) -> dict | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def parse_request(method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> WireCall | None:
    """The request as a `WireCall`, or None when it is no LLM API request of `SHAPES` (see the module's doc)."""
    if method.upper() != "POST":
        return None
    shape, data = _shape_of(url, headers), _json_object(body)
    if shape is None or data is None or not shape.fits(data, is_llm_url(url)):
        return None
    agent = next((str(v) for k, v in headers.items() if str(k).lower() == AGENT_HEADER), None) or None
    return shape.read(data, agent, url)


def tool_call(name: str, arguments: Any, call_id: Any) -> dict:
    """A tool call as the APIs give it (OpenAI: `arguments` a JSON string; Anthropic: `input` an object) as a
    LangChain tool call, or as an invalid one (the arguments as given, and why they are not an object) when the
    arguments are not a JSON object: a reply cut by `max_tokens` inside a call, a malformed call handed back in a
    conversation. The API accepts those in a request, and LangChain's chat models keep them so."""
    args, error = {} if arguments is None else arguments, None
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments or "{}", strict=False)  # (as LangChain reads them: control characters too)
        except ValueError as exc:
            error = f"{type(exc).__name__}: {exc}"
    if error is None and not isinstance(args, dict):
        error = f"the arguments are a JSON {type(args).__name__}, not an object"
    if error is None:
        return {"name": name, "args": args, "id": call_id, "type": "tool_call"}
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"name": name, "args": raw, "id": call_id, "error": error, "type": "invalid_tool_call"}


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


def _chat(data: dict, agent: str | None, url: str) -> WireCall:
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
    calls = [tool_call(c["function"]["name"], c["function"].get("arguments"), c.get("id"))
             for c in message.get("tool_calls") or () if isinstance(c, dict) and "function" in c]
    if any(c["type"] != "tool_call" for c in calls):  # a malformed call handed back (LangChain's reader raises)
        return AIMessage(content=content or "", tool_calls=[c for c in calls if c["type"] == "tool_call"],
                         invalid_tool_calls=[c for c in calls if c["type"] != "tool_call"])
    if content is None:  # optional in the API (an assistant message with tool_calls), required by LangChain
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
                    options={"include_usage": bool((data.get("stream_options") or {}).get("include_usage")),
                             "echo": bool(data.get("echo"))})


# ---- OpenAI Responses ---------------------------------------------------------------------------------
def _responses(data: dict, agent: str | None, url: str) -> WireCall:
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
                    str(data.get("model", "")), _openai_agent(data, agent),
                    options={"tool_choice": data.get("tool_choice") or "auto"})  # echoed in the answer as sent


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
            call = tool_call(item["name"], item.get("arguments"), item.get("call_id"))
            valid, invalid = ([call], []) if call["type"] == "tool_call" else ([], [call])
            last = out[-1] if out else None
            if isinstance(last, AIMessage) and (last.tool_calls or last.invalid_tool_calls or not last.content):
                out[-1] = AIMessage(content=last.content, tool_calls=[*last.tool_calls, *valid],
                                    invalid_tool_calls=[*last.invalid_tool_calls, *invalid])
            else:
                out.append(AIMessage(content="", tool_calls=valid, invalid_tool_calls=invalid))
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # content parts (`input_text`; images and files are refused)
                kinds = sorted({str(p.get("type")) for p in output if isinstance(p, dict)} - {"input_text", "output_text"})
                if kinds:
                    raise ConfigError(f"responses: a function_call_output has parts of type {kinds}; a policy reads "
                                      "text only")
                output = "".join(str(p.get("text", "")) for p in output)
            out.append(ToolMessage(content=output if isinstance(output, str) else json.dumps(output),
                                   tool_call_id=str(item.get("call_id"))))
        elif kind == "reasoning":
            continue  # a reasoning model's summary: no part of the chat template's prompt
        else:
            raise ConfigError(f"responses: input item type {kind!r} cannot be read into a policy's prompt")
    return out


# ---- Anthropic Messages -------------------------------------------------------------------------------
def _anthropic(data: dict, agent: str | None, url: str) -> WireCall:
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
    fmt = (data.get("output_config") or {}).get("format") or data.get("output_format")  # (the beta's name)
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # structured outputs (`messages.parse`)
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "response",
                                                                            "schema": fmt.get("schema", {})}}
    elif fmt is not None:
        raise ConfigError(f"messages: output format {fmt!r} is not one drmas-graph serves (a json_schema one)")
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


SHAPES: tuple[Shape, ...] = (  # the first row whose path (and header) fits picks the API: chat before completions
    Shape(CHAT, "/chat/completions", None, {"messages": list}, {"model": str}, (), _chat),
    Shape(COMPLETIONS, "/completions", None, {"prompt": object}, {"model": str}, ("suffix",), _completions),
    Shape(RESPONSES, "/responses", None, {"input": object}, {"model": str}, (), _responses),
    Shape(ANTHROPIC, "/v1/messages", None, {"messages": list}, {"model": str, "max_tokens": int}, (), _anthropic),
    Shape(ANTHROPIC, "/messages", "anthropic-version", {"messages": list}, {"model": str, "max_tokens": int}, (),
          _anthropic),
)
"""The LLM API requests drmas-graph serves, by the end of their URL path."""
