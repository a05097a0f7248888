"""Math example app: a solver and a verifier, as an ordinary LangGraph graph.

This module knows nothing about training (it must not import ``drmas_graph``): it is the stand-in for an
existing application that the trainer instruments from the outside.

Flow::

    START -> solver -> verifier --approve / unreadable verdict / round cap--> END
               ^          |
               +--reject--+

The solver replies ``The answer is <number>.`` (``Answer: <number>`` or a bare number also parse); the
verifier replies ``Yes`` (approve) or ``No, <reason>`` (reject; ``approve`` / ``reject: <reason>`` also
parse). On a reject the solver gets its previous answer and the reason and tries again, for at most
``max_rounds`` solver turns. The final answer is the solver's last answer (``None`` if that reply broke
the format).

Why these formats (SmolLM2-135M-Instruct, Q4_1 GGUF, temperature 0.7, a few dozen samples, so rough):
asked for ``approve``/``reject: <reason>`` it complied 0 of 20 times, asked to start with Yes or No 7 of
10; asked for ``Answer: <number>`` it complied 2 of 20 times, with the solver prompt below it wrote
"The answer is N" in 6 of 12. Through this graph on 12 single-digit additions: solver replies valid
4 of 14 (5 with the bare number accepted since), verifier 8 of 14, 2 of 12 episodes correct.

Choice for replies that break the format (the env's ``turn_is_valid`` flags them for the penalty):
- solver: ``answer`` becomes ``None`` for that round; the verifier still runs and sees "(none)".
- verifier: an unreadable verdict counts as approve, so garbage cannot buy extra solver turns.
"""

from __future__ import annotations

import operator
import re
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

__all__ = [
    "SOLVER_PROMPT",
    "VERIFIER_PROMPT",
    "MathState",
    "build_graph",
    "parse_answer",
    "parse_verdict",
    "solver_messages",
    "verifier_messages",
]

SOLVER_PROMPT = "Solve the math problem. Reply in one short line: The answer is <number>."
VERIFIER_PROMPT = "Is the proposed answer correct? Start your reply with Yes or No."


class MathState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ...}``; everything else is filled in by the nodes."""

    question: str
    """The problem text."""
    answer: str | None
    """The solver's latest parsed answer (``None`` if its latest reply had no ``The answer is <number>``)."""
    rounds: int
    """Solver turns taken so far."""
    verdict: str | None
    """The verifier's latest verdict: ``"approve"``, ``"reject"`` or ``None`` (unreadable: ends like approve)."""
    reason: str
    """The verifier's latest reject reason ("" otherwise)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every turn in order: ``{"agent": "solver"|"verifier", "round": int, "text": raw reply}``."""


# "The answer is 12.", "Answer: -3.5", "**Answer:** 7", "answer = 1,000", "the answer is $7$". Last one wins.
_ANSWER_RE = re.compile(r"\banswer\s*\**\s*(?:is\b\s*:?|[:=])\s*[*\"'$]*\s*(-?\d[\d,]*(?:\.\d+)?)",
                        re.IGNORECASE)
# The verdict word opens the reply, after optional decoration (quotes, markdown, bullets, "Verdict:").
_VERDICT_RE = re.compile(
    r"^[\s\"'*`_#>-]*(?:verdict\s*[:=]?\s*)?\**\s*(yes|no|approve|approved|reject|rejected)\b", re.IGNORECASE)
_BARE_NUMBER_RE = re.compile(r"^\s*(-?\d[\d,]*(?:\.\d+)?)\s*\.?\s*$")
_APPROVE = {"yes", "approve", "approved"}


def parse_answer(text: str) -> str | None:
    """The number of the last ``The answer is <number>`` (or ``Answer: <number>``), or of a reply that is
    only a number; commas removed. ``None`` otherwise.

    ``parse_answer("The answer is 1,000.") == "1000"``, ``parse_answer("7") == "7"``,
    ``parse_answer("3 + 4 = 7") is None``, ``parse_answer("The answer is seven") is None``.
    """
    matches = _ANSWER_RE.findall(text or "") or _BARE_NUMBER_RE.findall(text or "")
    if not matches:
        return None
    return matches[-1].replace(",", "")


