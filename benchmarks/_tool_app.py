"""Workload (a) of bench_async: an agent whose tool call waits on a simulated API, and its environment.

    START -> planner (LLM: a query) -> api (waits like a remote API, returns a result) -> answerer (LLM) -> END

The API's latency is lognormal with mean 0.5 s and sigma 1 (median 0.30 s; 1 call in 100 takes over 3.1 s),
drawn from a generator seeded by (seed, question, query): a fixed, seeded distribution with a long tail. The
node blocks in `time.sleep`, as a synchronous SDK call would. The reward (1 when the answerer's first sampled
token id is even) is learnable by a tiny random model in a few steps, so reward curves have a slope to compare.
This module knows nothing about training: it is an ordinary LangGraph app over any chat model.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage
from langgraph.graph import END, START, StateGraph

from graphs.task import Task

__all__ = ["API_MEAN_S", "API_SIGMA", "ToolEnv", "api_latency", "build_graph"]

API_MEAN_S = 0.5
"""Mean latency of one simulated API call (seconds)."""
API_SIGMA = 1.0
"""sigma of the lognormal latency: the tail's weight."""


def api_latency(seed: int, key: str, mean_s: float = API_MEAN_S, sigma: float = API_SIGMA) -> float:
    """Seconds one call takes: lognormal(mu, sigma) with mu = log(mean) - sigma^2 / 2, so E = mean."""
    return random.Random(f"{seed}:{key}").lognormvariate(math.log(mean_s) - sigma ** 2 / 2, sigma)


class ToolState(TypedDict, total=False):
    question: str
    query: str
    result: str
    answer: str


def build_graph(llm: Any, *, seed: int = 0, mean_s: float = API_MEAN_S) -> Any:
    """The compiled graph; `llm` is the app's own chat model (replaced by the policies in training)."""

    def planner(state: ToolState) -> dict:
        return {"query": llm.invoke([HumanMessage(f"Write a search query for: {state['question']}")]).content}

    def api(state: ToolState) -> dict:
        time.sleep(api_latency(seed, state["question"] + "|" + state["query"], mean_s))
        return {"result": f"Top result for '{state['query'][:40]}'."}

    def answerer(state: ToolState) -> dict:
        msgs = [HumanMessage(state["question"]), HumanMessage(f"Search result: {state['result']} Answer briefly.")]
        return {"answer": llm.invoke(msgs).content}

    g = StateGraph(ToolState)
    g.add_node("planner", planner)
    g.add_node("api", api)
    g.add_node("answerer", answerer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "api")
    g.add_edge("api", "answerer")
    g.add_edge("answerer", END)
    return g.compile()


class ToolEnv:
    """Questions about numbered facts; team reward 1 when the answerer's first token id is even."""

    invalid_penalty = 0.0

    def __init__(self, n_train: int = 64, n_test: int = 8) -> None:
        self.splits = {split: [Task(id=f"{split}-{i}", input={"question": f"What is fact number {i}?"}, answer="")
                               for i in range(n)] for split, n in (("train", n_train), ("test", n_test))}

    def tasks(self, split: str) -> list[Task]:
        return self.splits[split]

    def reward(self, task: Task, episode: Any) -> float:
        answer = next(t for t in episode.turns if t.agent == "answerer")
        return 1.0 if answer.response_ids and answer.response_ids[0] % 2 == 0 else 0.0
