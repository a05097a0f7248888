"""The CPU demo's app: a solver and a verifier that checks answers by working the problem out itself.

An ordinary LangGraph graph (it must not import ``drmas_graph``). Flow::

    START -> solver -> verifier --approve / no verdict / round cap--> END
               ^          |
               +--reject--+

The input is ``{"question": "What is 3 + 4?", "proposed": "8"}``: ``proposed`` is a *planted* answer (right or
wrong, chosen by the environment) that the verifier judges first, in its first turn, before it judges the
solver's answer; so every episode gives the verifier a verdict on an answer whose truth the environment set,
whatever the solver does. The verifier is shown the question only (``show_answer=False``, the default) and
replies ``The answer is <number>.``: its verdict is *approve* when its number equals the judged answer, *reject*
otherwise; a reply without a number is no verdict (it ends the episode like an approval, and the environment
pays it as a wrong verdict). On a reject the solver sees its previous answer and the verifier's number and
tries again, at most ``max_rounds`` solver turns; the final answer is the solver's last one.

Why the verifier writes a number rather than Yes/No: SmolLM2-135M-Instruct's first-token log-odds of "Yes"
over "No" do not tell right from wrong proposed sums (area under the ROC curve 0.49-0.54 on single-digit
additions, with wrong answers 1-3 or 6-30 off, and on a looked-up number; measured before this app was
written), so reinforcement learning has nothing to sharpen; it does add single digits right about half the
time when it writes a number. Why it does not see the answer: shown it (``show_answer=True``), the verifier
learned to copy it in 12 steps on seeds 0 and 1 (true-negative rate 0.42-0.46 -> 0.00), a rubber stamp.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from graphs.math.graph import SOLVER_PROMPT, parse_answer

__all__ = ["CHECKER_PROMPT", "CheckedState", "build_graph", "checker_messages", "same_number", "solver_messages"]

CHECKER_PROMPT = "Check the math problem by solving it yourself. Reply in one short line: The answer is <number>."


class CheckedState(TypedDict, total=False):
    """Graph state. Input: ``{"question": ..., "proposed": ...}``; the rest is filled in by the nodes."""

    question: str
    """The problem text."""
    proposed: str | None
    """The planted answer the verifier judges first (``None``: no planted answer, it judges the solver only)."""
    answer: str | None
    """The solver's latest parsed answer (``None`` if its latest reply had no number)."""
    rounds: int
    """Solver turns taken so far."""
    verdict: str | None
    """The verifier's latest verdict on the solver's answer: ``"approve"``, ``"reject"`` or ``None`` (no number)."""
    check: str | None
    """The verifier's latest number (``None`` if its latest reply had none)."""
    transcript: Annotated[list[dict[str, Any]], operator.add]
    """Every turn in order: ``{"agent", "round", "text"}``; a verifier turn also has ``"judged"`` (the answer it
    was shown, ``None`` for none) and ``"planted"`` (True for the planted answer's turn, round 0)."""


def same_number(a: str | None, b: str | None) -> bool:
    """True when both are numbers and equal (``"7"`` == ``"7.0"``); a missing side is never equal."""
    if a is None or b is None:
        return False
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def solver_messages(question: str, previous: str | None = None, check: str | None = None,
                    *, revising: bool = False) -> list[BaseMessage]:
    """The solver's prompt; on a revision it also shows its previous answer and the verifier's number."""
    user = question
    if revising:
        user += f"\nYour previous answer: {previous if previous is not None else '(none)'}"
        user += f"\nA checker got {check}." if check is not None else "\nA checker said it is wrong."
        user += "\nTry again."
    return [SystemMessage(SOLVER_PROMPT), HumanMessage(user)]


def checker_messages(question: str, show: str | None = None) -> list[BaseMessage]:
    """The verifier's prompt: the question, and the answer to check only when `show` is given (the demo's graph
    never shows it: shown the answer, the verifier learned to copy it, approving every wrong answer)."""
    user = f"Question: {question}" + (f"\nProposed answer: {show}" if show is not None else "")
    return [SystemMessage(CHECKER_PROMPT), HumanMessage(user)]


def build_graph(llm: BaseChatModel, *, max_rounds: int = 2, verifier_llm: BaseChatModel | None = None,
                show_answer: bool = False) -> CompiledStateGraph:
    """Compile the solver/verifier graph; nodes ``solver`` and ``verifier`` call ``llm.invoke(messages)``.

    Args:
        llm: any LangChain chat model; the solver's (and by default the verifier's).
        max_rounds: most solver turns per episode (>= 1); the verifier judges after each of them.
        verifier_llm: a separate chat model for the verifier; defaults to ``llm``.
        show_answer: show the verifier the answer it judges (off: it works the problem out blind and the graph
            compares; on, SmolLM2-135M learned to copy the shown number, a rubber stamp).
    """
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an int >= 1 (solver turns per episode), got {max_rounds!r}")
    verifier_model = llm if verifier_llm is None else verifier_llm

    def judge(question: str, shown: str | None, rounds: int, planted: bool) -> tuple[str | None, dict[str, Any]]:
        text = verifier_model.invoke(checker_messages(question, shown if show_answer else None)).text
        return parse_answer(text), {"agent": "verifier", "round": rounds, "text": text, "judged": shown,
                                    "planted": planted}

    def solver(state: CheckedState) -> dict[str, Any]:
        rounds = state.get("rounds", 0)
        messages = solver_messages(state["question"], state.get("answer"), state.get("check"), revising=rounds > 0)
        text = llm.invoke(messages).text
        return {"answer": parse_answer(text), "rounds": rounds + 1,
                "transcript": [{"agent": "solver", "round": rounds + 1, "text": text}]}

    def verifier(state: CheckedState) -> dict[str, Any]:
        rounds, turns = state.get("rounds", 0), []
        if rounds == 1 and state.get("proposed") is not None:  # the planted answer, once, before the solver's
            turns.append(judge(state["question"], state["proposed"], 0, True)[1])
        check, turn = judge(state["question"], state.get("answer"), rounds, False)
        verdict = None if check is None else ("approve" if same_number(check, state.get("answer")) else "reject")
        return {"verdict": verdict, "check": check, "transcript": [*turns, turn]}

    def after_verifier(state: CheckedState) -> str:
        if state.get("verdict") == "reject" and state.get("rounds", 0) < max_rounds:
            return "solver"
        return END

    builder = StateGraph(CheckedState)
    builder.add_node("solver", solver)
    builder.add_node("verifier", verifier)
    builder.add_edge(START, "solver")
    builder.add_edge("solver", "verifier")
    builder.add_conditional_edges("verifier", after_verifier, ["solver", END])
    return builder.compile(name="checked_math").with_config(recursion_limit=2 * max_rounds + 5)
