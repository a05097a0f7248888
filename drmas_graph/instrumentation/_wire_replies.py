"""Answers in the client's own protocol, and real API answers read back into messages.

`encode` turns the `AIMessage`s the call handler returned (one per choice) into the body the client's SDK
parses: a JSON object, or, for a request with `stream: true`, a server-sent event stream that an SDK's
stream accumulator rebuilds into the same message (OpenAI chunks with content and tool-call deltas and an
optional usage chunk; the Responses API's typed events; Anthropic's `message_start` ... `message_stop`).
Usage counts are the prompt's and the reply's token counts (the message's `usage_metadata`). A tool call of the
reply that did not parse (`invalid_tool_calls`) is handed over as an API hands over a call whose arguments are
not valid JSON: a tool call (a Responses `function_call`) with the arguments as the model wrote them and finish
reason "tool_calls"; Anthropic's `tool_use` block, whose `input` is always an object, gets the arguments read as
far as they go (`_anthropic_input`), its stream the text as written.

`decode` reads a real API's answer (JSON or event stream) into the `AIMessage` of each choice: what the
Turn of a call answered by the app's own model (an agent without a policy) records. It never fails the call: a
tool call whose arguments are not a JSON object (a reply cut by `max_tokens`) is one of `invalid_tool_calls`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pydantic_core

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from drmas_graph._chat import _text
from drmas_graph.instrumentation._wire import ANTHROPIC, CHAT, COMPLETIONS, RESPONSES, WireCall, tool_call

__all__ = ["encode", "decode", "JSON", "SSE"]

JSON, SSE = "application/json", "text/event-stream"

_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
"""A turn's finish reason (OpenAI's words, which every Turn uses) -> Anthropic's `stop_reason`."""
_FROM_ANTHROPIC = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                   "refusal": "content_filter", "pause_turn": "stop"}
"""A real Anthropic answer's `stop_reason` -> the turn's finish reason (replay maps it back)."""


def _usage(messages: list[AIMessage]) -> tuple[int, int]:
    """(prompt tokens, completion tokens over all choices)."""
    prompt = max((int((m.usage_metadata or {}).get("input_tokens", 0)) for m in messages), default=0)
    return prompt, sum(int((m.usage_metadata or {}).get("output_tokens", 0)) for m in messages)


def _finish(message: AIMessage) -> str:
    """The answer's finish reason: the turn's, and "tool_calls" for a reply whose only calls did not parse (an API
    ends a reply that makes a call so, whatever its arguments)."""
    finish = str((message.response_metadata or {}).get("finish_reason") or "stop")
    return "tool_calls" if finish == "stop" and message.invalid_tool_calls else finish


def _id(message: AIMessage, prefix: str) -> str:
    return prefix + (message.id or uuid.uuid4().hex)


def _calls(message: AIMessage) -> list[tuple[str | None, str, str, dict | None]]:
    """(id, name, arguments as JSON text, arguments as an object) of each tool call of `message`: the calls that
    parsed, then those that did not (`invalid_tool_calls`: the arguments as the model wrote them, no object, and
    the name "" when it could not be read), which an API hands over the same way, arguments as generated."""
    return ([(c.get("id"), c["name"], json.dumps(c.get("args") or {}), dict(c.get("args") or {}))
             for c in message.tool_calls]
            + [(c.get("id"), c.get("name") or "", str(c.get("args") or ""), None) for c in message.invalid_tool_calls])


def encode(call: WireCall, results: list[ChatResult]) -> tuple[str, bytes]:
    """(content type, body) of the answer to `call` made of the handler's `results` (one per choice)."""
    messages = [r.generations[0].message for r in results]
    if call.protocol == ANTHROPIC:  # the request's stop sequence the reply ended at, if any
        hits = [(r.generations[0].generation_info or {}).get("stop_sequence") for r in results]
        messages = [m.model_copy(update={"response_metadata": {**m.response_metadata, "stop_sequence": hit}})
                    if hit in (call.stop or ()) else m for m, hit in zip(messages, hits)]
    if call.protocol == COMPLETIONS:  # text out as generated (a chat reply's content is stripped, tools parsed)
        echo = call.prompt if call.options.get("echo") else ""  # `echo: true`: the prompt, then the completion
        messages = [m.model_copy(update={"content": echo + (r.generations[0].generation_info or {}).get("text", m.content)})
                    for m, r in zip(messages, results)]
    encoder = {CHAT: _chat, COMPLETIONS: _completions, RESPONSES: _responses, ANTHROPIC: _anthropic}[call.protocol]
    if not call.stream:
        return JSON, json.dumps(encoder(call, messages)).encode()
    events = {CHAT: _chat_events, COMPLETIONS: _completion_events, RESPONSES: _response_events,
              ANTHROPIC: _anthropic_events}[call.protocol](call, messages)
    return SSE, "".join(_sse(kind, data) for kind, data in events).encode()


