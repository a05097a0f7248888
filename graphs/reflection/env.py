"""Reflection environment: short writing requests; the reward checks the assistant's latest answer.

Plain Python with the trainer's duck-typed interface (``tasks``, ``reward``, ``turn_is_valid``,
``invalid_penalty``); it does not import ``drmas_graph``. The reward reads the final state when the run
finished and the assistant's last reply otherwise (a run stopped by a limit has no final state), so it can
also score truncated episodes (`rollout.truncated_reward: null`).
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage

from graphs.reflection.graph import latest_answer
from graphs.task import Task, stable_id

__all__ = ["ReflectionEnv", "TOPICS"]

TOPICS = (("the sea", "salt"), ("a city at night", "lights"), ("autumn", "leaves"), ("a library", "quiet"),
          ("a mountain", "snow"), ("a kitchen", "bread"), ("the desert", "sand"), ("a forest", "moss"))
"""(topic, word the answer must contain) of every task."""


class ReflectionEnv:
    """Tasks "Write one sentence about T that uses the word W."; reward 1.0 when the answer contains W."""

    invalid_penalty = 0.05
    """Per judge turn that is neither a Finish call nor a critique (an empty reply)."""

    def __init__(self, n_test: int = 2) -> None:
        tasks = []
        for topic, word in TOPICS:
            request = f"Write one sentence about {topic} that uses the word '{word}'."
            tasks.append(Task(id=stable_id("reflect", request), input={"messages": [HumanMessage(request)]},
                              answer=word, meta={"level": 0, "kind": "sentence", "split": ""}))
        self._splits = {"train": tasks[n_test:], "test": tasks[:n_test]}

    def tasks(self, split: str) -> list[Task]:
        return list(self._splits[split])

    def reward(self, task: Task, episode: Any) -> float:
        if episode.final_state is not None:
            answer = latest_answer(episode.final_state["messages"])
        else:  # stopped before its end: the assistant's last reply is what it produced
            answer = next((t.response_text for t in reversed(episode.turns) if t.agent == "assistant"), None)
        return float(answer is not None and task.answer in answer.lower())

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        return turn.agent != "judge" or bool(turn.tool_calls or turn.response_text.strip())
