"""Reflection example app: an assistant answers, a judge critiques, until the judge calls a `Finish` tool.

A re-creation, in this project's own code, of the *pattern* of the langgraph-reflection README (an assistant
and a judge joined in a loop; the judge ends the loop only by calling a `Finish` tool, any other reply goes
back to the assistant as a critique). It is not that project's code and it does not depend on it. Like every
app under `graphs/`, it knows nothing about training (it does not import ``drmas_graph``).

Flow::

    START -> assistant -> judge --calls Finish--> END
                ^           |
                +-critique--+

The app has no round cap of its own: a judge that never calls `Finish` (an untrained one) keeps the loop
going until the run's limits stop it (LangGraph's `recursion_limit`, the trainer's `rollout.max_llm_calls`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from pydantic import BaseModel

__all__ = ["ASSISTANT_PROMPT", "JUDGE_PROMPT", "Finish", "ReflectionState", "build_graph", "latest_answer"]

ASSISTANT_PROMPT = "You are a helpful assistant. Answer the request in one or two sentences."
JUDGE_PROMPT = ("You are a strict judge. If the answer fully satisfies the request, call the Finish tool. "
                "Otherwise reply with a short critique saying what to fix.")


class Finish(BaseModel):
    """Call this when the answer fully satisfies the request."""


class ReflectionState(TypedDict, total=False):
    """Graph state. Input: ``{"messages": [request]}``; the assistant's answers and the judge's critiques
    are appended as the loop goes; ``done`` is set when the judge calls `Finish`."""

    messages: Annotated[list[AnyMessage], add_messages]
    """The request, then the assistant's answers (AI) and the judge's critiques (human) in turn."""
    done: bool
    """True once the judge called `Finish`."""


def latest_answer(messages: list[Any]) -> str | None:
    """Text of the assistant's latest answer (the last AI message), or None before the first one."""
    answers = [m for m in messages if getattr(m, "type", None) == "ai"]
    return answers[-1].text if answers else None


def build_graph(llm: BaseChatModel, *, judge_llm: BaseChatModel | None = None) -> CompiledStateGraph:
    """Compile the assistant/judge loop: nodes ``assistant`` (``llm.invoke``) and ``judge``
    (``judge_llm.bind_tools([Finish]).invoke``; ``judge_llm`` defaults to ``llm``)."""
    judge_model = (judge_llm or llm).bind_tools([Finish])

    def assistant(state: ReflectionState) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage(ASSISTANT_PROMPT), *state["messages"]])]}

    def judge(state: ReflectionState) -> dict[str, Any]:
        request = state["messages"][0].text
        review = HumanMessage(f"Request: {request}\nAnswer: {latest_answer(state['messages'])}")
        reply = judge_model.invoke([SystemMessage(JUDGE_PROMPT), review])
        if any(call["name"] == "Finish" for call in reply.tool_calls):
            return {"done": True}
        return {"messages": [HumanMessage(f"A reviewer says: {reply.text}\nImprove your answer.")]}

    def after_judge(state: ReflectionState) -> str:
        return END if state.get("done") else "assistant"

    builder = StateGraph(ReflectionState)
    builder.add_node("assistant", assistant)
    builder.add_node("judge", judge)
    builder.add_edge(START, "assistant")
    builder.add_edge("assistant", "judge")
    builder.add_conditional_edges("judge", after_judge, ["assistant", END])
    return builder.compile(name="reflection")
