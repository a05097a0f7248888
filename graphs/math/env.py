"""Math environment: procedurally generated integer problems at graded difficulty, and their rewards.

Plain Python with a duck-typed interface (``tasks``, ``reward``, ``turn_is_valid``, ``invalid_penalty``,
``agents``); it does not import ``drmas_graph``.

Levels (``Task.meta["level"]``, ``Task.meta["kind"]``):
    0 ``add1``  single-digit addition, "What is 3 + 4?" (100 distinct problems in all)
    1 ``add2`` / ``sub2``  two-digit addition or subtraction with a non-negative result
    2 ``mul``  small multiplication, 2..9 times 2..19
    3 ``word``  two-step word problems with named people and objects
"""

from __future__ import annotations

import random
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Mapping

from graphs.math.graph import parse_answer, parse_verdict
from graphs.task import Task, split_counts, stable_id

__all__ = ["LEVELS", "MathEnv", "normalize_number"]

_NAMES = ("Ana", "Ben", "Carla", "Dev", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jun", "Kira", "Leo",
          "Mia", "Nico", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma")
_OBJECTS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "stamps",
            "coins")

# One problem = (question, integer answer, kind).
_Problem = tuple[str, int, str]


def _level0(rng: random.Random) -> _Problem:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} + {b}?", a + b, "add1"


def _level1(rng: random.Random) -> _Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b, "add2"
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b, "sub2"


def _level2(rng: random.Random) -> _Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 19)
    return f"What is {a} * {b}?", a * b, "mul"


def _level3(rng: random.Random) -> _Problem:
    name, other = rng.sample(_NAMES, 2)
    things = rng.choice(_OBJECTS)
    template = rng.randrange(3)
    if template == 0:
        x, y = rng.randint(2, 20), rng.randint(2, 20)
        z = rng.randint(1, x + y - 1)
        q = (f"{name} has {x} {things} and buys {y} more. Then {name} gives {z} to {other}. "
             f"How many {things} does {name} have now?")
        return q, x + y - z, "word"
    if template == 1:
        x, y, z = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        q = (f"{name} has {x} bags with {y} {things} in each bag and {z} loose {things}. "
             f"How many {things} does {name} have?")
        return q, x * y + z, "word"
    x = rng.randint(5, 30)
    y = rng.randint(1, x - 1)
    z = rng.randint(1, 20)
    q = (f"{name} had {x} {things}, lost {y}, and then found {z}. "
         f"How many {things} does {name} have now?")
    return q, x - y + z, "word"


LEVELS: tuple[Callable[[random.Random], _Problem], ...] = (_level0, _level1, _level2, _level3)
"""Problem generators by difficulty level; each draws one problem from a ``random.Random``."""


def normalize_number(text: str | None) -> Decimal | None:
    """``"5"``, ``" 5 "``, ``"5.0"``, ``"5.00"`` and ``"1,000"`` -> a ``Decimal``; ``None`` if not a number."""
    if text is None:
        return None
    cleaned = str(text).strip().replace(",", "").removeprefix("$").strip()
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


class MathEnv:
    """Seeded math problems with disjoint train/test splits, an exact-match reward and a format check.

    Args:
        seed: the generator seed; the same seed gives identical tasks, ids and order.
        n_train: tasks in the ``"train"`` split.
        n_test: tasks in the ``"test"`` split (no question text appears in both splits).
        difficulty: weights of levels 0..3 in both splits (largest-remainder rounding); the default
            makes level 0 (single-digit addition, which a 135M model sometimes solves) the majority.
    """

    agents: tuple[str, ...] = ("solver", "verifier")
    """The graph's node names that call a model, i.e. the agents to train."""
    invalid_penalty: float = 0.1
    """The paper's c for math: a turn that breaks its reply format gets ``R_episode - c``."""

    def __init__(self, *, seed: int = 0, n_train: int = 128, n_test: int = 32,
                 difficulty: tuple[float, ...] = (0.55, 0.2, 0.15, 0.1)) -> None:
        if len(difficulty) > len(LEVELS):
            raise ValueError(f"difficulty has {len(difficulty)} weights but there are only "
                             f"{len(LEVELS)} levels (0..{len(LEVELS) - 1})")
        self.seed = seed
        self.difficulty = tuple(difficulty)
        test_n = split_counts(n_test, self.difficulty)
        train_n = split_counts(n_train, self.difficulty)
        splits: dict[str, list[Task]] = {"train": [], "test": []}
        for level, (n_te, n_tr) in enumerate(zip(test_n, train_n)):
            problems = self._distinct(level, n_te + n_tr)
            for split, chunk in (("test", problems[:n_te]), ("train", problems[n_te:])):
                splits[split].extend(
                    Task(id=stable_id(f"math-L{level}", q), input={"question": q}, answer=str(a),
                         meta={"level": level, "kind": kind, "split": split})
                    for q, a, kind in chunk)
        for split, tasks in splits.items():
            random.Random(f"{seed}-{split}-order").shuffle(tasks)
        self._splits = splits

    def _distinct(self, level: int, n: int) -> list[_Problem]:
        """``n`` problems of ``level`` with distinct question texts, in a seeded order."""
        rng = random.Random(f"{self.seed}-level-{level}")
        seen: dict[str, _Problem] = {}
        for _ in range(200 * n + 1000):
            if len(seen) == n:
                break
            problem = LEVELS[level](rng)
            seen.setdefault(problem[0], problem)
        if len(seen) < n:
            raise ValueError(f"level {level} has only {len(seen)} distinct problems but n_train + n_test "
                             f"asks for {n} of them; lower n_train/n_test or the level's difficulty weight")
        return list(seen.values())

    def tasks(self, split: str) -> list[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``), in a fixed seeded order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {sorted(self._splits)}")
        return list(self._splits[split])

    def score(self, task: Task, final_state: Mapping[str, Any]) -> float:
        """1.0 if the graph's final ``answer`` equals ``task.answer`` numerically ("5.0" == "5"), else 0.0."""
        got = normalize_number(final_state.get("answer"))
        return 1.0 if got is not None and got == normalize_number(task.answer) else 0.0

    def reply_is_valid(self, agent: str, text: str) -> bool:
        """Format check of one reply: solver -> has ``Answer: <number>``; verifier -> approve/reject."""
        if agent == "solver":
            return parse_answer(text) is not None
        if agent == "verifier":
            return parse_verdict(text)[0] is not None
        raise ValueError(f"unknown agent {agent!r}; the math graph's agents are {list(self.agents)}")

    # -- the trainer's Env protocol (duck-typed: this module does not import drmas_graph) ------------------
    def reward(self, task: Task, episode: Any) -> float:
        """Team reward of a finished episode: `score` of its final state."""
        return self.score(task, episode.final_state)

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        """Format check of one recorded LLM call (the trainer subtracts `invalid_penalty` when False)."""
        return self.reply_is_valid(turn.agent, turn.response_text)
