"""Calculator team environment: word problems a calculator makes trivial, and a reward per agent.

Plain Python (no ``drmas_graph`` import). Levels (``meta["level"]``, ``kind``): 0 ``add``, two 3-digit numbers
added ("A library has 348 books and gets 275 more. ..."); 1 ``mul``, 2-digit by 2-digit ("A box holds 24 pencils.
How many pencils are in 37 boxes?"); 2 ``two_step``, A * B + C or A * B - C. Every answer is a positive integer
that SmolLM2-135M rarely gets in its head and a calculator gets every time. ``meta["expression"]`` is the gold
calculation (``"37 * 24"``).

Rewards of one episode (``reward`` returns a dict; `episode_stats` says what it saw):

- ``planner``: 1.0 when the team's final answer (the worker's latest) is right.
- ``worker``: 1.0 when the final answer is right, plus ``call_bonus`` (0.2) when it made a calculator call on the
  task's numbers (`task_call`: the calculator evaluated it and its expression holds every number of the gold
  calculation), so at most 1.2. A call of a bare guess (``{"expression": "500000"}``, what the smoke run's
  warm-started worker did) evaluates but earns nothing.
- ``critic``: the share of its verdicts that were right against the truth: approve a right answer, reject a
  wrong or missing one; an unreadable verdict (JSON without a boolean ``correct``) is wrong.

``invalid_penalty`` is 0: the rewards above are the task; ``turn_is_valid`` still marks a critic reply without a
readable verdict invalid, so the trainer's invalid rate per agent counts it.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from graphs.calc_team.graph import parse_verdict
from graphs.task import Task, split_counts, stable_id

__all__ = ["CalcTeamEnv", "episode_stats", "task_call", "well_formed"]

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lea")
_ADD = ("{name} has {a} stamps and buys {b} more. How many stamps does {name} have now?",
        "A library has {a} books and gets {b} more. How many books does it have now?",
        "A farm has {a} hens and {b} ducks. How many birds does the farm have?",
        "A train carries {a} people and {b} more get on. How many people are on the train?")
_MUL = ("A box holds {a} pencils. How many pencils are in {b} boxes?",
        "{name} reads {a} pages a day for {b} days. How many pages does {name} read?",
        "A bus has {a} seats. How many seats do {b} buses have?",
        "A shelf holds {a} jars. How many jars do {b} shelves hold?")
_PLUS = ("A crate holds {a} bottles. A shop has {b} crates and {c} loose bottles. How many bottles does the shop "
         "have?",
         "{name} packs {b} bags of {a} apples and has {c} apples left over. How many apples does {name} have?")
_MINUS = ("{name} saves {a} dollars a week for {b} weeks and then spends {c} dollars. How many dollars does "
          "{name} have left?",
          "A bakery bakes {b} trays of {a} rolls and sells {c} rolls. How many rolls are left?")


def _problem(rng: random.Random, level: int) -> tuple[str, str, int]:
    """(question, gold expression, answer) of one problem of `level`."""
    name = rng.choice(_NAMES)
    if level == 0:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return rng.choice(_ADD).format(name=name, a=a, b=b), f"{a} + {b}", a + b
    if level == 1:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return rng.choice(_MUL).format(name=name, a=a, b=b), f"{b} * {a}", a * b
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return rng.choice(_PLUS).format(name=name, a=a, b=b, c=c), f"{b} * {a} + {c}", a * b + c
    return rng.choice(_MINUS).format(name=name, a=a, b=b, c=c), f"{b} * {a} - {c}", a * b - c


def well_formed(call: Mapping[str, Any]) -> bool:
    """A calculator call whose expression the calculator evaluated (its result is a number, not an error)."""
    return call.get("name") == "calculator" and not str(call.get("result", "error")).startswith("error")


def _numbers(text: str) -> Counter[str]:
    return Counter(re.findall(r"\d+", text.replace(",", "")))


def task_call(call: Mapping[str, Any], task: Task) -> bool:
    """A `well_formed` call whose expression holds every number of the task's gold calculation (each as often)."""
    try:
        args = json.loads(call.get("arguments") or "")
    except (TypeError, json.JSONDecodeError):
        return False
    expression = args.get("expression") if isinstance(args, dict) else None
    return (well_formed(call) and isinstance(expression, str)
            and not _numbers(task.meta["expression"]) - _numbers(expression))


def _verdicts(task: Task, state: Mapping[str, Any]) -> list[tuple[bool, bool | None]]:
    """``(answer_right, approved)`` per critic turn, in order (each critic entry of the transcript holds the answer
    it judged). ``approved`` is None for an unreadable verdict."""
    return [(entry["answer"] == task.answer, _verdict(entry["text"]))
            for entry in state.get("transcript") or [] if entry["agent"] == "critic"]


