"""Support environment: the customer and the supervisor of `graphs/support/graph.py`, scripted.

Plain Python with a duck-typed interface; it does not import ``drmas_graph``. Besides ``tasks`` and
``reward`` it plays the humans of the app, which is how a conversation and a human-in-the-loop app are
trained (tau-bench style: the environment plays the user):

- ``next_input(task, episode)``: the customer's next message after the agent answered, or None when the
  customer has said everything in the task's script (the conversation ends);
- ``resume(task, episode, interrupts)``: the supervisor's answer to a refund request, "yes" for at most
  ``max_refund`` dollars (``Task.meta['max_refund']``), else "no".

Each task is one customer with a script (``Task.meta['script']``: the messages after the first, which is
``Task.input``) and the refund they are owed (``Task.answer``, 0 = none). Reward: 1.0 when the conversation
ended with exactly the refunds the customer is owed approved (none when owed none), else 0.0.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import HumanMessage

from graphs.support.graph import parse_refund
from graphs.task import Task, stable_id

__all__ = ["SupportEnv"]

_CASES = (  # (first message, later messages, refund owed)
    ("My order #12 arrived broken. I paid $30.", ("Can you refund it?", "Thanks, bye."), 30),
    ("Where is my order #7?", ("It is three weeks late.", "OK, bye."), 0),
    ("I was charged $45 twice for order #3.", ("Please refund the second charge.", "Bye."), 45),
    ("How do I change my password?", ("Thanks.",), 0),
)


class SupportEnv:
    """Customers with scripts, a supervisor who approves refunds up to a limit, and a reward."""

    invalid_penalty = 0.0

    def __init__(self, max_refund: int = 50) -> None:
        self.max_refund = max_refund
        self._tasks = [Task(id=stable_id("support", first), input={"messages": [HumanMessage(first)]},
                            answer=str(owed), meta={"script": list(later), "max_refund": max_refund,
                                                    "level": 0, "kind": "support", "split": "train"})
                       for first, later, owed in _CASES]

    def tasks(self, split: str) -> list[Task]:
        return list(self._tasks)

    def next_input(self, task: Task, episode: Any) -> dict[str, Any] | None:
        said = sum(1 for m in episode.final_state["messages"]
                   if m.type == "human" and not str(m.content).startswith("[supervisor]"))
        script = task.meta["script"]
        return {"messages": [HumanMessage(script[said - 1])]} if said - 1 < len(script) else None

    def resume(self, task: Task, episode: Any, interrupts: list[Any]) -> Any:
        answers = {i.id: "yes" if (i.value or {}).get("refund", 0) <= task.meta["max_refund"] else "no"
                   for i in interrupts}
        return answers if len(answers) > 1 else next(iter(answers.values()))

    def reward(self, task: Task, episode: Any) -> float:
        approved = sum(r["amount"] for r in episode.final_state.get("refunds", []) if r["approved"])
        return 1.0 if approved == int(task.answer) else 0.0

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        text = turn.response_text.strip()
        return bool(text) and (parse_refund(text) is None or text.upper().startswith("REFUND"))
