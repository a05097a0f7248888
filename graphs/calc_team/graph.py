"""Calculator team: a planner, a worker with a calculator tool and a critic in JSON mode, all on the OpenAI SDK.

The shape of app users bring (issue 57): every node calls ``client.chat.completions.create`` directly, as the
OpenAI docs show, and this module knows nothing about training (it must not import ``drmas_graph``).

Flow::

    START -> planner -> worker -> critic --approve / unreadable verdict / round cap--> END
                          ^          |
                          +--reject--+

- ``planner``: free text, one line that says which calculation answers the word problem.
- ``worker``: the usual OpenAI tool loop with one function tool, ``calculator(expression)``, and
  ``tool_choice="auto"``: call the model; while its reply calls tools, run them, append the assistant message and
  one ``role: "tool"`` message per call, and call again (at most ``max_calls`` model calls per turn). The reply
  without a tool call is the answer, read from ``The answer is <n>`` or else its last number. The system prompt
  names the tool and the answer format; it has **no worked example** (no example conversation, no example call).
- ``critic``: ``response_format={"type": "json_object"}`` (OpenAI's JSON mode); it sees the problem, the
  calculator's results and the answer, and the app reads ``json.loads(content)["correct"]`` (a bool). A reject
  sends the worker back, with the rejected answer, while it has had fewer than ``max_rounds`` turns; an
  unreadable verdict (no boolean ``correct``) ends the run like an approve.

The app does not guard ``json.loads``: JSON mode guarantees a JSON reply, and apps written for it rely on that.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = ["CALCULATOR_TOOL", "CRITIC_PROMPT", "PLANNER_PROMPT", "WORKER_PROMPT", "CalcTeamState", "build_graph",
           "calculate", "critic_user", "parse_answer", "parse_verdict", "run_tool", "worker_user"]

PLANNER_PROMPT = ("You plan the work of a team that solves math word problems. Reply with one short line: the "
                  "calculation that answers the problem.")
WORKER_PROMPT = ("You solve math word problems. Use the calculator tool for the arithmetic. When you have the "
                 "result, reply: The answer is <number>.")
CRITIC_PROMPT = ('You check answers to math word problems. Is the proposed answer right? Reply in JSON: '
                 '{"correct": true} or {"correct": false}.')

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "the expression to evaluate"}},
                   "required": ["expression"], "additionalProperties": False}}}
"""The one tool, as an OpenAI function tool (strict-style: one required string, no other keys)."""


class CalcTeamState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ...}``; the rest is filled in by the nodes."""

    question: str
    """The word problem."""
    plan: str
    """The planner's reply."""
    answer: str | None
    """The worker's latest answer (``None`` when its last reply had no number or it never stopped calling)."""
    rounds: int
    """Worker turns so far (a reject adds one)."""
    verdict: bool | None
    """The critic's latest verdict: True approve, False reject, None unreadable."""
    tool_calls: Annotated[list[dict[str, Any]], operator.add]
    """Every tool call the worker made, run in order: ``{"round", "name", "arguments", "result"}`` (``arguments``
    as the model wrote them, a JSON string; ``result`` the text sent back)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every model reply in order: ``{"agent", "round", "text"}``; the critic's text is its JSON and its entry
    also holds the ``answer`` it judged."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"unsupported element {ast.dump(node)[:40]}")


def calculate(expression: str) -> str:
    """The calculator: the value of ``expression`` (numbers, ``+ - * /``, parentheses; ``x`` and ``×`` read as
    ``*``, thousands commas dropped) as text, an integer when it is whole, else rounded to 6 decimals; or an
    ``error: ...`` text that says what was wrong."""
    text = expression.replace("×", "*").replace("x", "*").replace("X", "*")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text).strip().rstrip("=").strip()
    if not text:
        return "error: the expression is empty"
    try:
        value = _evaluate(ast.parse(text, mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return "error: the calculator takes numbers, + - * / and parentheses"
    return str(int(value)) if float(value).is_integer() else str(round(value, 6))


def run_tool(name: str, arguments: str | None) -> str:
    """Run one tool call as the model wrote it; the text sent back (a result or an ``error: ...``)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator"
    try:
        args = json.loads(arguments or "")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: calculator takes {"expression": "<arithmetic>"}'
    return calculate(args["expression"])