def _verdict(text: str) -> bool | None:
    try:
        return parse_verdict(text)
    except json.JSONDecodeError:
        return None


def episode_stats(task: Task, final_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """What one episode did: ``right`` (final answer right), ``called`` (the worker made a tool call),
    ``well_formed`` (a calculator call that evaluated), ``task_call`` (one on the task's numbers, `task_call`),
    ``right_call`` (a call whose result is the answer),
    ``plan_numbers`` (the plan holds every number of the gold expression), ``verdicts`` (`(answer_right,
    approved)` per critic turn)."""
    state = final_state or {}
    calls = state.get("tool_calls") or []
    numbers = [t for t in task.meta["expression"].split() if t.isdigit()]
    plan = state.get("plan") or ""
    return {"right": state.get("answer") is not None and state["answer"] == task.answer,
            "called": bool(calls), "well_formed": any(well_formed(c) for c in calls),
            "task_call": any(task_call(c, task) for c in calls),
            "right_call": any(c.get("result") == task.answer for c in calls),
            "plan_numbers": bool(plan) and all(n in plan for n in numbers),
            "verdicts": _verdicts(task, state) if state else []}


class CalcTeamEnv:
    """Seeded word problems with disjoint train/test splits and a reward per agent.

    Args:
        seed: the generator seed; the same seed gives identical tasks, ids and order.
        n_train: tasks in the ``"train"`` split.
        n_test: tasks in the ``"test"`` split (held out: evaluation only).
        difficulty: weights of levels 0 (add), 1 (mul), 2 (two_step), split per split by largest remainder.
        call_bonus: the worker's reward for a calculator call on the task's numbers, on top of 1.0 for the right
            answer.
    """

    agents: tuple[str, ...] = ("planner", "worker", "critic")
    """The graph's node names that call a model."""
    invalid_penalty: float = 0.0
    """The rewards are the task; invalid critic replies are counted, not charged."""

    def __init__(self, *, seed: int = 0, n_train: int = 64, n_test: int = 16,
                 difficulty: tuple[float, ...] = (0.3, 0.4, 0.3), call_bonus: float = 0.2) -> None:
        if len(difficulty) > 3:
            raise ValueError(f"difficulty has weights for levels 0..2 (add, mul, two_step), got {len(difficulty)}")
        self.seed, self.call_bonus = seed, call_bonus
        rng = random.Random(f"{seed}-calc_team")
        seen: set[str] = set()
        self._splits: dict[str, list[Task]] = {}
        for split, n in (("test", n_test), ("train", n_train)):
            tasks = []
            for level, count in enumerate(split_counts(n, tuple(difficulty))):
                while sum(t.meta["level"] == level for t in tasks) < count:
                    question, expression, answer = _problem(rng, level)
                    if question in seen:
                        continue
                    seen.add(question)
                    kind = ("add", "mul", "two_step")[level]
                    tasks.append(Task(id=stable_id("team", question), input={"question": question},
                                      answer=str(answer), meta={"level": level, "kind": kind, "split": split,
                                                                "expression": expression}))
            rng.shuffle(tasks)
            self._splits[split] = tasks

    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``), in a fixed seeded order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._splits)}")
        return list(self._splits[split])

    def score(self, task: Task, final_state: Mapping[str, Any] | None) -> float:
        """The team's task score: 1.0 when the final answer is right, else 0.0."""
        return 1.0 if episode_stats(task, final_state)["right"] else 0.0

    # -- the trainer's Env protocol (duck-typed) ---------------------------------------------------------
    def reward(self, task: Task, episode: Any) -> dict[str, float]:
        """``{"planner", "worker", "critic"}`` as the module docstring says (every agent of the graph acts in
        every episode that finishes)."""
        stats = episode_stats(task, episode.final_state)
        judged = stats["verdicts"]
        critic = sum(approved is not None and approved == right for right, approved in judged) / len(judged) \
            if judged else 0.0
        right = float(stats["right"])
        return {"planner": right, "worker": right + (self.call_bonus if stats["task_call"] else 0.0),
                "critic": critic}

    def is_success(self, task: Task, episode: Any) -> bool:
        """avg@k / pass@k count the team's final answer only."""
        return self.score(task, episode.final_state) == 1.0

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        """A critic reply is valid when it is a JSON object with a boolean ``correct``; every other turn is."""
        if turn.agent not in self.agents:
            raise ValueError(f"unknown agent {turn.agent!r}; the calc_team graph's agents are {list(self.agents)}")
        return turn.agent != "critic" or _verdict(turn.response_text) is not None
