"""Checked math's environment: tasks with two planted answers (one right, one wrong), the solver paid for its
answer, the checker paid per verdict (a reward per LLM call, `turn_rewards`).

Plain Python (no ``drmas_graph`` import). Why this app (study v2, benchmarks/learning/PREREG_v2.md): its two
agents' reward distributions differ for the whole run, whatever they learn, which Dr. MAS's argument needs:

- ``solver``: one call per episode, reward 1 if its answer is right else 0 (minus the invalid-turn penalty
  0.1 for a reply without a number).
- ``checker``: three calls per episode (the solver's answer, then the two planted ones in the task's order),
  each paid ``VERDICT_PAY`` = 1/3 when right (approve a right answer, reject a wrong or missing one), 0 when
  wrong, minus 0.1 for an unreadable verdict (one not opening with Yes/No). Its verdicts of an episode sum to at
  most 1, as the solver's reward: per call its rewards are a third as spread as the solver's, and it is exposed
  to the penalty three times as often. Always approving earns it (1 + p) / 3 per episode with p the solver's
  accuracy, always rejecting (2 - p) / 3: only judging earns 1.

`reward` returns {"solver": ..., "checker": the sum of its verdict pays} (logs, `agent/<a>/reward_mean`);
`turn_rewards` gives each checker call its own pay, so every estimator sees a reward per call; `is_success` is
the solver's answer being right (avg@k / pass@k). `verdict_counts` gives the checker's confusion counts.

Tasks: single-digit additions (level 0) and two-digit additions / subtractions (level 1), seeded; the planted
wrong answer is the right one plus one of -10, -2, -1, +1, +2, +10 (never negative); the two planted answers
are shuffled per task.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from graphs.checked_math.graph import parse_answer, parse_verdict
from graphs.task import Task, split_counts, stable_id

__all__ = ["CheckedMathEnv", "VERDICT_PAY", "judgements"]

VERDICT_PAY = 1.0 / 3.0
"""The checker's reward for one right verdict (three verdicts per episode)."""
_OFFSETS = (-10, -2, -1, 1, 2, 10)


def _problem(level: int, rng: random.Random) -> tuple[str, int]:
    if level == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a} + {b}?", a + b
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    return f"What is {max(a, b)} - {min(a, b)}?", max(a, b) - min(a, b)


def judgements(task: Task, final_state: Mapping[str, Any]) -> list[tuple[bool, bool | None]]:
    """``(answer_right, approved)`` for each of the checker's judgements, in order (approved None: unreadable)."""
    gold = int(task.answer)
    out = []
    for j in final_state.get("judged") or []:
        answer = j["answer"]
        right = answer is not None and _as_int(answer) == gold
        out.append((right, j["approved"]))
    return out


def _as_int(text: str) -> int | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


class CheckedMathEnv:
    """Seeded tasks (disjoint splits) with planted answers; per-agent and per-call rewards.

    Args:
        seed: generator seed (same seed: same tasks, ids, order and planted answers).
        n_train, n_test: tasks per split.
        difficulty: weights of levels 0 and 1 (largest-remainder rounding).
    """

    agents: tuple[str, ...] = ("solver", "checker")
    invalid_penalty: float = 0.1

    def __init__(self, *, seed: int = 0, n_train: int = 80, n_test: int = 48,
                 difficulty: tuple[float, float] = (0.6, 0.4)) -> None:
        rng = random.Random(f"checked_math:{seed}")
        self.splits: dict[str, list[Task]] = {"train": [], "test": []}
        for level, (n_te, n_tr) in enumerate(zip(split_counts(n_test, difficulty), split_counts(n_train, difficulty))):
            seen: dict[str, int] = {}
            for _ in range(100_000):
                if len(seen) == n_te + n_tr:
                    break
                q, a = _problem(level, rng)
                seen.setdefault(q, a)
            else:
                raise ValueError(f"level {level} has fewer than {n_te + n_tr} distinct problems (level 0 has 100); "
                                 "ask for fewer tasks or shift the difficulty weights")
            problems = list(seen.items())
            for split, chunk in (("test", problems[:n_te]), ("train", problems[n_te:])):
                for q, a in chunk:
                    wrong = a + rng.choice([o for o in _OFFSETS if a + o >= 0])
                    planted = [str(a), str(wrong)]
                    rng.shuffle(planted)
                    self.splits[split].append(Task(
                        id=stable_id(f"checked-L{level}", q), input={"question": q, "candidates": planted},
                        answer=str(a), meta={"level": level, "split": split}))

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; the splits are {sorted(self.splits)}")
        return list(self.splits[split])

    def reward(self, task: Task, episode: Any) -> dict[str, float]:
        state = episode.final_state or {}
        pays = [VERDICT_PAY * (approved is not None and approved == right) for right, approved in judgements(task, state)]
        return {"solver": self.score(task, state), "checker": sum(pays)}

    def turn_rewards(self, task: Task, episode: Any) -> dict[int, float]:
        """{position in episode.turns: pay} of each checker call; the k-th checker call made the k-th judgement."""
        pays = [VERDICT_PAY * (approved is not None and approved == right)
                for right, approved in judgements(task, episode.final_state or {})]
        positions = [i for i, turn in enumerate(episode.turns) if turn.agent == "checker"]
        if len(positions) != len(pays):
            raise ValueError(f"task {task.id!r}: {len(positions)} checker calls but {len(pays)} judgements")
        return dict(zip(positions, pays))

    def score(self, task: Task, final_state: Mapping[str, Any]) -> float:
        """1.0 if the solver's answer is right, else 0.0."""
        answer = final_state.get("answer")
        return float(answer is not None and _as_int(answer) == int(task.answer))

    def is_success(self, task: Task, episode: Any) -> bool:
        return self.score(task, episode.final_state or {}) == 1.0

    def turn_is_valid(self, task: Task, turn: Any) -> bool:
        if turn.agent == "solver":
            return parse_answer(turn.response_text) is not None
        if turn.agent == "checker":
            return parse_verdict(turn.response_text) is not None
        raise ValueError(f"unknown agent {turn.agent!r}; the agents are {self.agents}")

    def verdict_counts(self, task: Task, final_state: Mapping[str, Any] | None) -> dict[str, int]:
        """Confusion counts: tp (right answer approved), fn (right answer rejected or unreadable verdict),
        tn (wrong answer rejected), fp (wrong answer approved or unreadable verdict)."""
        counts = {"tp": 0, "fn": 0, "tn": 0, "fp": 0}
        for right, approved in judgements(task, final_state or {}):
            if right:
                counts["tp" if approved is True else "fn"] += 1
            else:
                counts["tn" if approved is False else "fp"] += 1
        return counts
