"""What each page shows, computed from a run: chart series, the episode tree, coloured tokens, replay diffs.

Everything stored is arbitrary text (prompts, replies, tool arguments, errors): it reaches the HTML only
through Jinja2's autoescaping or `markupsafe.escape`; the few pieces built here as `Markup` escape every
value they contain.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

from drmas_graph._chat import tool_signature
from drmas_graph.errors import ConfigError
from drmas_graph.types import Episode, Turn
from drmas_graph.ui._charts import Series, line_chart, points
from drmas_graph.ui._data import Run, number_param
from drmas_graph.ui.turns import (PromptText, TokenizerFile, ToolUse, prompt_text, tool_use, turn_flags,
                                  unknown_id)

__all__ = ["AgentStats", "group_stats", "judge_attempt", "group_view", "ChartOptions", "chart_series", "chart_title", "PHASE_CHART", "PHASES", "run_charts", "eval_rows", "episode_view", "judgement_view", "replay_view", "diff_lines", "token_html"]

FIRST_CHARTS = (
    "reward/team_mean", "agent/*/reward_mean", "model/*/grad_norm", "agent/*/approx_kl", "agent/*/entropy",
    "agent/*/clip_frac", "agent/*/ratio_max", "agent/*/truncated_share", "agent/*/model_error_share",
    "agent/*/invalid_rate", "agent/*/tool_calls_per_turn", "agent/*/tool_calls_well_formed",
    "agent/*/response_length", "eval/avg@k", "eval/pass@k", "eval/*/reward",
    "time/step_s", "time/rollout_s", "time/update_s", "time/sync_s", "time/rollout_prefill_s", "time/rollout_decode_s",
    "agent/*/llm_call_s", "agent/*/rollout_prefill_s", "agent/*/rollout_decode_s", "time/score_s", "time/judge_s",
    "time/old_logprobs_s", "time/checkpoint_s",
)  # fmt: skip
"""Charts shown first, in this order (``*``: one line per agent or model); every other metric follows. The chart of
a step's time by phase (`PHASE_CHART`) comes before the first time/ chart."""

PHASE_CHART = "time/*"
"""The chart of a step's seconds, one line per phase (`PHASES`): in one run's charts each phase has its colour;
overlaid runs keep their colour and each phase its line style."""
PHASES = (("rollout", "time/rollout_s"), ("prefill", "time/rollout_prefill_s"), ("decode", "time/rollout_decode_s"),
          ("score", "time/score_s"), ("old logprobs", "time/old_logprobs_s"), ("update", "time/update_s"),
          ("sync", "time/sync_s"), ("checkpoint", "time/checkpoint_s"))
"""(line label, metric) of the phase chart: the rollout's wall time, its engine prefill and decode seconds (embedded
policies), then the step's other phases."""

_TITLES = {"agent/*/ratio_max": "importance weight (max ratio) per agent", "model/*/grad_norm": "gradient norm per model",
           "agent/*/approx_kl": "KL (approx) per agent", "agent/*/clip_frac": "clip fraction per agent",
           "eval/*/reward": "evaluation reward per agent", PHASE_CHART: "seconds per step, by phase",
           "agent/*/tool_calls_per_turn": "tool calls per turn, per agent",
           "agent/*/tool_calls_well_formed": "tool calls well formed, per agent (steps where one was attempted)"}


def _chart_key(key: str, agents: Sequence[str] = ()) -> tuple[str, str]:
    """metric key -> (chart pattern, series part): 'agent/solve/reward_mean' -> ('agent/*/reward_mean', 'solve');
    a name of `agents` (the run's, which may hold '/': 'team/solve') is the part whole."""
    head, _, rest = key.partition("/")
    if head not in ("agent", "model", "eval"):
        return key, ""
    for name in sorted(agents, key=len, reverse=True):  # the longest name: 'team/solve' before 'team'
        metric = rest[len(name) + 1:]
        if rest.startswith(name + "/") and metric and "/" not in metric:
            return f"{head}/*/{metric}", name
    parts = rest.split("/")
    return (f"{head}/*/{parts[1]}", parts[0]) if len(parts) == 2 else (key, "")


