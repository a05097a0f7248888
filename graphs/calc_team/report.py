"""The calculator team's held-out numbers per agent, read from a trace store: format and skill apart.

``python -m graphs.calc_team.report FOLDER [FOLDER ...]`` reads every evaluation episode (group ids
``eval:<step>:...``) of ``FOLDER/traces.db``, where FOLDER is a training run's folder or a ``drmas-graph eval``
folder (``run_dir/eval/base-test-k2``), and prints per evaluation step, each number with its n:

- critic (n = critic turns): ``json`` the reply is a JSON object (H1), ``verdict`` it holds a boolean ``correct``,
  ``right verdict`` the verdict is right against the truth, ``approve`` it is ``true``, ``constrained`` the turn
  was decoded under a grammar (the manipulation check of `constrain`);
- worker (n = opening replies, the first model call of each worker turn, before any tool result): ``tool call``
  the reply made a tool call the SDK received (H2), ``opened`` its text opened ``<tool_call>`` or it made a call,
  ``well-formed`` (n = replies that made a call) every call is ``calculator`` with exactly a string
  ``expression``; per episode ``evaluated`` a call's expression evaluated, ``task call`` a call on the task's
  numbers (the worker's call bonus), ``right call`` a call's result is the answer;
- team (n = episodes): ``score`` the final answer is right (H3; a model-error or failed episode is wrong),
  ``model errors``, ``failed``, ``distinct answers`` (a collapse onto one answer shows here) and the worker's most
  frequent opening reply's share.

Like the graph and the environment it does not import ``drmas_graph``: it reads the store's SQLite file.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from graphs.calc_team.env import CalcTeamEnv, episode_stats
from graphs.task import Task
from graphs.tool_calc.report import sign_test

__all__ = ["Rate", "EvalNumbers", "eval_numbers", "main", "sign_test", "task_changes"]


@dataclass(frozen=True)
class Rate:
    """A share with its n."""

    hits: int
    """Items that count."""
    n: int
    """Items looked at."""

    @property
    def value(self) -> float | None:
        """hits / n; None when n is 0."""
        return self.hits / self.n if self.n else None

    def __str__(self) -> str:
        return f"{self.value:.3f} ({self.hits}/{self.n})" if self.n else "- (0/0)"


@dataclass(frozen=True)
class EvalNumbers:
    """One evaluation's held-out numbers (module docstring)."""

    critic_json: Rate
    """Critic turns whose reply is a JSON object."""
    critic_verdict: Rate
    """Critic turns with a boolean ``correct``."""
    critic_right: Rate
    """Critic verdicts right against the truth (over the verdicts of episodes that finished)."""
    critic_approve: Rate
    """Critic turns whose verdict is an approve (a critic that collapsed onto approving shows here)."""
    critic_constrained: Rate
    """Critic turns decoded under a grammar."""
    worker_tool_call: Rate
    """Opening worker replies that made a tool call."""
    worker_opened: Rate
    """Opening worker replies that opened ``<tool_call>`` or made a call."""
    worker_well_formed: Rate
    """Opening worker replies with a call, whose calls are all schema-valid calculator calls."""
    worker_constrained: Rate
    """Opening worker replies decoded under a grammar."""
    evaluated: Rate
    """Episodes with a calculator call that evaluated."""
    task_call: Rate
    """Episodes with a calculator call on the task's numbers (the worker's call bonus)."""
    right_call: Rate
    """Episodes with a calculator call whose result is the answer."""
    score: Rate
    """Episodes whose final answer is right."""
    model_errors: int
    """Episodes the policy's output broke (e.g. a critic reply that is not JSON)."""
    failed: int
    """Episodes that failed (no reward)."""
    distinct_answers: int
    """Distinct final answers (None, no answer, counts as one)."""
    top_reply_share: float
    """The worker's most frequent opening reply's share of its opening replies (whitespace-normalized)."""
    versions: tuple[int, ...]
    """Weights versions that served the evaluation (the manipulation check that training changed them)."""
    by_task: Mapping[str, tuple[float, float]]
    """Per task id: (share of its episodes whose first worker reply made a tool call, team score)."""