_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|[:=])\s*[*\"'$]*\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def parse_answer(text: str | None) -> str | None:
    """The number of the last ``The answer is <n>``, else the reply's last number; commas dropped, ``12.0`` ->
    ``12``; None without a number."""
    matches = _ANSWER_RE.findall(text or "") or _NUMBER_RE.findall(text or "")
    if not matches:
        return None
    number = matches[-1].replace(",", "").rstrip(".")
    return number[:-2] if number.endswith(".0") else number


def parse_verdict(content: str | None) -> bool | None:
    """The critic's verdict: the boolean ``correct`` of its JSON object; None when the object has none.
    ``json.loads`` raises on a reply that is not JSON (JSON mode rules that out)."""
    data = json.loads(content or "")
    correct = data.get("correct") if isinstance(data, dict) else None
    return correct if isinstance(correct, bool) else None


def worker_user(question: str, plan: str, rejected: str | None = None) -> str:
    """The worker's user message: the problem, the plan and, after a reject, the rejected answer."""
    text = f"Problem: {question}\nPlan: {plan.strip() or '(none)'}"
    if rejected is not None:
        text += f"\nA critic said the answer {rejected} is wrong. Try again."
    return text


def critic_user(question: str, calls: list[dict[str, Any]], answer: str | None) -> str:
    """The critic's user message: the problem, the calculator's results this round and the proposed answer."""
    work = "; ".join(f"{_expression(c['arguments'])} = {c['result']}" for c in calls) or "(none)"
    return f"Problem: {question}\nCalculator: {work}\nProposed answer: {answer if answer is not None else '(none)'}"


def _expression(arguments: str | None) -> str:
    try:
        args = json.loads(arguments or "")
    except json.JSONDecodeError:
        return str(arguments)
    return str(args.get("expression")) if isinstance(args, dict) and "expression" in args else str(arguments)


def build_graph(client: Any = None, *, model: str = "gpt-4o-mini", max_rounds: int = 2, max_calls: int = 3,
                planner_max_tokens: int = 32, worker_max_tokens: int = 48,
                critic_max_tokens: int = 64) -> CompiledStateGraph:
    """Compile the team's graph; every node calls ``client.chat.completions.create``.

    Args:
        client: an ``openai.OpenAI`` client; default one on the SDK's default base URL (``OPENAI_API_KEY`` or a
            placeholder key: under training every call is served in the process and none is sent).
        model: the model name sent with each request.
        max_rounds: most worker turns; a reject sends the worker back while it has had fewer.
        max_calls: most model calls in one worker turn's tool loop (a reply that still calls a tool at the
            last one leaves no answer).
        planner_max_tokens: ``max_tokens`` of the planner's request.
        worker_max_tokens: ``max_tokens`` of each worker request (a calculator call is about 30 SmolLM2 tokens).
        critic_max_tokens: ``max_tokens`` of the critic's request.
    """
    if max_rounds < 1 or max_calls < 1:
        raise ValueError(f"max_rounds and max_calls must be >= 1, got {max_rounds} and {max_calls}")
    if client is None:
        import openai

        client = openai.OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "unset"), max_retries=0)

    def planner(state: CalcTeamState) -> dict[str, Any]:
        reply = client.chat.completions.create(model=model, max_tokens=planner_max_tokens, messages=[
            {"role": "system", "content": PLANNER_PROMPT}, {"role": "user", "content": state["question"]}])
        text = reply.choices[0].message.content or ""
        return {"plan": text, "rounds": 0, "transcript": [{"agent": "planner", "round": 0, "text": text}]}

    def worker(state: CalcTeamState) -> dict[str, Any]:
        turn = state.get("rounds", 0) + 1
        rejected = (state.get("answer") or "(none)") if state.get("verdict") is False else None
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": WORKER_PROMPT},
            {"role": "user", "content": worker_user(state["question"], state.get("plan", ""), rejected)}]
        calls: list[dict[str, Any]] = []
        transcript: list[dict[str, Any]] = []
        answer = None
        for _ in range(max_calls):
            reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR_TOOL],
                                                   tool_choice="auto", max_tokens=worker_max_tokens)
            message = reply.choices[0].message
            transcript.append({"agent": "worker", "round": turn, "text": message.content or ""})
            if not message.tool_calls:
                answer = parse_answer(message.content)
                break
            messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                calls.append({"round": turn, "name": call.function.name, "arguments": call.function.arguments,
                              "result": result})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return {"answer": answer, "rounds": turn, "tool_calls": calls, "transcript": transcript}

    def critic(state: CalcTeamState) -> dict[str, Any]:
        turn = state["rounds"]
        calls = [c for c in state.get("tool_calls", []) if c["round"] == turn]
        reply = client.chat.completions.create(
            model=model, max_tokens=critic_max_tokens, response_format={"type": "json_object"}, messages=[
                {"role": "system", "content": CRITIC_PROMPT},
                {"role": "user", "content": critic_user(state["question"], calls, state.get("answer"))}])
        content = reply.choices[0].message.content or ""
        return {"verdict": parse_verdict(content), "transcript": [
            {"agent": "critic", "round": turn, "text": content, "answer": state.get("answer")}]}

    def after_critic(state: CalcTeamState) -> str:
        return "worker" if state.get("verdict") is False and state["rounds"] < max_rounds else END

    builder = StateGraph(CalcTeamState)
    builder.add_node("planner", planner)
    builder.add_node("worker", worker)
    builder.add_node("critic", critic)
    builder.add_edge(START, "planner")
    builder.add_edge("planner", "worker")
    builder.add_edge("worker", "critic")
    builder.add_conditional_edges("critic", after_critic, ["worker", END])
    return builder.compile(name="calc_team")