@dataclass(frozen=True)
class ChartOptions:
    """How the Runs page draws its charts, as the URL says: smoothing and a step range."""

    smooth: float = 0.0
    """TensorBoard's smoothing weight, 0 (none) to 0.99."""
    from_step: int | None = None
    """First step shown (inclusive); None: the first."""
    to_step: int | None = None
    """Last step shown (inclusive); None: the last."""

    @staticmethod
    def from_params(params: Mapping[str, str]) -> ChartOptions:
        """Parse ``smooth``, ``from_step`` and ``to_step``; a bad value raises ConfigError naming it."""
        smooth = number_param(params, "smooth", float) or 0.0
        if not 0 <= smooth < 1:
            raise ConfigError(f"parameter smooth={smooth}: give a weight from 0 (no smoothing) to 0.99")
        first, last = number_param(params, "from_step", int), number_param(params, "to_step", int)
        if first is not None and last is not None and first > last:
            raise ConfigError(f"parameters from_step={first} and to_step={last}: no step is in that range; give "
                              "from_step <= to_step")
        return ChartOptions(smooth, first, last)

    def params(self) -> dict[str, str]:
        """The URL parameters of these options (defaults left out)."""
        values = {"smooth": self.smooth or None, "from_step": self.from_step, "to_step": self.to_step}
        return {k: str(v) for k, v in values.items() if v is not None}


def chart_series(runs: Sequence[Run], colours: Mapping[str, int], options: ChartOptions) -> dict[str, list[Series]]:
    """Chart pattern -> its series over `runs`: colour by run (`colours`), line style by agent or model name."""
    charts: dict[str, list[Series]] = {}
    found: list[tuple[str, Run, str, list[dict[str, Any]], str]] = []
    for run in runs:
        records = run.metrics()
        agents = run.agents()
        keys: dict[str, None] = {}
        for record in records:
            keys.update(dict.fromkeys(k for k, v in record.items()
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)))
        for key in keys:
            if key in ("time", "step") or key.endswith(("/split", "/k", "/tasks")):
                continue
            pattern, part = _chart_key(key, agents)
            found.append((pattern, run, part, records, key))
    # a line style per part of each family ('agent/*', 'model/*', 'eval/*'), by name: the same in each chart of
    # the family, distinct within it (one style list over every family's parts ran past DASHES and reused one)
    families: dict[str, set[str]] = {}
    for pattern, _, part, _, _ in found:
        families.setdefault(pattern.partition("/")[0], set()).add(part)
    dashes = {(head, part): i for head, names in families.items() for i, part in enumerate(sorted(names - {""}))}
    for pattern, run, part, records, key in found:
        label = f"{run.name} / {part}" if part else run.name
        charts.setdefault(pattern, []).append(Series(
            label, points(records, key, (options.from_step, options.to_step)), colours[run.name],
            dashes.get((pattern.partition("/")[0], part), 0)))
    phases = _phase_series(runs, colours, options)
    if phases:
        charts[PHASE_CHART] = phases
    return charts


def _phase_series(runs: Sequence[Run], colours: Mapping[str, int], options: ChartOptions) -> list[Series]:
    """The lines of `PHASE_CHART`: per run, one per phase it logged."""
    out = []
    for run in runs:
        records = run.metrics()
        for i, (phase, key) in enumerate(PHASES):
            line = points(records, key, (options.from_step, options.to_step))
            if line:
                out.append(Series(f"{run.name} / {phase}" if len(runs) > 1 else phase, line,
                                  colours[run.name] if len(runs) > 1 else i, i if len(runs) > 1 else 0))
    return out


def chart_title(pattern: str) -> str:
    """A chart's caption: 'agent/*/reward_mean' -> 'reward_mean per agent'."""
    if pattern in _TITLES:
        return _TITLES[pattern]
    head, _, tail = pattern.partition("/*/")
    return f"{tail} per {head}" if tail else pattern


def run_charts(runs: Sequence[Run], colours: Mapping[str, int], options: ChartOptions,
               link: Any) -> tuple[list[Markup], list[Markup]]:
    """(the first charts, every other chart) over `runs`; `link(pattern)` is the enlarged chart's URL."""
    charts = chart_series(runs, colours, options)

    def draw(pattern: str) -> Markup:
        return line_chart(chart_title(pattern), charts[pattern], smooth=options.smooth, href=link(pattern))

    order = list(FIRST_CHARTS)
    order.insert(next(i for i, p in enumerate(order) if p.startswith("time/")), PHASE_CHART)
    first = [draw(p) for p in order if p in charts]
    rest = [draw(p) for p in sorted(charts) if p not in order]
    return [c for c in first if c], [c for c in rest if c]


