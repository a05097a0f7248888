"""The answers view: what each agent replies, per phase and step, and whether its replies collapsed.

Replies are compared as an evaluation's ``top_replies`` compares them (`reply_key`: whitespace-normalized, cut to
80 characters). Per (phase, step, agent): the most frequent replies with their count, share and the agent's
mean episode reward over them; over steps: the number of distinct replies and their entropy in bits
(H = -sum_r p_r log2 p_r, p_r the share of reply r): a policy that collapsed onto one answer shows 1 and 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import ReplyCount
from drmas_graph.ui._charts import Series, line_chart
from drmas_graph.ui._data import Run, number_param

__all__ = ["ReplyRow", "answers_view", "reply_key", "entropy_bits", "REPLY_CHARS"]

REPLY_CHARS = 80
"""Replies are compared on their first 80 characters (whitespace-normalized), as evaluations do."""

TOPS = (5, 10, 25, 100)
"""How many replies per agent the view offers to show."""


def reply_key(text: str) -> str:
    """A reply as replies are compared: whitespace runs made one space, cut to `REPLY_CHARS` (marked '...')."""
    reply = " ".join(text.split())
    return reply[:REPLY_CHARS] + ("..." if len(reply) > REPLY_CHARS else "")


def entropy_bits(counts: list[int]) -> float:
    """Shannon entropy in bits of the distribution `counts` describe (0 for one reply)."""
    total = sum(counts)
    if not total:
        return 0.0
    return -sum(c / total * math.log2(c / total) for c in counts if c) + 0.0  # + 0.0: no -0.0


@dataclass(frozen=True)
class ReplyRow:
    """One reply of an agent in a step, as the table shows it."""

    reply: str
    """`reply_key` of the text."""
    count: int
    """Calls that replied it."""
    share: float
    """count / the agent's calls in the step."""
    reward: float | None
    """Mean of the agent's episode reward over those calls (None: none rewarded yet)."""


def _merge(counts: list[ReplyCount]) -> dict[tuple[str | None, int | None, str], dict[str, list[float]]]:
    """(phase, step, agent) -> reply key -> [count, reward sum, rewarded]."""
    out: dict[tuple[str | None, int | None, str], dict[str, list[float]]] = defaultdict(dict)
    for c in counts:
        cell = out[(c.phase, c.step, c.agent)].setdefault(reply_key(c.reply), [0, 0.0, 0])
        cell[0] += c.count
        cell[1] += c.reward_sum
        cell[2] += c.rewarded
    return out


def answers_view(run: Run, params: Mapping[str, str]) -> dict[str, Any]:
    """Template values of the answers page: the phase and step chosen (default: training, its latest step), the top
    replies per agent there, and the distinct-replies and entropy charts over every step."""
    history, charts = run.replies_memo(_history)
    choices = sorted({p for (p, _, _) in history if p is not None}) + ["all"]
    phase = params.get("phase") or ("train" if "train" in choices else "all")
    if phase not in choices:
        raise ConfigError(f"parameter phase={phase!r}: valid values are {', '.join(choices)}")
    top = number_param(params, "top", int)
    top = 10 if top is None else top
    if top not in TOPS:
        raise ConfigError(f"parameter top={top}: valid values are {', '.join(map(str, TOPS))}")
    steps = sorted({s for (p, s, _) in history if s is not None and phase in (p, "all")})
    step = number_param(params, "step", int)
    if step is None and steps:
        step = steps[-1]
    if step is not None and step not in steps:
        raise ConfigError(f"parameter step={step}: the {phase} replies have steps {', '.join(map(str, steps))}")
    tables: dict[str, list[ReplyRow]] = {}
    totals: dict[str, int] = {}
    merged: dict[Any, dict[str, list[float]]] = {}
    if step is None:  # episodes without the trainer's phase and step (rollouts of your own): all together
        merged = {k: v for k, v in _merge(run.store().reply_counts()).items() if k[1] is None}
    for p in ([phase] if phase != "all" else choices[:-1]) if step is not None else []:
        merged.update(_merge(run.store().reply_counts(phase=p, step=step)))  # the step's replies, with rewards
    chosen: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for (_, s, agent), replies in merged.items():  # phase 'all': the phases' replies of the step together
        if s == step:
            for key, (c, total, rewarded) in replies.items():
                cell = chosen[agent].setdefault(key, [0, 0.0, 0])
                cell[0], cell[1], cell[2] = cell[0] + c, cell[1] + total, cell[2] + rewarded
    for agent, replies in sorted(chosen.items()):
        n = sum(int(c) for c, _, _ in replies.values())
        totals[agent] = n
        rows = sorted(replies.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
        tables[agent] = [ReplyRow(key, int(c), c / n, total / rewarded if rewarded else None)
                         for key, (c, total, rewarded) in rows]
    return {"phase": phase, "phases": choices, "step": step, "step_given": "step" in params and bool(params["step"]), "steps": steps, "top": top, "tops": TOPS,
            "tables": tables, "totals": totals, "charts": charts}


def _history(counts: list[ReplyCount]) -> tuple[dict[Any, dict[str, list[float]]], list[Any]]:
    """Every step's replies merged by `reply_key`, and the charts drawn from them."""
    merged = _merge(counts)
    return merged, _charts(merged)


def _charts(merged: Mapping[tuple[str | None, int | None, str], dict[str, list[float]]]) -> list[Any]:
    """Distinct replies and entropy over steps: one line per (phase, agent); colour the phase, style the agent."""
    agents = sorted({a for (_, _, a) in merged})
    phases = sorted({p or "–" for (p, _, _) in merged})
    distinct: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    entropy: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for (phase, step, agent), replies in sorted(merged.items(), key=lambda kv: (kv[0][1] is None, kv[0][1] or 0)):
        if step is None:
            continue
        counts = [int(c) for c, _, _ in replies.values()]
        distinct[(phase or "–", agent)].append((float(step), float(len(counts))))
        entropy[(phase or "–", agent)].append((float(step), entropy_bits(counts)))

    def series(values: Mapping[tuple[str, str], list[tuple[float, float]]]) -> list[Series]:
        return [Series(f"{phase} / {agent}", tuple(points), phases.index(phase), agents.index(agent))
                for (phase, agent), points in sorted(values.items())]

    return [line_chart("distinct replies per step", series(distinct)),
            line_chart("reply entropy (bits) per step", series(entropy))]
