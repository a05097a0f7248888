"""Lookup environment: one small random table per task, a question about one of its cells, and the rewards.

Plain Python (no ``drmas_graph`` import). Each task's table has ``n_rows`` rows named with invented
syllables (``Tolvik``) and the level's number of columns (from ``age``, ``code``, ``room``, ``floor``) holding
random integers 10..99, so no model knows a fact without the tool. The question names one row and one column:
"What is the code of Tolvik?".

Levels (``Task.meta["level"]``): the row has 1 (level 0), 2 (level 1) or 4 (level 2) columns; the more
columns, the more the answerer must pick the right number from the looked-up row.

Reward: a team reward, 1.0 if the answerer's answer equals the cell, else 0.0. Invalid turns (the penalty
``invalid_penalty``): a caller reply that names no row (no tool call), an answerer reply with no number.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from graphs.lookup.graph import parse_answer, parse_call
from graphs.task import Task, split_counts, stable_id

__all__ = ["COLUMNS", "LEVEL_COLUMNS", "LookupEnv"]

COLUMNS = ("age", "code", "room", "floor")
LEVEL_COLUMNS = (1, 2, 4)
"""Columns of the table at each level."""
_ONSETS = ("b", "br", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("k", "l", "n", "r", "s", "th", "v", "x")


def _name(rng: random.Random) -> str:
    return (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_ONSETS[:10]) + rng.choice(_VOWELS)
            + rng.choice(_CODAS)).capitalize()


class LookupEnv:
    """Seeded lookup tasks with disjoint train/test splits (no table or question in both).

    Args:
        seed: the generator seed; the same seed gives identical tasks, ids and order.
        n_train: tasks in the ``"train"`` split.
        n_test: tasks in the ``"test"`` split.
        n_rows: rows per table (the caller must name the one the question asks about).
        difficulty: weights of levels 0..2 (1, 2, 4 columns) in both splits.
    """

    agents: tuple[str, ...] = ("caller", "answerer")
    """The graph's node names that call a model."""
    invalid_penalty: float = 0.1
    """Cost of an invalid turn (a caller reply that calls no tool, an answerer reply without a number)."""

    def __init__(self, *, seed: int = 0, n_train: int = 128, n_test: int = 32, n_rows: int = 5,
                 difficulty: tuple[float, ...] = (0.4, 0.4, 0.2)) -> None:
        if len(difficulty) > len(LEVEL_COLUMNS):
            raise ValueError(f"difficulty has {len(difficulty)} weights but there are only {len(LEVEL_COLUMNS)} "
                             f"levels (0..{len(LEVEL_COLUMNS) - 1}: {LEVEL_COLUMNS} columns)")
        if n_rows < 1:
            raise ValueError(f"n_rows must be >= 1, got {n_rows}")
        self.seed, self.n_rows, self.difficulty = seed, n_rows, tuple(difficulty)
        rng = random.Random(f"{seed}-lookup")
        splits: dict[str, list[Task]] = {"train": [], "test": []}
        seen: set[str] = set()
        for level, (n_te, n_tr) in enumerate(zip(split_counts(n_test, self.difficulty),
                                                 split_counts(n_train, self.difficulty))):
            for split, n in (("test", n_te), ("train", n_tr)):
                while n:
                    task = self._task(rng, level, split)
                    if task.id not in seen:
                        seen.add(task.id)
                        splits[split].append(task)
                        n -= 1
        for split, tasks in splits.items():
            random.Random(f"{seed}-{split}-order").shuffle(tasks)
        self._splits = splits

    def _task(self, rng: random.Random, level: int, split: str) -> Task:
        names: list[str] = []
        while len(names) < self.n_rows:
            name = _name(rng)
            if name not in names:
                names.append(name)
        columns = COLUMNS[: LEVEL_COLUMNS[level]]
        table = {name: {col: rng.randint(10, 99) for col in columns} for name in names}
        name, col = rng.choice(names), rng.choice(columns)
        question = f"What is the {col} of {name}?"
        return Task(id=stable_id(f"lookup-L{level}", f"{question} {table}"),
                    input={"question": question, "table": table}, answer=str(table[name][col]),
                    meta={"level": level, "kind": f"{len(columns)}col", "split": split, "row": name, "column": col})

    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``), in a fixed seeded order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._splits)}")
        return list(self._splits[split])

    def score(self, task: Task, final_state: Mapping[str, Any]) -> float:
        """1.0 if the final ``answer`` equals the asked cell, else 0.0."""
        return 1.0 if final_state.get("answer") is not None and final_state["answer"] == task.answer else 0.0

    def tool_calls(self, final_state: Mapping[str, Any] | None) -> tuple[int, int]:
        """``(tool calls, caller turns)`` of one episode: how many caller replies named a row."""
        entries = (final_state or {}).get("transcript") or []
        return (sum(e["agent"] == "tool" for e in entries), sum(e["agent"] == "caller" for e in entries))

    # -- the trainer's Env protocol (duck-typed) ---------------------------------------------------------
    def reward(self, task: Task, episode: Any) -> float:
        """Team reward: `score` of the final state."""
        return self.score(task, episode.final_state or {})

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        """A caller turn is valid when it calls the tool (names a row), an answerer turn when it has a number."""
        if turn.agent == "caller":
            return parse_call(turn.response_text, list(task.input["table"])) is not None
        if turn.agent == "answerer":
            return parse_answer(turn.response_text) is not None
        raise ValueError(f"unknown agent {turn.agent!r}; the lookup graph's agents are {list(self.agents)}")
