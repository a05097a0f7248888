"""Tool calculator app: a worker that multiplies large numbers with a tool, called through the OpenAI SDK.

This module knows nothing about training (it must not import ``drmas_graph``): it is an ordinary LangGraph app
whose node uses ``openai.OpenAI().chat.completions.create``, as many apps do, not a LangChain chat model.

Flow::

    START -> worker -> END

The worker sends the question, after one worked example conversation (``EXAMPLE``), with one function tool,
``multiply(a, b)``. When the reply calls it, the worker
runs the call (``multiply`` below), sends the result back as a ``role: "tool"`` message and asks again; that
second reply is the final answer. A reply without a tool call is the final answer itself. A 135M model cannot
multiply two 4-digit numbers in its head, so a right answer almost always means the tool was used.

The graph input is ``{"question": "What is 4821 * 3907?"}``; the answer is read from ``The answer is <n>.``
(or a reply that is only a number).
"""

from __future__ import annotations

import json
import operator
import re
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = ["EXAMPLE", "MULTIPLY_TOOL", "SYSTEM_PROMPT", "ToolCalcState", "build_graph", "multiply", "parse_answer", "run_tool"]

SYSTEM_PROMPT = ('To multiply, reply with only <tool_call>{"name": "multiply", "arguments": {"a": <first number>, '
                 '"b": <second number>}}</tool_call>. After the tool result, reply: The answer is <number>.')

EXAMPLE = [
    {"role": "user", "content": "What is 1234 * 5678?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "example1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 1234, "b": 5678}'}}]},
    {"role": "tool", "tool_call_id": "example1", "content": "7006652"},
    {"role": "assistant", "content": "The answer is 7006652."},
]
"""One worked example conversation sent before the question (few-shot): without it SmolLM2-135M never called the
tool in the pilot (README.md)."""

MULTIPLY_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers a and b.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
"""The one tool, as an OpenAI function tool."""


class ToolCalcState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ...}``; the rest is filled in by the worker."""

    question: str
    """The question, ``What is A * B?``."""
    answer: str | None
    """The parsed final answer (``None`` when the final reply has no number)."""
    tool_calls: list[dict[str, Any]]
    """The tool calls the worker's first reply made, run in order: ``{"name", "arguments", "result"}``
    (``arguments`` as the model wrote them, a JSON string; ``result`` the text sent back)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every model reply in order: ``{"agent": "worker", "text": content}``."""


_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|[:=])\s*[*\"'$]*\s*(-?\d[\d,]*)", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"^\s*(-?\d[\d,]*)\s*\.?\s*$")


def parse_answer(text: str | None) -> str | None:
    """The integer of the last ``The answer is <n>`` (or of a reply that is only a number), commas removed."""
    matches = _ANSWER_RE.findall(text or "") or _BARE_NUMBER_RE.findall(text or "")
    return matches[-1].replace(",", "") if matches else None


def multiply(a: int, b: int) -> int:
    """The tool: ``a * b``."""
    return a * b


def run_tool(name: str, arguments: str) -> str:
    """Run one tool call as the model wrote it and return the text sent back to it: the product, or an error
    that says what was wrong (an unknown tool, arguments that are not JSON or not two integers ``a`` and ``b``)."""
    if name != "multiply":
        return f"error: unknown tool {name!r}; the only tool is multiply"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if (not isinstance(args, dict) or set(args) != {"a", "b"}
            or not all(isinstance(args[k], int) and not isinstance(args[k], bool) for k in ("a", "b"))):
        return 'error: multiply takes two integers, {"a": <int>, "b": <int>}'
    return str(multiply(args["a"], args["b"]))


def build_graph(client: Any = None, *, model: str = "gpt-4o-mini", max_tokens: int = 40,
                answer_max_tokens: int = 16) -> CompiledStateGraph:
    """Compile the one-node graph; its ``worker`` calls ``client.chat.completions.create``.

    Args:
        client: an ``openai.OpenAI`` client; default one on the SDK's default base URL (``OPENAI_API_KEY`` or a
            placeholder key: under training every call is served in the process and none is sent).
        model: the model name sent with each request.
        max_tokens: ``max_tokens`` of the first request (a tool call needs about 30 SmolLM2 tokens).
        answer_max_tokens: ``max_tokens`` of the request after the tool result.
    """
    if client is None:
        import os

        import openai

        client = openai.OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "unset"), max_retries=0)

    def worker(state: ToolCalcState) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE,
                                          {"role": "user", "content": state["question"]}]
        reply = client.chat.completions.create(model=model, messages=messages, tools=[MULTIPLY_TOOL],
                                               max_tokens=max_tokens).choices[0].message
        transcript = [{"agent": "worker", "text": reply.content or ""}]
        if not reply.tool_calls:
            return {"answer": parse_answer(reply.content), "tool_calls": [], "transcript": transcript}
        calls = [{"name": c.function.name, "arguments": c.function.arguments,
                  "result": run_tool(c.function.name, c.function.arguments)} for c in reply.tool_calls]
        messages.append(reply.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": call["result"]}
                     for c, call in zip(reply.tool_calls, calls)]
        final = client.chat.completions.create(model=model, messages=messages, tools=[MULTIPLY_TOOL],
                                               max_tokens=answer_max_tokens).choices[0].message
        transcript.append({"agent": "worker", "text": final.content or ""})
        return {"answer": parse_answer(final.content), "tool_calls": calls, "transcript": transcript}

    builder = StateGraph(ToolCalcState)
    builder.add_node("worker", worker)
    builder.add_edge(START, "worker")
    builder.add_edge("worker", END)
    return builder.compile(name="tool_calc")
