"""The CPU demo's end-of-run table, read from a run's trace store: what each agent can do, before and after.

``python -m graphs.math.report RUN_DIR`` (``scripts/demo.sh`` runs it after training) reads every held-out
evaluation episode of ``RUN_DIR/traces.db`` (group ids ``eval:<step>:...``) and prints, per agent, at the first
and the last evaluation:

- ``format``: share of its replies with a number (``The answer is N.``);
- ``skill``: share right among those replies (solver: the number is the gold answer; verifier: its verdict);
- ``avg@k`` / ``pass@k``: per task, the share of / whether any of its k episodes in which the agent's work was
  all right (solver: the final answer; verifier: every verdict of the episode);
- ``distinct``: distinct replies (whitespace-normalized); ``top share``: the most frequent reply's share of the
  replies; ``top tasks``: tasks given that reply at least once / tasks where it was right every time;
- verifier ``TPR`` (right answers approved), ``TNR`` (wrong answers rejected; an unreadable solver answer,
  with nothing to check, is left out) and their mean, the balanced accuracy.

Like the graph and the environment it does not import ``drmas_graph``: it reads the store's SQLite file.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Mapping

import yaml

from graphs.math.checked_env import CheckedMathEnv
from graphs.math.checked_graph import same_number
from graphs.math.graph import parse_answer
from graphs.task import Task

__all__ = ["AgentRates", "agent_rates", "criteria", "eval_rates", "main", "rates_table", "seeds_table"]


@dataclass(frozen=True)
class AgentRates:
    """One agent's held-out numbers at one evaluation."""

    tasks: int
    """Tasks of the evaluation."""
    replies: int
    """Its replies (LLM calls) over all episodes."""
    format_rate: float
    """Share of its replies with a number."""
    skill: float
    """Share right among its replies with a number (nan when none has one)."""
    avg_k: float
    """Mean over tasks of the share of the task's episodes in which all of its work was right."""
    pass_k: float
    """Share of tasks with at least one such episode."""
    distinct: int
    """Distinct replies (whitespace-normalized)."""
    top_reply: str
    """Its most frequent reply."""
    top_share: float
    """That reply's share of its replies."""
    top_tasks: int
    """Tasks it gave that reply to at least once."""
    top_right_tasks: int
    """Of those, the tasks where that reply was right every time."""
    tpr: float | None = None
    """Verifier only: right answers approved / right answers judged."""
    tnr: float | None = None
    """Verifier only: wrong answers rejected / wrong answers judged (readable ones)."""

    @property
    def balanced_accuracy(self) -> float | None:
        """(TPR + TNR) / 2 for the verifier; None for the solver."""
        return None if self.tpr is None or self.tnr is None else (self.tpr + self.tnr) / 2


def _turns(task: Task, state: Mapping[str, Any]) -> list[tuple[str, str, bool | None, Any]]:
    """(agent, reply, right (None: no number), judged-answer-right or None) for each transcript entry."""
    out = []
    for entry in state.get("transcript") or []:
        number = parse_answer(entry["text"])
        if entry["agent"] == "solver":
            out.append(("solver", entry["text"], None if number is None else same_number(number, task.answer), None))
        elif entry["agent"] == "verifier":
            judged_right = same_number(entry["judged"], task.answer)
            right = None if number is None else same_number(number, entry["judged"]) == judged_right
            out.append(("verifier", entry["text"], right, None if entry["judged"] is None else judged_right))
    return out


