"""Tool calculator environment: multiply two random 4-digit numbers; reward = the exact product, plus a little
for a well-formed tool call.

Plain Python (no ``drmas_graph`` import). Tasks are ``What is A * B?`` with A, B drawn uniformly from
1000..9999 (``digits`` sets the size); no question is in both splits. Reward of an episode (pre-registered in
``PREREG.md``): 1.0 when the final answer is the product, plus ``call_bonus`` (0.2) when the worker's first reply
called ``multiply`` with two integers (whatever they were), so an episode earns at most 1.2.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from graphs.task import Task, stable_id

__all__ = ["ToolCalcEnv", "episode_stats"]


def _well_formed(call: Mapping[str, Any]) -> bool:
    """A ``multiply`` call whose arguments are JSON with exactly two integers ``a`` and ``b``."""
    try:
        args = json.loads(call.get("arguments") or "")
    except (TypeError, json.JSONDecodeError):
        return False
    return (call.get("name") == "multiply" and isinstance(args, dict) and set(args) == {"a", "b"}
            and all(isinstance(args[k], int) and not isinstance(args[k], bool) for k in ("a", "b")))


def episode_stats(task: Task, final_state: Mapping[str, Any] | None) -> dict[str, bool]:
    """What one episode did: ``called`` (its first reply made any tool call), ``well_formed`` (a multiply call
    with two integers), ``right_args`` (with the task's two numbers, either order), ``right`` (exact answer)."""
    state = final_state or {}
    calls = state.get("tool_calls") or []
    a, b = task.meta["a"], task.meta["b"]
    good = [c for c in calls if _well_formed(c)]
    right_args = any(sorted(json.loads(c["arguments"]).values()) == sorted((a, b)) for c in good)
    return {"called": bool(calls), "well_formed": bool(good), "right_args": right_args,
            "right": state.get("answer") is not None and state["answer"] == task.answer}


class ToolCalcEnv:
    """Seeded multiplication tasks with disjoint train/test splits.

    Args:
        seed: the generator seed; the same seed gives identical tasks, ids and order.
        n_train: tasks in the ``"train"`` split.
        n_test: tasks in the ``"test"`` split (held out: evaluation only).
        digits: digits of each factor (4: 1000..9999).
        call_bonus: reward for a well-formed ``multiply`` call, on top of 1.0 for the exact answer.
    """

    agents: tuple[str, ...] = ("worker",)
    """The graph's node names that call a model."""
    invalid_penalty: float = 0.0
    """No turn is invalid: a reply without a tool call or a number simply earns nothing."""

    def __init__(self, *, seed: int = 0, n_train: int = 64, n_test: int = 32, digits: int = 4,
                 call_bonus: float = 0.2) -> None:
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        self.seed, self.digits, self.call_bonus = seed, digits, call_bonus
        rng = random.Random(f"{seed}-tool_calc")
        low, high = 10 ** (digits - 1), 10 ** digits - 1
        seen: set[tuple[int, int]] = set()
        splits: dict[str, list[Task]] = {"test": [], "train": []}
        for split, n in (("test", n_test), ("train", n_train)):
            while len(splits[split]) < n:
                a, b = rng.randint(low, high), rng.randint(low, high)
                if (a, b) in seen or (b, a) in seen:
                    continue
                seen.add((a, b))
                question = f"What is {a} * {b}?"
                splits[split].append(Task(id=stable_id("calc", question), input={"question": question},
                                          answer=str(a * b), meta={"level": 0, "kind": "mul", "split": split,
                                                                   "a": a, "b": b}))
        self._splits = splits

    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``), in a fixed seeded order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._splits)}")
        return list(self._splits[split])

    def score(self, task: Task, final_state: Mapping[str, Any]) -> float:
        """Task score: 1.0 if the final answer is the exact product, else 0.0."""
        return 1.0 if episode_stats(task, final_state)["right"] else 0.0

    # -- the trainer's Env protocol (duck-typed) ---------------------------------------------------------
    def reward(self, task: Task, episode: Any) -> float:
        """`score` plus `call_bonus` for a well-formed multiply call."""
        stats = episode_stats(task, episode.final_state)
        return float(stats["right"]) + (self.call_bonus if stats["well_formed"] else 0.0)

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        """Every worker turn is valid (`invalid_penalty` is 0: the reward alone pays for tool use)."""
        if turn.agent != "worker":
            raise ValueError(f"unknown agent {turn.agent!r}; the tool_calc graph's agent is 'worker'")
        return True
