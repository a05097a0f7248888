"""The checked-math app's graph: a solver answers a question once, then a checker judges three answers one by
one, the solver's and two submitted with the question (`candidates` in the input), each with Yes or No.

An ordinary LangGraph app: it does not import ``drmas_graph``, and its prompts and parsers are its own (frozen
for the pre-registered study v2 in benchmarks/learning; the math app's may change).

Flow::

    START -> solver -> checker --more answers to judge--> checker ... -> END

The solver replies ``The answer is <number>.`` (a bare number also parses); the checker sees one question and
one proposed answer per call and replies ``Yes`` or ``No ...``. The state's ``judged`` lists, in order, every
answer the checker judged (the solver's first, then the candidates) with its verdict (None: unreadable).
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = ["SOLVER_PROMPT", "CHECKER_PROMPT", "CheckedState", "build_graph", "checker_messages", "parse_answer",
           "parse_verdict", "solver_messages"]

SOLVER_PROMPT = "Solve the math problem. Reply in one short line: The answer is <number>."
CHECKER_PROMPT = "Is the proposed answer correct? Start your reply with Yes or No."

_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|[:=])\s*[*\"'$]*\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"^\s*(-?\d[\d,]*(?:\.\d+)?)\s*\.?\s*$")
_VERDICT_RE = re.compile(r"^[\s\"'*`_#>-]*(yes|no)\b", re.IGNORECASE)


class CheckedState(TypedDict, total=False):
    """Input: ``{"question": ..., "candidates": [answer, answer]}``; the nodes fill in the rest."""

    question: str
    """The problem text."""
    candidates: list[str]
    """Answers submitted with the question, judged after the solver's."""
    answer: str | None
    """The solver's parsed answer (None if its reply had no number)."""
    judged: Annotated[list[dict[str, Any]], operator.add]
    """Every judgement in order: ``{"answer": str | None, "from": "solver" | "candidate", "approved": bool | None}``."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every turn in order: ``{"agent": "solver" | "checker", "text": raw reply}``."""


def parse_answer(text: str) -> str | None:
    """The number of the last ``The answer is <number>`` or of a reply that is only a number (commas removed);
    None otherwise. ``parse_answer("The answer is 1,000.") == "1000"``, ``parse_answer("3 + 4 = 7") is None``."""
    matches = _ANSWER_RE.findall(text or "") or _BARE_NUMBER_RE.findall(text or "")
    return matches[-1].replace(",", "") if matches else None


def parse_verdict(text: str) -> bool | None:
    """True for a reply opening with Yes, False for No (case-insensitive, after quotes or markdown), else None."""
    match = _VERDICT_RE.match(text or "")
    return None if match is None else match.group(1).lower() == "yes"


def solver_messages(question: str) -> list[BaseMessage]:
    return [SystemMessage(SOLVER_PROMPT), HumanMessage(question)]


def checker_messages(question: str, answer: str | None) -> list[BaseMessage]:
    shown = answer if answer is not None else "(none)"
    return [SystemMessage(CHECKER_PROMPT), HumanMessage(f"Question: {question}\nProposed answer: {shown}")]


def build_graph(llm: BaseChatModel, *, checker_llm: BaseChatModel | None = None) -> CompiledStateGraph:
    """Compile the graph; nodes ``solver`` and ``checker`` call ``llm.invoke(messages)`` (the checker
    ``checker_llm`` when given)."""
    checker_model = llm if checker_llm is None else checker_llm

    def solver(state: CheckedState) -> dict[str, Any]:
        text = llm.invoke(solver_messages(state["question"])).text
        return {"answer": parse_answer(text), "transcript": [{"agent": "solver", "text": text}]}

    def checker(state: CheckedState) -> dict[str, Any]:
        done = len(state.get("judged") or [])
        queue = [(state.get("answer"), "solver")] + [(c, "candidate") for c in state.get("candidates") or []]
        answer, source = queue[done]
        text = checker_model.invoke(checker_messages(state["question"], answer)).text
        return {"judged": [{"answer": answer, "from": source, "approved": parse_verdict(text)}],
                "transcript": [{"agent": "checker", "text": text}]}

    def after_checker(state: CheckedState) -> str:
        return "checker" if len(state.get("judged") or []) < 1 + len(state.get("candidates") or []) else END

    builder = StateGraph(CheckedState)
    builder.add_node("solver", solver)
    builder.add_node("checker", checker)
    builder.add_edge(START, "solver")
    builder.add_edge("solver", "checker")
    builder.add_conditional_edges("checker", after_checker, ["checker", END])
    return builder.compile(name="checked_math").with_config(recursion_limit=12)