def eval_rows(run: Run) -> tuple[list[str], list[dict[str, Any]], list[tuple[Any, str, list[Mapping[str, Any]]]]]:
    """(columns, rows, most frequent replies) of the run's evaluations: one row per evaluation record, a column per
    scalar; each record's ``<agent>/top_replies`` as (step, agent, [{reply, count, reward}])."""
    rows = [r for r in run.metrics() if any(k.startswith("eval/") for k in r)]
    columns: dict[str, None] = {}
    tops = []
    for row in rows:
        for key, value in row.items():
            if key.endswith("/top_replies") and isinstance(value, list):
                tops.append((row.get("step"), key[5:-len("/top_replies")],
                             [r for r in value if isinstance(r, Mapping)]))
            elif key.startswith("eval/") and not isinstance(value, (list, dict)):
                columns[key] = None
    return list(columns), rows, tops


# -- the episode page ----------------------------------------------------------------------------------------


_LOGPROB_STEPS = (-8.0, -6.0, -4.0, -3.0, -2.0, -1.0, -0.5, -0.2, -0.05)
"""Colour class k of a token: the number of these its logprob reaches (0: below -8, 9: above -0.05, p > 0.95)."""


def token_legend() -> list[tuple[int, str]]:
    """(colour class, the logprob range it stands for) of every token colour, least likely first."""
    edges = [-math.inf, *_LOGPROB_STEPS, 0.0]
    return [(k, f"{edges[k]:g} … {edges[k + 1]:g}" if k else f"< {edges[1]:g}") for k in range(len(edges) - 1)]


def _bucket(logprob: float) -> int:
    """0 (least likely) .. 9 (almost certain): the colour class of a token."""
    return bisect.bisect_right(_LOGPROB_STEPS, logprob) if math.isfinite(logprob) else 0


def token_html(turn: Turn, tokenizer: Any, cache: dict[int, str]) -> Markup:
    """The response as one span per token, coloured by probability; hover shows the id and logprob."""
    spans = []
    for token_id, logprob in zip(turn.response_ids, turn.response_logprobs, strict=True):
        text = cache.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else f"⟨{token_id}⟩"
            cache[token_id] = text = str(escape(text))
        spans.append(f'<span class="t t{_bucket(logprob)}" title="id {token_id} · logprob {logprob:.4f}">{text}</span>')
    return Markup("".join(spans))


def _content(message: Any) -> str:
    return _content_text(message.content)


def _content_text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, indent=1, ensure_ascii=False, default=str)


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=_readable, sort_keys=False)


_ROLES = {"human": "user", "ai": "assistant"}
"""A LangChain message type's chat role where they differ (system, tool: the same)."""


def _readable(value: Any) -> Any:
    """A value JSON cannot hold, as the page shows it: a LangChain message as its role, name, content, tool calls
    (name, args, id) and tool_call_id (was its Python repr); anything else as str()."""
    from langchain_core.messages import BaseMessage

    if not isinstance(value, BaseMessage):
        return str(value)
    out: dict[str, Any] = {"role": _ROLES.get(value.type, value.type)}
    if value.name:
        out["name"] = value.name
    out["content"] = value.content
    calls = getattr(value, "tool_calls", None)
    if calls:
        out["tool_calls"] = [{"name": c["name"], "args": c["args"], "id": c.get("id")} for c in calls]
    if getattr(value, "tool_call_id", None):
        out["tool_call_id"] = value.tool_call_id
    return out


@dataclass(frozen=True)
class TurnView:
    """One LLM call as the episode page shows it."""

    position: int
    turn: Turn
    messages: list[tuple[str, str, str]]  # (role, name, text)
    prompt: PromptText
    """The exact prompt text (its ids decoded), or why the messages stand in for it."""
    tokens: Markup
    advantage: float | None
    turn_reward: float | None
    tool_calls: str
    tool_use: ToolUse | None
    """The tool calls it made and whether they parsed; None: no tools given, no call made."""
    flags: list[tuple[str, str]]
    """(label, meaning) of its flags (`turns.turn_flags`)."""
    broke_app: bool
    tools: list[tuple[str, str, str]]  # the tools the agent was given: (signature, description, JSON schema)