def _sse(kind: str | None, data: Any) -> str:
    head = f"event: {kind}\n" if kind else ""
    return head + "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"


# ---- OpenAI Chat Completions ---------------------------------------------------------------------------
def _chat_message(message: AIMessage) -> dict:
    out: dict[str, Any] = {"role": "assistant", "content": _text(message.content), "refusal": None}
    calls = _calls(message)
    if calls:
        out["content"] = out["content"] or None
        out["tool_calls"] = [{"id": call_id or f"call_{j}", "type": "function",
                              "function": {"name": name, "arguments": arguments}}
                             for j, (call_id, name, arguments, _) in enumerate(calls)]
    return out


def _chat(call: WireCall, messages: list[AIMessage]) -> dict:
    prompt, completion = _usage(messages)
    return {"id": _id(messages[0], "chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": call.model, "system_fingerprint": None,
            "choices": [{"index": i, "message": _chat_message(m), "finish_reason": _finish(m), "logprobs": None}
                        for i, m in enumerate(messages)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _chat_events(call: WireCall, messages: list[AIMessage]) -> Iterator[tuple[None, Any]]:
    head = {"id": _id(messages[0], "chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": call.model, "system_fingerprint": None}

    def chunk(i: int, delta: dict, finish: str | None = None) -> tuple[None, dict]:
        return None, {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    for i, m in enumerate(messages):
        yield chunk(i, {"role": "assistant", "content": ""})
        text = _text(m.content)
        if text:
            yield chunk(i, {"content": text})
        for j, (call_id, name, arguments, _) in enumerate(_calls(m)):
            yield chunk(i, {"tool_calls": [{"index": j, "id": call_id or f"call_{j}", "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            yield chunk(i, {"tool_calls": [{"index": j, "function": {"arguments": arguments}}]})
        yield chunk(i, {}, _finish(m))
    if call.options.get("include_usage"):
        prompt, completion = _usage(messages)
        yield None, {**head, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                      "total_tokens": prompt + completion}}
    yield None, "[DONE]"


# ---- OpenAI Completions (legacy) ---------------------------------------------------------------------
def _completions(call: WireCall, messages: list[AIMessage]) -> dict:
    prompt, completion = _usage(messages)
    return {"id": _id(messages[0], "cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": call.model, "system_fingerprint": None,
            "choices": [{"index": i, "text": _text(m.content), "finish_reason": _finish(m), "logprobs": None}
                        for i, m in enumerate(messages)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _completion_events(call: WireCall, messages: list[AIMessage]) -> Iterator[tuple[None, Any]]:
    head = {"id": _id(messages[0], "cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": call.model}
    for i, m in enumerate(messages):
        yield None, {**head, "choices": [{"index": i, "text": _text(m.content), "finish_reason": None,
                                          "logprobs": None}]}
        yield None, {**head, "choices": [{"index": i, "text": "", "finish_reason": _finish(m), "logprobs": None}]}
    if call.options.get("include_usage"):
        prompt, completion = _usage(messages)
        yield None, {**head, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                      "total_tokens": prompt + completion}}
    yield None, "[DONE]"


# ---- OpenAI Responses ----------------------------------------------------------------------------------
def _response_output(message: AIMessage) -> list[dict]:
    out: list[dict] = []
    text, calls = _text(message.content), _calls(message)
    if text or not calls:
        out.append({"type": "message", "id": _id(message, "msg_"), "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    for j, (call_id, name, arguments, _) in enumerate(calls):
        out.append({"type": "function_call", "id": f"fc_{j}_{message.id or ''}", "call_id": call_id or f"call_{j}",
                    "name": name, "arguments": arguments, "status": "completed"})
    return out


def _responses(call: WireCall, messages: list[AIMessage], status: str = "completed") -> dict:
    message = messages[0]
    prompt, completion = _usage(messages)
    incomplete = _finish(message) == "length"
    return {"id": _id(message, "resp_"), "object": "response", "created_at": int(time.time()), "model": call.model,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "output": _response_output(message) if status == "completed" else [],
            "parallel_tool_calls": True, "tool_choice": call.options.get("tool_choice", "auto"),
            "tools": [{"type": "function", **t["function"]} for t in call.tools], "instructions": None,
            "metadata": {}, "temperature": None, "top_p": None, "text": {"format": {"type": "text"}},
            "usage": None if status != "completed" else {  # (none while in progress, as the API sends it)
                "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}}


def _response_events(call: WireCall, messages: list[AIMessage]) -> Iterator[tuple[str, Any]]:
    seq = iter(range(1_000_000))

    def event(kind: str, **data: Any) -> tuple[str, dict]:
        return kind, {"type": kind, "sequence_number": next(seq), **data}

    final = _responses(call, messages)
    yield event("response.created", response=_responses(call, messages, "in_progress"))
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                                 "content": []})
            part = item["content"][0]
            yield event("response.content_part.added", output_index=index, item_id=item["id"], content_index=0,
                        part={**part, "text": ""})
            yield event("response.output_text.delta", output_index=index, item_id=item["id"], content_index=0,
                        delta=part["text"], logprobs=[])
            yield event("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", output_index=index, item_id=item["id"], content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
            yield event("response.function_call_arguments.delta", output_index=index, item_id=item["id"],
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


# ---- Anthropic Messages --------------------------------------------------------------------------------
def _anthropic_blocks(message: AIMessage) -> list[dict]:
    text, calls = _text(message.content), _calls(message)
    blocks: list[dict] = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [{"type": "tool_use", "id": call_id or f"toolu_{j}", "name": name,
                      "input": args if args is not None else _anthropic_input(arguments)}
                     for j, (call_id, name, arguments, args) in enumerate(calls)]


def _anthropic_input(arguments: str) -> dict:
    """A `tool_use` block's `input` for a call whose arguments did not parse. Anthropic's API always gives an
    object: here the arguments read as far as they go, as the Anthropic SDK reads a streamed tool input (a call
    cut off by `max_tokens`: its complete keys), and `{}` for arguments that do not read even so. The answer's
    event stream (`stream: true`) carries the text as the model wrote it, on which the SDK's stream reader fails
    by name ("Unable to parse tool parameter JSON from model"); the Turn records the call (`format_error`)."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _anthropic(call: WireCall, messages: list[AIMessage]) -> dict:
    message = messages[0]
    prompt, completion = _usage(messages)
    stop = _ANTHROPIC_STOP.get(_finish(message), "end_turn")
    hit = message.response_metadata.get("stop_sequence")
    if stop == "end_turn" and hit:
        stop = "stop_sequence"
    return {"id": _id(message, "msg_"), "type": "message", "role": "assistant", "model": call.model,
            "content": _anthropic_blocks(message), "stop_reason": stop,
            "stop_sequence": hit if stop == "stop_sequence" else None,
            "usage": {"input_tokens": prompt, "output_tokens": completion}}


def _anthropic_events(call: WireCall, messages: list[AIMessage]) -> Iterator[tuple[str, Any]]:
    final = _anthropic(call, messages)
    written = iter([arguments for _, _, arguments, _ in _calls(messages[0])])  # streamed as the model wrote them
    start = {**final, "content": [], "stop_reason": None, "usage": {**final["usage"], "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(final["content"]):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {"type": "text", "text": ""}}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "text_delta", "text": block["text"]}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": "input_json_delta", "partial_json": next(written)}}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                                                               "stop_sequence": final["stop_sequence"]},
                            "usage": {"output_tokens": final["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


# ---- reading a real API's answer ------------------------------------------------------------------------
def decode(call: WireCall, content_type: str, body: bytes) -> list[ChatResult]:
    """The answer of the app's own model (a real API) as one ChatResult per choice. A tool call whose arguments
    are not a JSON object (a reply cut by `max_tokens` inside a call) is kept, as the API sent it, in the
    message's `invalid_tool_calls`, as LangChain's own chat models keep one."""
    if call.stream or SSE in content_type:
        events = _parse_sse(body)
        parts = _decode_events(call, events)
    else:
        parts = _decode_json(call, json.loads(body))
    return [ChatResult(generations=[ChatGeneration(message=_decoded(text, calls, finish))])
            for text, calls, finish in parts] or [ChatResult(generations=[ChatGeneration(message=AIMessage(""))])]


def _decoded(text: str, calls: list[dict], finish: str) -> AIMessage:
    valid, invalid = [], []
    for c in calls:
        (valid if c["type"] == "tool_call" else invalid).append(c)
    return AIMessage(content=text, tool_calls=valid, invalid_tool_calls=invalid,
                     response_metadata={"finish_reason": finish})


def _decode_json(call: WireCall, data: dict) -> list[tuple[str, list, str]]:
    if call.protocol == CHAT:
        return [(c["message"].get("content") or "",
                 [tool_call(t["function"]["name"], t["function"].get("arguments"), t.get("id"))
                  for t in c["message"].get("tool_calls") or ()], c.get("finish_reason") or "stop")
                for c in data.get("choices") or ()]
    if call.protocol == COMPLETIONS:
        return [(c.get("text") or "", [], c.get("finish_reason") or "stop") for c in data.get("choices") or ()]
    if call.protocol == RESPONSES:
        text = "".join(p.get("text", "") for o in data.get("output") or () if o.get("type") == "message"
                       for p in o.get("content") or ())
        calls = [tool_call(o["name"], o.get("arguments"), o.get("call_id")) for o in data.get("output") or ()
                 if o.get("type") == "function_call"]
        finish = "length" if data.get("status") == "incomplete" else "tool_calls" if calls else "stop"
        return [(text, calls, finish)]
    text = "".join(b.get("text", "") for b in data.get("content") or () if b.get("type") == "text")
    calls = [tool_call(b["name"], b.get("input"), b.get("id")) for b in data.get("content") or () if b.get("type") == "tool_use"]
    return [(text, calls, _FROM_ANTHROPIC.get(str(data.get("stop_reason")), "stop"))]


def _parse_sse(body: bytes) -> list[dict]:
    events = []
    for block in body.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].lstrip() for line in block.split("\n") if line.startswith("data:"))
        if data and data != "[DONE]":
            try:
                events.append(json.loads(data))
            except ValueError:
                continue  # a keep-alive comment or a partial line: no part of a message
    return events


def _decode_events(call: WireCall, events: list[dict]) -> list[tuple[str, list, str]]:
    if call.protocol == RESPONSES:
        done = [e["response"] for e in events if e.get("type") in ("response.completed", "response.incomplete")]
        return _decode_json(call, done[-1]) if done else []
    if call.protocol == ANTHROPIC:
        text, calls, finish, args = [], [], "stop", {}
        for e in events:
            kind = e.get("type")
            if kind == "content_block_start" and e["content_block"].get("type") == "tool_use":
                calls.append(dict(e["content_block"]))
                args[e["index"]] = (len(calls) - 1, [])
            elif kind == "content_block_delta" and e["delta"].get("type") == "text_delta":
                text.append(e["delta"]["text"])
            elif kind == "content_block_delta" and e["delta"].get("type") == "input_json_delta":
                args[e["index"]][1].append(e["delta"]["partial_json"])
            elif kind == "message_delta" and e["delta"].get("stop_reason"):
                finish = _FROM_ANTHROPIC.get(e["delta"]["stop_reason"], "stop")
        for position, pieces in args.values():
            calls[position]["input"] = "".join(pieces) or "{}"
        return [("".join(text), [tool_call(c["name"], c["input"], c.get("id")) for c in calls], finish)]
    choices: dict[int, dict] = {}
    for e in events:
        for c in e.get("choices") or ():
            slot = choices.setdefault(c.get("index", 0), {"text": [], "calls": {}, "finish": "stop"})
            delta = c.get("delta") or {}
            slot["text"].append(delta.get("content") or c.get("text") or "")
            for t in delta.get("tool_calls") or ():
                entry = slot["calls"].setdefault(t.get("index", 0), {"id": None, "name": "", "arguments": []})
                entry["id"] = t.get("id") or entry["id"]
                function = t.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"].append(function.get("arguments") or "")
            slot["finish"] = c.get("finish_reason") or slot["finish"]
    return [("".join(s["text"]), [tool_call(t["name"], "".join(t["arguments"]), t["id"]) for _, t in sorted(s["calls"].items())],
             s["finish"]) for _, s in sorted(choices.items())]