def _connect(folder: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"{(folder / 'traces.db').resolve().as_uri()}?mode=ro", uri=True)


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _schema_valid(call: Mapping[str, Any]) -> bool:
    args = call.get("args")
    return (call.get("name") == "calculator" and isinstance(args, dict) and set(args) == {"expression"}
            and isinstance(args["expression"], str))


def _opening(messages_json: str) -> bool:
    """A worker call before any tool result in its turn: the prompt's last message is the user's."""
    messages = json.loads(messages_json)
    return bool(messages) and messages[-1].get("type") == "human"


def _constrained(sampling_json: str | None) -> bool:
    return bool(sampling_json) and json.loads(sampling_json).get("grammar") is not None


def eval_numbers(folder: str | Path, env: CalcTeamEnv | None = None) -> dict[int, EvalNumbers]:
    """`EvalNumbers` of every evaluation in ``folder/traces.db``, by step; the tasks come from `env` or the
    folder's ``config.yaml`` (``env_kwargs``)."""
    folder = Path(folder)
    if env is None:
        config = yaml.safe_load((folder / "config.yaml").read_text())
        env = CalcTeamEnv(**config.get("env_kwargs") or {})
    tasks = {t.id: t for split in ("train", "test") for t in env.tasks(split)}
    conn = _connect(folder)
    try:
        episodes = conn.execute("SELECT id, task_id, group_id, final_state, model_error, error FROM episodes "
                                "WHERE group_id LIKE 'eval:%' ORDER BY rowid").fetchall()
        turns: dict[str, list[tuple]] = defaultdict(list)
        for row in conn.execute("SELECT t.episode_id, t.agent, t.response_text, t.tool_calls, t.messages, t.sampling, "
                                "t.policy_version FROM turns t JOIN episodes e ON e.id = t.episode_id "
                                "WHERE e.group_id LIKE 'eval:%' ORDER BY t.episode_id, t.position"):
            turns[row[0]].append(row[1:])
    finally:
        conn.close()
    by_step: dict[int, list[tuple]] = defaultdict(list)
    for episode_id, task_id, group_id, state_json, model_error, error in episodes:
        by_step[int(group_id.split(":")[1])].append((tasks[task_id], state_json, model_error, error,
                                                      turns[episode_id]))
    return {step: _numbers(rows) for step, rows in sorted(by_step.items())}


