"""Small real LangGraph apps used by the tests (they know nothing about drmas_graph)."""

import operator
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send


class QA(TypedDict, total=False):
    question: str
    answer: str
    verdict: str


def solver_verifier(llm, verifier_llm=None, verifier_system="Check it."):
    """Sequential: solver -> verifier."""
    verifier_llm = verifier_llm or llm

    def solver(state):
        reply = llm.invoke([SystemMessage("Solve it."), HumanMessage(state["question"])])
        return {"answer": reply.content}

    def verifier(state):
        reply = verifier_llm.invoke([SystemMessage(verifier_system), HumanMessage(f"{state['question']} -> {state['answer']}")])
        return {"verdict": reply.content}

    g = StateGraph(QA)
    g.add_node("solver", solver)
    g.add_node("verifier", verifier)
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g


def async_solver_verifier(llm):
    async def solver(state):
        reply = await llm.ainvoke([HumanMessage(state["question"])])
        return {"answer": reply.content}

    async def verifier(state):
        reply = await llm.ainvoke([HumanMessage(f"check {state['question']}: {state['answer']}")])
        return {"verdict": reply.content}

    g = StateGraph(QA)
    g.add_node("solver", solver)
    g.add_node("verifier", verifier)
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g.compile()


class Fan(TypedDict, total=False):
    question: str
    item: int
    notes: Annotated[list, operator.add]


def parallel_branches(llm):
    """Two branches in the same superstep, then a join."""

    def make(name):
        def node(state):
            return {"notes": [(name, llm.invoke([HumanMessage(f"{name}: {state['question']}")]).content)]}
        return node

    g = StateGraph(Fan)
    g.add_node("left", make("left"))
    g.add_node("right", make("right"))
    g.add_node("join", make("join"))
    g.add_edge(START, "left")
    g.add_edge(START, "right")
    g.add_edge(["left", "right"], "join")
    g.add_edge("join", END)
    return g.compile()


def send_fanout(llm, n=3):
    def worker(state):
        return {"notes": [(state["item"], llm.invoke([HumanMessage(f"item {state['item']}")]).content)]}

    def fan(state):
        return [Send("worker", {"item": i, "question": state["question"]}) for i in range(n)]

    g = StateGraph(Fan)
    g.add_node("worker", worker)
    g.add_conditional_edges(START, fan, ["worker"])
    g.add_edge("worker", END)
    return g.compile()


def with_subgraph(llm, judge_llm=None):
    """plan -> research (subgraph: search_llm) -> grade (calls with drmas_agent metadata)."""

    def search_llm(state):
        return {"notes": [("search", llm.invoke([HumanMessage(f"search {state['question']}")]).content)]}

    sub = StateGraph(Fan)
    sub.add_node("search_llm", search_llm)
    sub.add_edge(START, "search_llm")
    sub.add_edge("search_llm", END)

    def plan(state):
        return {"notes": [("plan", llm.invoke([HumanMessage(f"plan {state['question']}")]).content)]}

    def grade(state):
        judge = (judge_llm or llm).with_config(metadata={"drmas_agent": "judge"})
        return {"notes": [("grade", judge.invoke([HumanMessage("grade it")]).content)]}

    g = StateGraph(Fan)
    g.add_node("plan", plan)
    g.add_node("research", sub.compile())
    g.add_node("grade", grade)
    g.add_edge(START, "plan")
    g.add_edge("plan", "research")
    g.add_edge("research", "grade")
    g.add_edge("grade", END)
    return g.compile()


def no_llm():
    g = StateGraph(QA)
    g.add_node("echo", lambda s: {"answer": s["question"]})
    g.add_edge(START, "echo")
    g.add_edge("echo", END)
    return g.compile()


def react_agent(llm):
    """LangGraph's prebuilt ReAct agent with one tool."""
    import warnings

    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(llm, [add])