def episode_view(run: Run, episode: Episode) -> dict[str, Any]:
    """Template values of the episode page: the tree (segments > node instances > turns) and each turn."""
    caches: dict[str | None, dict[int, str]] = {}
    found: dict[str, tuple[Any, TokenizerFile]] = {}  # policy -> its tokenizer and where it is, once per page
    turns = []
    for position, turn in enumerate(episode.turns):
        if turn.policy and turn.policy not in found:
            found[turn.policy] = (run.tokenizer(turn.policy), run.tokenizer_file(turn.policy))
        tokenizer, where = found.get(turn.policy or "", (None, TokenizerFile(None, "", ())))
        prompt = prompt_text(turn, tokenizer, where)
        if tokenizer is not None and unknown_id(tokenizer, turn) is not None:  # another model's: ids, not its text
            tokenizer = None
        messages = [(m.type, getattr(m, "name", None) or "", _content(m)
                     + ("\ntool calls: " + _json(m.tool_calls) if getattr(m, "tool_calls", None) else ""))
                    for m in turn.messages]
        turns.append(TurnView(
            position=position, turn=turn, messages=messages, prompt=prompt,
            tokens=token_html(turn, tokenizer, caches.setdefault(turn.policy, {})),
            advantage=None if episode.advantages is None else episode.advantages[position],
            turn_reward=None if episode.turn_rewards is None else episode.turn_rewards[position],
            tool_calls=_json(list(turn.tool_calls)) if turn.tool_calls else "",
            tool_use=tool_use(turn), flags=turn_flags(turn),
            broke_app=position == episode.model_error_turn,
            tools=[(tool_signature(t), str(t.get("function", t).get("description") or ""), _json(t))
                   for t in turn.tools],
        ))
    tree: dict[int, dict[str, list[TurnView]]] = {}
    for view in turns:
        tree.setdefault(view.turn.segment, {}).setdefault(view.turn.call_key or view.turn.node, []).append(view)
    segments = {i: s for i, s in enumerate(episode.segments)}
    has_tokenizer = any(found[t.policy][0] is not None for t in episode.turns if t.trainable and t.policy)
    return {"episode": episode, "turns": turns, "tree": tree, "segments": segments,
            "final_state": _json(episode.final_state), "input": _json(episode.input),
            "has_tokenizer": has_tokenizer, "open_all": len(turns) <= 12, "legend": token_legend(),
            "judgement": None if episode.judgement is None else judgement_view(episode.judgement)}


def judgement_view(record: Mapping[str, Any]) -> dict[str, Any]:
    """Template values of the judge's verdict (`Episode.judgement`): one (who, score, reason) row per agent in
    agent mode, one row for the episode otherwise; the prompt as (role, text); every attempt's raw reply."""
    scores, reasons = record.get("scores"), record.get("reasons")
    if isinstance(scores, Mapping) or isinstance(reasons, Mapping):
        scores = scores if isinstance(scores, Mapping) else {}
        reasons = reasons if isinstance(reasons, Mapping) else {}
        rows = [(agent, scores.get(agent), reasons.get(agent)) for agent in {**scores, **reasons}]
    else:
        rows = [("episode", scores, reasons)]
    prompt = [(str(m.get("role")), _content_text(m.get("content"))) for m in record.get("prompt") or ()
              if isinstance(m, Mapping)]
    return {"record": record, "rows": rows, "prompt": prompt, "replies": [str(r) for r in record.get("replies") or ()]}


