"""The CPU demo's environment: `MathEnv`'s problems with a planted answer per task, and a reward per agent.

Plain Python (no ``drmas_graph`` import). Each task's input gets ``proposed``, the planted answer the verifier
judges first (`graphs.math.checked_graph`): right for every other task of a split (in its seeded order), on
the others the gold answer moved by 1 to 3 either way (never below 0), so the planted answers are half right
and half wrong in both splits, with the near misses a solver makes.

Rewards of one episode (``reward`` returns a dict, so each agent is paid for its own work):

- ``solver``: 1.0 if the final answer is right, else 0.0.
- ``verifier``: the mean of its verdicts' rewards (`verdict_reward`). Approving a right answer earns 1;
  rejecting a wrong one earns 1 when its own number is the right answer (the correction the solver is shown is
  right) and 0.5 when it is not; approving a wrong answer or rejecting a right one earns 0; a reply without a
  number is no verdict and earns 0 (echoing the instruction earns nothing). It judges 2 or 3 answers per
  episode (the planted one, then each solver answer). Why a wrong-number rejection earns only half: the
  verifier works the sum out blind, so any wrong number "rejects" every wrong answer; paid in full, answering
  the question's first number rejected three verdicts in four early in training (most solver answers are
  wrong then), and that echo, learned by the model both agents share, took over the solver too (seed 0 of
  recipe C in docs/demo.md).

Invalid turns (the trainer subtracts ``invalid_penalty``): a solver or verifier reply without a number.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from graphs.math.checked_graph import same_number
from graphs.math.env import MathEnv, normalize_number
from graphs.math.graph import parse_answer
from graphs.task import Task

__all__ = ["CheckedMathEnv", "Verdict", "verdict_reward", "verdicts"]

Verdict = tuple[bool, bool | None, bool]
"""One verifier turn: (the judged answer is right, approved (None: no number, no verdict), planted)."""


def verdicts(task: Task, final_state: Mapping[str, Any]) -> list[Verdict]:
    """Every verifier turn of an episode, in order, as `Verdict`: approved when the verifier's number equals
    the answer it was shown (``judged`` in its transcript entry)."""
    out = []
    for entry in final_state.get("transcript") or []:
        if entry["agent"] != "verifier":
            continue
        if "judged" not in entry:
            raise ValueError(f"task {task.id!r}: a verifier transcript entry has no 'judged' answer; this "
                             "environment scores graphs.math.checked_graph's transcript")
        check = parse_answer(entry["text"])
        right = same_number(entry["judged"], task.answer)
        out.append((right, None if check is None else same_number(check, entry["judged"]), bool(entry["planted"])))
    return out


def verdict_reward(task: Task, entry: Mapping[str, Any]) -> float:
    """The reward of one verifier turn (its transcript entry): 1 for approving a right answer or rejecting a
    wrong one with the right number, 0.5 for rejecting a wrong answer with a wrong number, 0 for a wrong verdict
    or no number."""
    check = parse_answer(entry["text"])
    if check is None:
        return 0.0
    right = same_number(entry["judged"], task.answer)
    if same_number(check, entry["judged"]):  # approved
        return 1.0 if right else 0.0
    if right:
        return 0.0
    return 1.0 if same_number(check, task.answer) else 0.5


class CheckedMathEnv(MathEnv):
    """`MathEnv`'s tasks plus a planted answer each; `reward` returns ``{"solver": ..., "verifier": ...}``.

    Args: as `MathEnv` (``seed``, ``n_train``, ``n_test``, ``difficulty``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for split, tasks in self._splits.items():
            self._splits[split] = [self._plant(task, i % 2 == 0) for i, task in enumerate(tasks)]

    def _plant(self, task: Task, right: bool) -> Task:
        gold = int(task.answer)
        if right:
            proposed = gold
        else:
            rng = random.Random(f"{self.seed}-planted-{task.id}")
            proposed = gold + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if gold + d >= 0])
        return Task(id=task.id, input={**task.input, "proposed": str(proposed)}, answer=task.answer,
                    meta={**task.meta, "planted_right": right})

    def reward(self, task: Task, episode: Any) -> dict[str, float]:
        """Solver: final answer right (1/0). Verifier: the mean of its verdicts' rewards (`verdict_reward`)."""
        state = episode.final_state or {}
        verdicts(task, state)  # checks that every verifier entry names the answer it judged
        paid = [verdict_reward(task, e) for e in state.get("transcript") or [] if e["agent"] == "verifier"]
        return {"solver": self.score(task, state), "verifier": sum(paid) / len(paid) if paid else 0.0}

    def is_success(self, task: Task, episode: Any) -> bool:
        """avg@k / pass@k count the final answer only."""
        return self.score(task, episode.final_state or {}) == 1.0

    def reply_is_valid(self, agent: str, text: str) -> bool:
        """Both agents must write a number (``The answer is N.``); "Yes or No" is not a verdict."""
        if agent in self.agents:
            return parse_answer(text) is not None
        raise ValueError(f"unknown agent {agent!r}; the checked math graph's agents are {list(self.agents)}")

    def answer_is_right(self, task: Task, text: str) -> bool | None:
        """Whether a solver reply's number is the gold answer; ``None`` when it has no number."""
        got = normalize_number(parse_answer(text))
        return None if got is None else got == normalize_number(task.answer)
