"""Research environment: questions about the invented corpus of `graphs.research.graph`; reward 1.0 when the
final report contains the answer.

Plain Python with the trainer's duck-typed interface (``tasks``, ``reward``, ``invalid_penalty``); it does
not import ``drmas_graph``. An episode whose run did not produce a report (it ended at a clarifying question,
or a limit or a broken reply stopped it) gets 0.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage

from graphs.task import Task, stable_id

__all__ = ["ResearchEnv", "QUESTIONS"]

QUESTIONS = (("Which river flows through Vamberg?", "ostrel"), ("Who founded Vamberg?", "korrin"),
             ("When was Vamberg founded?", "1291"), ("What was Vamberg's glass famous for?", "blue"),
             ("Which lake feeds the Ostrel river?", "semmerin"), ("When was the Korrin bridge built?", "1340"))
"""(question, word the report must contain)."""


class ResearchEnv:
    """Tasks from `QUESTIONS` (the first `n_test` are the test split)."""

    invalid_penalty = 0.1
    """Per turn whose reply is not what its call asked for (counted by the trainer: broken JSON)."""

    def __init__(self, n_test: int = 2) -> None:
        tasks = [Task(id=stable_id("research", q), input={"messages": [HumanMessage(q)]}, answer=a,
                      meta={"level": 0, "kind": "lookup", "split": ""}) for q, a in QUESTIONS]
        self._splits = {"train": tasks[n_test:], "test": tasks[:n_test]}

    def tasks(self, split: str) -> list[Task]:
        return list(self._splits[split])

    def reward(self, task: Task, episode: Any) -> float:
        report = (episode.final_state or {}).get("final_report") or ""
        return float(task.answer in report.lower())