@dataclass(frozen=True)
class AgentStats:
    """One agent's rewards over a GRPO group, as the group page shows them."""

    agent: str
    episodes: int
    """Episodes with a reward for the agent."""
    reward_mean: float | None
    """Mean of its episode rewards."""
    reward_std: float | None
    """Their unbiased (N-1) std; None below two."""
    calls: int
    """Its calls with a turn reward (the samples of the `agent` estimator's pool)."""
    turn_mean: float | None
    """Mean turn reward R_i of those calls (episode reward less invalid-call penalties): the pool's mu."""
    turn_std: float | None
    """Their unbiased (N-1) std: the pool's sigma; None below two."""


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def group_stats(episodes: Sequence[Episode]) -> list[AgentStats]:
    """Per agent (in order of first call): its episode rewards' and turn rewards' mean and unbiased std."""
    agents: dict[str, None] = {}
    for episode in episodes:
        agents.update(dict.fromkeys(episode.agents))
    out = []
    for agent in agents:
        rewards = [e.rewards[agent] for e in episodes if agent in e.rewards]
        turns = [r for e in episodes if e.turn_rewards is not None
                 for t, r in zip(e.turns, e.turn_rewards, strict=True) if t.agent == agent]
        out.append(AgentStats(agent, len(rewards), *_mean_std(rewards), len(turns), *_mean_std(turns)))
    return out


def judge_attempt(episode: Episode) -> dict[str, Any] | None:
    """What the judge said of this episode: its attempt number as the judge saw it ('attempt_3': the episode's
    place in the group's prompt), and (who, score, reason) rows; None when no judge scored it."""
    if episode.judgement is None:
        return None
    record = episode.judgement
    index = record.get("index")
    view = judgement_view(record)
    return {"attempt": f"attempt_{index + 1}" if isinstance(index, int) else None, "rows": view["rows"],
            "error": record.get("error"), "mode": record.get("mode")}


def _group_order(episode: Episode, written: int) -> tuple[int, int]:
    """Episodes in the order the judge saw them: the trainer's group_index, else the judge's index."""
    for value in (episode.metadata.get("group_index"), (episode.judgement or {}).get("index")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value, written
    return written, written


def group_view(run: Run, group_id: str) -> dict[str, Any]:
    """Template values of a GRPO group: its episodes side by side in their place in the group (the order the judge,
    if one ran, saw them; `order` says which), each one's and
    each turn's reward and advantage, the judge's attempt number and reason, and each agent's mean and std."""
    store = run.store()
    summaries = store.episodes(group_id=group_id)
    loaded = [store.load_episode(s.id) for s in summaries]
    episodes = [e for _, e in sorted(((_group_order(e, i), e) for i, e in enumerate(loaded)), key=lambda p: p[0])]
    agents: dict[str, None] = {}
    for episode in episodes:
        agents.update(dict.fromkeys(episode.agents))
    judged = {e.id: judge_attempt(e) for e in episodes}
    placed = any(isinstance(e.metadata.get("group_index"), int) for e in episodes)
    order = ("in the order the judge saw them (their place in the group)" if any(judged.values()) else
             "in their place in the group" if placed else "in the order they were written")
    return {"group_id": group_id, "episodes": episodes, "agents": list(agents), "order": order,
            "steps": {s.id: s.step for s in summaries}, "stats": group_stats(episodes),
            "judged": judged,
            "positions": {e.id: e.metadata.get("group_index") for e in episodes}}


# -- replay --------------------------------------------------------------------------------------------------


def diff_lines(text: str) -> list[tuple[str, str]]:
    """(css class, line) of a unified diff: 'add', 'del', 'hunk', 'head' or ''."""
    out = []
    for line in text.splitlines():
        kind = ("head" if line.startswith(("+++", "---")) else "add" if line.startswith("+")
                else "del" if line.startswith("-") else "hunk" if line.startswith("@@") else "")
        out.append((kind, line))
    return out


def replay_view(graph: Any, episode: Episode) -> dict[str, Any]:
    """Replay `episode` into `graph` (no model: the recording answers every call) and what the page shows."""
    from drmas_graph.traces.replay import AsyncOnlyGraphError, areplay_episode, replay_episode

    try:
        result = replay_episode(graph, episode)
    except AsyncOnlyGraphError:
        result = asyncio.run(areplay_episode(graph, episode))
    divergences = [{"divergence": d, "diff": diff_lines(d.diff)} for d in result.divergences]
    return {"result": result, "divergences": divergences, "state_diff": diff_lines(result.state_diff),
            "matched": not divergences and result.state_matches}


def counts(mapping: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in mapping.items())