def parse_verdict(text: str) -> tuple[bool | None, str]:
    """``(True, "")`` for ``Yes``/``approve``, ``(False, reason)`` for ``No, <reason>``/``reject: <reason>``,
    ``(None, "")`` if the reply does not open with one of those words.

    Case-insensitive; leading markdown, quotes and a ``Verdict:`` label are tolerated. The reason is what
    follows the word, without the separator.
    """
    match = _VERDICT_RE.match(text or "")
    if match is None:
        return None, ""
    if match.group(1).lower() in _APPROVE:
        return True, ""
    return False, text[match.end():].lstrip(" \t*:,.;-").strip()


def solver_messages(question: str, previous: str | None = None, reason: str | None = None,
                    *, revising: bool = False) -> list[BaseMessage]:
    """The solver's prompt; on a revision it also shows its previous answer and the verifier's reason."""
    user = question
    if revising:
        user += f"\nYour previous answer: {previous if previous is not None else '(none)'}"
        user += f"\nA checker said it is wrong{': ' + reason if reason else '.'}\nTry again."
    return [SystemMessage(SOLVER_PROMPT), HumanMessage(user)]


def verifier_messages(question: str, answer: str | None) -> list[BaseMessage]:
    """The verifier's prompt: the question and the solver's parsed answer ("(none)" if unreadable)."""
    shown = answer if answer is not None else "(none)"
    return [SystemMessage(VERIFIER_PROMPT), HumanMessage(f"Question: {question}\nProposed answer: {shown}")]


def build_graph(llm: BaseChatModel, *, max_rounds: int = 2,
                verifier_llm: BaseChatModel | None = None) -> CompiledStateGraph:
    """Compile the solver/verifier graph; nodes ``solver`` and ``verifier`` call ``llm.invoke(messages)``.

    Args:
        llm: any LangChain chat model; the solver's (and by default the verifier's).
        max_rounds: most solver turns per episode (>= 1); the verifier runs after each of them.
        verifier_llm: a separate chat model for the verifier; defaults to ``llm``.
    """
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an int >= 1 (solver turns per episode), got {max_rounds!r}")
    verifier_model = llm if verifier_llm is None else verifier_llm

    def solver(state: MathState) -> dict[str, Any]:
        rounds = state.get("rounds", 0)
        messages = solver_messages(state["question"], state.get("answer"), state.get("reason"),
                                   revising=rounds > 0)
        text = llm.invoke(messages).text
        return {
            "answer": parse_answer(text),
            "rounds": rounds + 1,
            "transcript": [{"agent": "solver", "round": rounds + 1, "text": text}],
        }

    def verifier(state: MathState) -> dict[str, Any]:
        text = verifier_model.invoke(verifier_messages(state["question"], state.get("answer"))).text
        approved, reason = parse_verdict(text)
        verdict = None if approved is None else ("approve" if approved else "reject")
        return {
            "verdict": verdict,
            "reason": reason,
            "transcript": [{"agent": "verifier", "round": state.get("rounds", 0), "text": text}],
        }

    def after_verifier(state: MathState) -> str:
        if state.get("verdict") == "reject" and state.get("rounds", 0) < max_rounds:
            return "solver"
        return END

    builder = StateGraph(MathState)
    builder.add_node("solver", solver)
    builder.add_node("verifier", verifier)
    builder.add_edge(START, "solver")
    builder.add_edge("solver", "verifier")
    builder.add_conditional_edges("verifier", after_verifier, ["solver", END])
    # Two supersteps per round, plus slack: the round cap, not LangGraph's default limit, ends an episode.
    return builder.compile(name="math").with_config(recursion_limit=2 * max_rounds + 5)