def agent_rates(tasks: Mapping[str, Task], episodes: Iterable[Any]) -> dict[str, AgentRates]:
    """Per agent, its `AgentRates` over the episodes of one evaluation (objects with ``task_id`` and
    ``final_state``; an episode without a final state, a failed run, counts as a failure for every agent)."""
    ok: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))  # agent -> task -> success
    replies: dict[str, list[tuple[str, str, bool | None]]] = defaultdict(list)  # agent -> (task, reply, right)
    judged: dict[bool, list[bool]] = {True: [], False: []}  # judged answer right -> approved
    for episode in episodes:
        task = tasks[episode.task_id]
        turns = _turns(task, episode.final_state or {})
        for agent in ("solver", "verifier"):
            mine = [t for t in turns if t[0] == agent]
            if agent == "solver":
                success = bool(mine) and same_number(parse_answer(mine[-1][1]), task.answer)
            else:
                success = bool(mine) and all(t[2] is True for t in mine)
            ok[agent][task.id].append(success)
        for agent, text, right, judged_right in turns:
            replies[agent].append((task.id, " ".join(text.split()), right))
            if agent == "verifier" and judged_right is not None:
                number = parse_answer(text)
                approved = number is not None and right == judged_right
                judged[judged_right].append(approved)
    out = {}
    for agent, by_task in sorted(ok.items()):
        mine = replies[agent]
        parsable = [r for _, _, r in mine if r is not None]
        counts = Counter(text for _, text, _ in mine)
        spread = {text: len({t for t, x, _ in mine if x == text}) for text in counts}
        # the most frequent reply; a tie goes to the reply given to more tasks, then to the first in text order
        # (never to arrival order, which concurrent rollouts change from run to run)
        top, count = min(counts.items(), key=lambda kv: (-kv[1], -spread[kv[0]], kv[0])) if mine else ("", 0)
        top_by_task: dict[str, list[bool]] = defaultdict(list)
        for task_id, text, right in mine:
            if text == top:
                top_by_task[task_id].append(right is True)
        rates = dict(
            tasks=len(by_task), replies=len(mine), format_rate=len(parsable) / len(mine) if mine else float("nan"),
            skill=sum(parsable) / len(parsable) if parsable else float("nan"),
            avg_k=sum(sum(s) / len(s) for s in by_task.values()) / len(by_task),
            pass_k=sum(any(s) for s in by_task.values()) / len(by_task),
            distinct=len({text for _, text, _ in mine}), top_reply=top, top_share=count / len(mine) if mine else 0.0,
            top_tasks=len(top_by_task), top_right_tasks=sum(all(r) for r in top_by_task.values()))
        if agent == "verifier":
            rates.update(tpr=_share(judged[True]), tnr=_share([not approved for approved in judged[False]]))
        out[agent] = AgentRates(**rates)
    return out


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def eval_rates(run_dir: str | Path) -> dict[int, dict[str, AgentRates]]:
    """`agent_rates` of every evaluation in ``run_dir/traces.db``, by step; the tasks come from the run's
    ``config.yaml`` (``env_kwargs``). Reads the store's ``episodes`` table (its ``final_state`` is JSON) with
    sqlite3, read-only."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    env = CheckedMathEnv(**config.get("env_kwargs") or {})
    tasks = {t.id: t for split in ("train", "test") for t in env.tasks(split)}
    conn = sqlite3.connect(f"{(run_dir / 'traces.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT task_id, group_id, final_state FROM episodes WHERE group_id LIKE 'eval:%' "
                            "ORDER BY rowid").fetchall()
    finally:
        conn.close()
    by_step: dict[int, list[Any]] = defaultdict(list)
    for task_id, group_id, state in rows:
        by_step[int(group_id.split(":")[1])].append(
            SimpleNamespace(task_id=task_id, final_state=json.loads(state) if state else None))
    return {step: agent_rates(tasks, episodes) for step, episodes in sorted(by_step.items())}


_ROWS = (("format", "format_rate"), ("skill (right among parsable)", "skill"), ("avg@k", "avg_k"),
         ("pass@k", "pass_k"), ("distinct replies", "distinct"), ("top reply share", "top_share"),
         ("top reply: tasks / right on", "top_tasks"))
_VERIFIER_ROWS = (("TPR (right answers approved)", "tpr"), ("TNR (wrong answers rejected)", "tnr"),
                  ("balanced accuracy", "balanced_accuracy"))


def _cell(rates: AgentRates, field: str) -> str:
    if field == "top_tasks":
        return f"{rates.top_tasks}/{rates.top_right_tasks}"
    value = getattr(rates, field)
    return f"{value}" if isinstance(value, int) else f"{value:.3f}"


def rates_table(by_step: Mapping[int, Mapping[str, AgentRates]], k: int | None = None) -> str:
    """The first and last evaluation of `eval_rates` side by side, one block per agent, then the top replies."""
    first, last = min(by_step), max(by_step)
    lines = [f"{'held-out, per agent':<34}{'step ' + str(first):>10}{'step ' + str(last):>10}"]
    for agent in sorted(by_step[last]):
        rows = _ROWS + (_VERIFIER_ROWS if agent == "verifier" else ())
        lines.append(agent)
        for label, field in rows:
            label = label.replace("@k", f"@{k}") if k else label
            cells = [_cell(by_step[s][agent], field) if agent in by_step[s] else "-" for s in (first, last)]
            lines.append(f"  {label:<32}{cells[0]:>10}{cells[1]:>10}")
    for step in sorted({first, last}):
        for agent, rates in sorted(by_step[step].items()):
            lines.append(f"top reply of {agent} at step {step}: {rates.top_reply[:60]!r} "
                         f"({rates.top_share:.0%} of {rates.replies})")
    return "\n".join(lines)


def seeds_table(runs: Mapping[str, Mapping[int, Mapping[str, AgentRates]]]) -> str:
    """Several runs' `eval_rates` (name -> by step) summarized: per agent and row, the mean and [min, max] over
    the runs at their first and last evaluation."""
    rows = (("format", "format_rate"), ("skill", "skill"), ("avg@k", "avg_k"), ("pass@k", "pass_k"),
            ("distinct replies", "distinct"), ("top reply share", "top_share"))
    lines = [f"{len(runs)} runs ({', '.join(runs)}): mean [min, max]",
             f"{'':<26}{'first evaluation':>24}{'last evaluation':>24}"]
    agents = sorted({a for by_step in runs.values() for a in by_step[max(by_step)]})
    for agent in agents:
        lines.append(agent)
        for label, field in rows + (_VERIFIER_ROWS if agent == "verifier" else ()):
            cells = []
            for pick in (min, max):
                values = [float(getattr(by_step[pick(by_step)][agent], field)) for by_step in runs.values()]
                cells.append(f"{sum(values) / len(values):.3f} [{min(values):.2f}, {max(values):.2f}]")
            lines.append(f"  {label.split(' (')[0]:<24}{cells[0]:>24}{cells[1]:>24}")
    return "\n".join(lines)


def criteria(by_step: Mapping[int, Mapping[str, AgentRates]]) -> dict[str, bool]:
    """Issue 43's checks of one run, first vs last evaluation: held-out avg@k (the solver's, the team's final
    answer) and every agent's skill rise, pass@k does not fall, no agent's top reply goes to more than half of
    the tasks unless it is right on all of them, the verifier's balanced accuracy rises and it rejects some wrong
    answers (TNR > 0: approving everything moves balanced accuracy from 0.498 to 0.500)."""
    first, last = by_step[min(by_step)], by_step[max(by_step)]
    out = {"avg@k rises": last["solver"].avg_k > first["solver"].avg_k,
           "pass@k does not fall": last["solver"].pass_k >= first["solver"].pass_k}
    for agent in sorted(last):
        out[f"{agent} skill rises"] = last[agent].skill > first[agent].skill
        rates = last[agent]
        out[f"{agent} no one-reply collapse"] = (rates.top_tasks * 2 <= rates.tasks
                                                 or rates.top_right_tasks == rates.top_tasks)
    if "verifier" in last:
        out["verifier balanced accuracy rises"] = (last["verifier"].balanced_accuracy or 0.0) > (
            first["verifier"].balanced_accuracy or 0.0) and (last["verifier"].tnr or 0.0) > 0  # rejects some
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m graphs.math.report RUN_DIR [RUN_DIR ...]``: print `rates_table` for each finished demo run
    and, for more than one, `seeds_table`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run folder (traces.db, config.yaml)")
    args = parser.parse_args(argv)
    runs = {}
    for run_dir in args.run_dirs:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        runs[Path(run_dir).name] = eval_rates(run_dir)
        if len(args.run_dirs) > 1:
            print(f"== {run_dir} (seed {config.get('seed')})")
        print(rates_table(runs[Path(run_dir).name], k=(config.get("eval") or {}).get("k")))
        checks = criteria(runs[Path(run_dir).name])
        print("checks: " + ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items()))
    if len(runs) > 1:
        print(seeds_table(runs))


if __name__ == "__main__":
    main()
