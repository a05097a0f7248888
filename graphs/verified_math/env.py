"""Verified math: the math app's problems, with a reward per agent so that the verifier is paid for its job.

Plain Python (no ``drmas_graph`` import). Rewards of one episode (``reward`` returns a dict):

- ``solver``: 1.0 if the final answer is right, else 0.0 (as `MathEnv.score`).
- ``verifier``: the fraction of its verdicts that were right. A verdict judges the answer of the solver round
  it follows (``transcript`` entries carry the round); it is right when it approves a right answer or rejects
  a wrong or unreadable one. An unreadable verdict (the graph ends the episode as if approved) is wrong.

A rejected answer goes back to the solver (up to the graph's ``max_rounds``), so the agents' call counts
differ per episode and the verifier is called more often in episodes where it rejects.

Verifier rates (`verdict_counts`): positive = the judged answer is right. TPR = approved / right answers,
TNR = rejected / wrong answers (catching errors). A verifier that approves everything has TPR 1, TNR 0.
"""

from __future__ import annotations

from typing import Any, Mapping

from graphs.math.env import MathEnv, normalize_number
from graphs.math.graph import parse_answer, parse_verdict
from graphs.task import Task

__all__ = ["VerifiedMathEnv", "verdicts"]


def verdicts(task: Task, final_state: Mapping[str, Any]) -> list[tuple[bool, bool | None]]:
    """``(answer_right, approved)`` for every verifier turn of an episode, in order; ``approved`` is None for
    an unreadable verdict. The judged answer is the parsed reply of the solver turn of the same round."""
    gold = normalize_number(task.answer)
    answers: dict[int, bool] = {}
    out: list[tuple[bool, bool | None]] = []
    for entry in final_state.get("transcript") or []:
        if entry["agent"] == "solver":
            got = normalize_number(parse_answer(entry["text"]))
            answers[entry["round"]] = got is not None and got == gold
        elif entry["agent"] == "verifier":
            if entry["round"] not in answers:
                raise ValueError(f"task {task.id!r}: verifier turn of round {entry['round']} follows no solver "
                                 f"turn of that round (transcript rounds: {sorted(answers)})")
            out.append((answers[entry["round"]], parse_verdict(entry["text"])[0]))
    return out


class VerifiedMathEnv(MathEnv):
    """`MathEnv`'s tasks and format check; `reward` returns ``{"solver": ..., "verifier": ...}``.

    Args: as `MathEnv` (``seed``, ``n_train``, ``n_test``, ``difficulty``).
    """

    def reward(self, task: Task, episode: Any) -> dict[str, float]:
        """Solver: final answer right (1/0). Verifier: share of its verdicts that were right (0 if it never
        judged, which the graph does not allow)."""
        state = episode.final_state or {}
        judged = verdicts(task, state)
        right = [approved is not None and approved == answer_right for answer_right, approved in judged]
        return {"solver": self.score(task, state), "verifier": sum(right) / len(right) if right else 0.0}

    def is_success(self, task: Task, episode: Any) -> bool:
        """avg@k / pass@k count the final answer only (the team reward is the mean of the two agents')."""
        return self.score(task, episode.final_state or {}) == 1.0

    def verdict_counts(self, task: Task, final_state: Mapping[str, Any] | None) -> dict[str, int]:
        """Confusion counts of one episode's verdicts: ``tp`` (right answer approved), ``fn`` (right answer
        rejected or unreadable), ``tn`` (wrong answer rejected), ``fp`` (wrong answer approved or unreadable)."""
        counts = {"tp": 0, "fn": 0, "tn": 0, "fp": 0}
        for answer_right, approved in verdicts(task, final_state or {}):
            if answer_right:
                counts["tp" if approved is True else "fn"] += 1
            else:
                counts["tn" if approved is False else "fp"] += 1
        return counts
