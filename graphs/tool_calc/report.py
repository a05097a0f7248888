"""The tool calculator's held-out numbers, read from a run's trace store: before and after training.

``python -m graphs.tool_calc.report RUN_DIR [RUN_DIR ...]`` reads every evaluation episode of
``RUN_DIR/traces.db`` (group ids ``eval:<step>:...``) and prints, at the first and the last evaluation:

- ``tool-call rate``: share of episodes whose first reply called a tool;
- ``well-formed``: share that called ``multiply`` with two integers; ``right args``: with the task's two numbers;
- ``task score``: share of episodes whose final answer is the exact product (the pre-registered outcome);
- ``distinct answers``: distinct final answers over all episodes (a collapse onto one answer shows here),
  ``distinct first replies`` (whitespace-normalized) and the most frequent first reply's share.

With several runs it adds the pre-registered test (``PREREG.md``): per (run, task) the change of the task's
mean over its k episodes from the first to the last evaluation, and a one-sided exact sign test over the
non-zero changes, for the tool-call rate and for the task score.

Like the graph and the environment it does not import ``drmas_graph``: it reads the store's SQLite file.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from graphs.tool_calc.env import ToolCalcEnv, episode_stats

__all__ = ["EvalNumbers", "eval_numbers", "main", "sign_test", "task_changes"]


@dataclass(frozen=True)
class EvalNumbers:
    """One evaluation's held-out numbers."""

    episodes: int
    """Episodes evaluated (tasks x k)."""
    tool_call_rate: float
    """Share of episodes whose first reply called a tool."""
    well_formed: float
    """Share that called multiply with two integers."""
    right_args: float
    """Share that called it with the task's two numbers."""
    task_score: float
    """Share with the exact product as the final answer."""
    distinct_answers: int
    """Distinct final answers (None, no number, counts as one)."""
    distinct_replies: int
    """Distinct first replies, whitespace-normalized."""
    top_reply_share: float
    """The most frequent first reply's share of the episodes."""
    tools_bound: float
    """Manipulation check: share of first turns recorded with the multiply tool bound."""
    policy_version: int
    """Manipulation check: the highest weights version that served the evaluation (0 = the start weights)."""
    by_task: Mapping[str, tuple[float, float]]
    """Per task id: (tool-call rate, task score) over its k episodes."""


def _rows(run_dir: Path) -> list[tuple[str, str, str | None, str | None, str | None, int | None]]:
    """(task id, group id, final state JSON, first reply, its recorded tools JSON, its policy version) of every
    evaluation episode, read-only."""
    conn = sqlite3.connect(f"{(run_dir / 'traces.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT e.task_id, e.group_id, e.final_state, t.response_text, t.tools, t.policy_version FROM episodes e "
            "LEFT JOIN turns t ON t.episode_id = e.id AND t.position = 0 WHERE e.group_id LIKE 'eval:%' "
            "ORDER BY e.rowid").fetchall()
    finally:
        conn.close()


