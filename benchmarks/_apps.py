"""The plain LangGraph app the benchmarks run: solver -> verifier over a stand-in chat model."""

from __future__ import annotations

from typing import TypedDict

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph


class QA(TypedDict, total=False):
    question: str
    answer: str
    verdict: str
    n: int


class AppModel(BaseChatModel):
    """Stands for the app's own model; never called inside an instrumented run or a replay."""

    @property
    def _llm_type(self) -> str:
        return "app-model"

    def _generate(self, *a, **k):
        raise AssertionError("the app's model must not be called inside an instrumented run")


def solver_verifier():
    """START -> solver -> verifier -> END, each node one chat call."""
    llm = AppModel()
    g = StateGraph(QA)
    g.add_node("solver", lambda s: {"answer": llm.invoke([HumanMessage(s["question"])]).content})
    g.add_node("verifier", lambda s: {"verdict": llm.invoke([HumanMessage(f"{s['question']} -> {s['answer']}")]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g.compile()