def _numbers(rows: list[tuple]) -> EvalNumbers:
    counts: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    answers: set[Any] = set()
    versions: set[int] = set()
    per_task: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for task, state_json, model_error, error, episode_turns in rows:
        state = json.loads(state_json) if state_json else None
        stats = episode_stats(task, state)
        first_call = None
        for agent, text, calls_json, messages_json, sampling_json, version in episode_turns:
            versions.add(version or 0)
            calls = json.loads(calls_json)
            if agent == "critic":
                obj = _json_object(text)
                verdict = obj.get("correct") if isinstance(obj, dict) else None
                counts.update(critic=1, critic_json=isinstance(obj, dict), critic_verdict=isinstance(verdict, bool),
                              critic_approve=verdict is True, critic_constrained=_constrained(sampling_json))
            elif agent == "worker" and _opening(messages_json):
                first_call = bool(calls) if first_call is None else first_call
                replies[" ".join(text.split())] += 1
                counts.update(opening=1, tool_call=bool(calls), opened=bool(calls) or "<tool_call>" in text,
                              with_call=bool(calls), well_formed=bool(calls) and all(map(_schema_valid, calls)),
                              worker_constrained=_constrained(sampling_json))
        judged = stats["verdicts"]
        counts.update(episodes=1, evaluated=stats["well_formed"], task_call=stats["task_call"],
                      right_call=stats["right_call"], score=stats["right"],
                      model_errors=model_error is not None, failed=error is not None, verdicts=len(judged),
                      right_verdicts=sum(a is not None and a == r for r, a in judged))
        answers.add((state or {}).get("answer"))
        per_task[task.id].append((bool(first_call), stats["right"]))
    n = counts["episodes"]
    return EvalNumbers(
        critic_json=Rate(counts["critic_json"], counts["critic"]),
        critic_verdict=Rate(counts["critic_verdict"], counts["critic"]),
        critic_right=Rate(counts["right_verdicts"], counts["verdicts"]),
        critic_approve=Rate(counts["critic_approve"], counts["critic"]),
        critic_constrained=Rate(counts["critic_constrained"], counts["critic"]),
        worker_tool_call=Rate(counts["tool_call"], counts["opening"]),
        worker_opened=Rate(counts["opened"], counts["opening"]),
        worker_well_formed=Rate(counts["well_formed"], counts["with_call"]),
        worker_constrained=Rate(counts["worker_constrained"], counts["opening"]),
        evaluated=Rate(counts["evaluated"], n), task_call=Rate(counts["task_call"], n),
        right_call=Rate(counts["right_call"], n),
        score=Rate(counts["score"], n),
        model_errors=counts["model_errors"], failed=counts["failed"], distinct_answers=len(answers),
        top_reply_share=max(replies.values()) / sum(replies.values()) if replies else 0.0,
        versions=tuple(sorted(versions)),
        by_task={t: (sum(c for c, _ in v) / len(v), sum(r for _, r in v) / len(v)) for t, v in per_task.items()})


def task_changes(before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]],
                 which: int) -> list[float]:
    """Per task in both: after minus before of the task's mean; `which` 0 = tool-call rate, 1 = team score."""
    return [after[t][which] - before[t][which] for t in sorted(before) if t in after]


_ROWS = (("critic: JSON object", "critic_json"), ("critic: boolean verdict", "critic_verdict"),
         ("critic: right verdict", "critic_right"), ("critic: approve", "critic_approve"),
         ("critic: constrained", "critic_constrained"),
         ("worker: tool call (opening replies)", "worker_tool_call"), ("worker: opened <tool_call>", "worker_opened"),
         ("worker: well-formed (replies with a call)", "worker_well_formed"),
         ("worker: constrained", "worker_constrained"), ("episodes: a call evaluated", "evaluated"),
         ("episodes: a call on the task's numbers", "task_call"), ("episodes: a call gave the answer", "right_call"),
         ("team score", "score"),
         ("model-error episodes", "model_errors"), ("failed episodes", "failed"),
         ("distinct final answers", "distinct_answers"), ("top opening reply share", "top_reply_share"),
         ("weights versions", "versions"))


def table(by_step: Mapping[int, EvalNumbers]) -> str:
    """Every evaluation, one column per step."""
    steps = sorted(by_step)
    lines = [f"{'held-out':<44}" + "".join(f"{'step ' + str(s):>22}" for s in steps)]
    for label, field in _ROWS:
        cells = [getattr(by_step[s], field) for s in steps]
        lines.append(f"  {label:<42}" + "".join(f"{c:>22.3f}" if isinstance(c, float) else f"{str(c):>22}"
                                                 for c in cells))
    return "\n".join(lines)


def as_dict(numbers: EvalNumbers) -> dict[str, Any]:
    """JSON-able numbers: each `Rate` as ``{"value", "hits", "n"}``."""
    out = {}
    for key, value in asdict(numbers).items():
        rate = getattr(numbers, key)
        out[key] = {"value": rate.value, "hits": rate.hits, "n": rate.n} if isinstance(rate, Rate) else value
    out["versions"] = list(numbers.versions)
    return out


def main(argv: list[str] | None = None) -> None:
    """Print `table` for each folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", metavar="FOLDER", help="a run or eval folder (traces.db, config.yaml)")
    args = parser.parse_args(argv)
    for folder in args.folders:
        print(f"== {folder}")
        print(table(eval_numbers(folder)))


if __name__ == "__main__":
    main()
