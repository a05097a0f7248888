"""Lookup app: a caller that must use a lookup tool and an answerer, as an ordinary LangGraph graph.

This module knows nothing about training (it must not import ``drmas_graph``).

Flow::

    START -> caller --names a row of the table--> lookup (tool) -> answerer -> END
               ^  |
               +--+ names no row (at most max_calls caller turns), then -> answerer without facts

The graph input is ``{"question": "What is the code of Tolvik?", "table": {"Tolvik": {"code": 47, ...}, ...}}``.
The table stands for a private database: no prompt shows it; the only way to its facts is the ``lookup``
tool (a LangChain tool), which returns one row as text, ``Tolvik: age 31, code 47``. The table is built at
random per task by the environment, so no model can know its facts.

The caller replies ``lookup <name>``; its reply is a tool call when it names a row of the table (the
``lookup`` word is optional: a reply naming a row anywhere calls the tool with the first row it names).
A reply that names no row is told so and the caller tries again, at most ``max_calls`` turns in all; then
the answerer answers without facts. The answerer replies ``The answer is <number>.``.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = ["ANSWERER_PROMPT", "CALLER_PROMPT", "LookupState", "build_graph", "caller_messages",
           "answerer_messages", "lookup", "parse_answer", "parse_call"]

CALLER_PROMPT = "You can look up a name in a private table. Reply with only: lookup <name>"
ANSWERER_PROMPT = "Answer the question from the facts in one short line, like: The answer is 42."


class LookupState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ..., "table": {...}}``; the rest is filled in by the nodes."""

    question: str
    """The question, naming one row and one column of the table."""
    table: dict[str, dict[str, int]]
    """The private table: row name -> column -> value. Never shown to a model; read by the tool only."""
    call: str | None
    """The row the caller's latest reply named (``None`` if it named none)."""
    calls: int
    """Caller turns taken so far."""
    facts: list[str]
    """Tool results, in order (``"Tolvik: age 31, code 47"``)."""
    answer: str | None
    """The answerer's parsed answer (``None`` if its reply had no number)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every turn in order: ``{"agent": "caller"|"answerer", "text": raw reply}`` and tool calls
    ``{"agent": "tool", "text": result}``."""


_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|[:=])\s*[*\"'$]*\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"^\s*(-?\d[\d,]*(?:\.\d+)?)\s*\.?\s*$")


def parse_answer(text: str) -> str | None:
    """The number of the last ``The answer is <number>`` (or of a reply that is only a number), commas removed."""
    matches = _ANSWER_RE.findall(text or "") or _BARE_NUMBER_RE.findall(text or "")
    return matches[-1].replace(",", "") if matches else None


def parse_call(text: str, names: list[str]) -> str | None:
    """The first row name of ``names`` that the reply contains as a whole word (case-insensitive), else None.

    ``parse_call("lookup Tolvik", ["Brena", "Tolvik"]) == "Tolvik"``.
    """
    found = [(m.start(), name) for name in names
             for m in [re.search(rf"\b{re.escape(name)}\b", text or "", re.IGNORECASE)] if m]
    return min(found)[1] if found else None


@tool
def lookup(name: str, table: dict[str, dict[str, int]]) -> str:
    """Look up one row of the private table by name; returns ``Name: col value, col value``."""
    row = table[name]
    return f"{name}: " + ", ".join(f"{col} {value}" for col, value in row.items())


def caller_messages(question: str, tries: int) -> list[BaseMessage]:
    """The caller's prompt; after a reply that named no row it is told so."""
    user = f"Question: {question}"
    if tries:
        user += "\nYour last reply named no row of the table. Try again."
    return [SystemMessage(CALLER_PROMPT), HumanMessage(user)]


def answerer_messages(question: str, facts: list[str]) -> list[BaseMessage]:
    """The answerer's prompt: the question and the looked-up facts (``(none)`` when there are none)."""
    shown = "\n".join(f"- {f}" for f in facts) if facts else "(none)"
    return [SystemMessage(ANSWERER_PROMPT), HumanMessage(f"Question: {question}\nFacts:\n{shown}")]


def build_graph(llm: BaseChatModel, *, max_calls: int = 2,
                answerer_llm: BaseChatModel | None = None) -> CompiledStateGraph:
    """Compile the caller/lookup/answerer graph; the nodes ``caller`` and ``answerer`` call ``llm.invoke``.

    Args:
        llm: any LangChain chat model; the caller's (and by default the answerer's).
        max_calls: most caller turns per episode (>= 1).
        answerer_llm: a separate chat model for the answerer; defaults to ``llm``.
    """
    if not isinstance(max_calls, int) or max_calls < 1:
        raise ValueError(f"max_calls must be an int >= 1 (caller turns per episode), got {max_calls!r}")
    answerer_model = llm if answerer_llm is None else answerer_llm

    def caller(state: LookupState) -> dict[str, Any]:
        calls = state.get("calls", 0)
        text = llm.invoke(caller_messages(state["question"], calls)).text
        return {"call": parse_call(text, list(state["table"])), "calls": calls + 1,
                "transcript": [{"agent": "caller", "text": text}]}

    def run_lookup(state: LookupState) -> dict[str, Any]:
        result = lookup.invoke({"name": state["call"], "table": state["table"]})
        return {"facts": [*state.get("facts", []), result], "transcript": [{"agent": "tool", "text": result}]}

    def answerer(state: LookupState) -> dict[str, Any]:
        text = answerer_model.invoke(answerer_messages(state["question"], state.get("facts", []))).text
        return {"answer": parse_answer(text), "transcript": [{"agent": "answerer", "text": text}]}

    def after_caller(state: LookupState) -> str:
        if state.get("call") is not None:
            return "lookup"
        return "caller" if state.get("calls", 0) < max_calls else "answerer"

    builder = StateGraph(LookupState)
    builder.add_node("caller", caller)
    builder.add_node("lookup", run_lookup)
    builder.add_node("answerer", answerer)
    builder.add_edge(START, "caller")
    builder.add_conditional_edges("caller", after_caller, ["lookup", "caller", "answerer"])
    builder.add_edge("lookup", "answerer")
    builder.add_edge("answerer", END)
    return builder.compile(name="lookup").with_config(recursion_limit=max_calls + 5)