def eval_numbers(run_dir: str | Path) -> dict[int, EvalNumbers]:
    """`EvalNumbers` of every evaluation in ``run_dir/traces.db``, by step; the tasks come from the run's
    ``config.yaml`` (``env_kwargs``). An episode without a final state (a failed run) counts as no call and
    a wrong answer."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    env = ToolCalcEnv(**config.get("env_kwargs") or {})
    tasks = {t.id: t for split in ("train", "test") for t in env.tasks(split)}
    by_step: dict[int, list[tuple[str, dict[str, bool], Any, str]]] = defaultdict(list)
    checks: dict[int, list[tuple[bool, int]]] = defaultdict(list)
    for task_id, group_id, state_json, first_reply, tools, version in _rows(run_dir):
        state = json.loads(state_json) if state_json else None
        stats = episode_stats(tasks[task_id], state)
        step = int(group_id.split(":")[1])
        by_step[step].append((task_id, stats, (state or {}).get("answer"), " ".join((first_reply or "").split())))
        bound = any("multiply" in json.dumps(t) for t in json.loads(tools or "[]"))
        checks[step].append((bound, version or 0))
    out = {}
    for step, eps in sorted(by_step.items()):
        n = len(eps)
        replies = Counter(r for *_, r in eps)
        per_task: dict[str, list[dict[str, bool]]] = defaultdict(list)
        for task_id, stats, _, _ in eps:
            per_task[task_id].append(stats)
        out[step] = EvalNumbers(
            episodes=n, tool_call_rate=sum(s["called"] for _, s, _, _ in eps) / n,
            well_formed=sum(s["well_formed"] for _, s, _, _ in eps) / n,
            right_args=sum(s["right_args"] for _, s, _, _ in eps) / n,
            task_score=sum(s["right"] for _, s, _, _ in eps) / n,
            distinct_answers=len({a for _, _, a, _ in eps}), distinct_replies=len(replies),
            top_reply_share=max(replies.values()) / n,
            tools_bound=sum(b for b, _ in checks[step]) / n, policy_version=max(v for _, v in checks[step]),
            by_task={t: (sum(s["called"] for s in ss) / len(ss), sum(s["right"] for s in ss) / len(ss))
                     for t, ss in per_task.items()})
    return out


def task_changes(runs: Mapping[str, Mapping[int, EvalNumbers]], which: int) -> list[float]:
    """Per (run, task): last minus first evaluation of the task's mean; `which` 0 = tool-call rate, 1 = score."""
    out = []
    for by_step in runs.values():
        first, last = by_step[min(by_step)].by_task, by_step[max(by_step)].by_task
        out += [last[t][which] - first[t][which] for t in sorted(first) if t in last]
    return out


def sign_test(changes: list[float]) -> tuple[int, int, float]:
    """(ups, non-zero changes, one-sided exact p = P(X >= ups) for X ~ Binomial(n, 1/2))."""
    ups, n = sum(d > 0 for d in changes), sum(d != 0 for d in changes)
    p = sum(math.comb(n, i) for i in range(ups, n + 1)) / 2 ** n if n else 1.0
    return ups, n, p


_ROWS = (("tool-call rate", "tool_call_rate"), ("well-formed multiply calls", "well_formed"),
         ("calls with the task's numbers", "right_args"), ("task score (exact product)", "task_score"),
         ("distinct final answers", "distinct_answers"), ("distinct first replies", "distinct_replies"),
         ("top first reply share", "top_reply_share"), ("check: multiply bound (share)", "tools_bound"),
         ("check: weights version", "policy_version"))


def table(by_step: Mapping[int, EvalNumbers]) -> str:
    """The first and the last evaluation side by side."""
    first, last = min(by_step), max(by_step)
    lines = [f"{'held-out':<32}{'step ' + str(first):>10}{'step ' + str(last):>10}"]
    for label, field in _ROWS:
        cells = [getattr(by_step[s], field) for s in (first, last)]
        lines.append(f"  {label:<30}" + "".join(f"{c:>10}" if isinstance(c, int) else f"{c:>10.3f}" for c in cells))
    lines.append(f"  {'episodes':<30}{by_step[first].episodes:>10}{by_step[last].episodes:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print `table` for each run and, for several runs, the pre-registered sign tests."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run folder (traces.db, config.yaml)")
    args = parser.parse_args(argv)
    runs = {}
    for run_dir in args.run_dirs:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        runs[run_dir] = eval_numbers(run_dir)
        print(f"== {run_dir} (seed {config.get('seed')})")
        print(table(runs[run_dir]))
    if len(runs) > 1:
        for which, name in ((0, "tool-call rate"), (1, "task score")):
            ups, n, p = sign_test(task_changes(runs, which))
            print(f"sign test, {name}: {ups} of {n} non-zero (run, task) changes up; one-sided p = {p:.4f}")


if __name__ == "__main__":
    main()
