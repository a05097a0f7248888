"""`drmas-graph check`: a preflight on the base models, before training, that says whether training can learn.

GRPO learns only from groups whose episodes got different rewards: a group where every episode got the same
reward has advantages of exactly 0 (no gradient). `preflight` rolls out a few groups the way the first
training step would (the first tasks of the training order, `group_size` episodes each, the same seeds and
sampling), scores them with the training rewards (`env.reward_group` when the environment has it), and
reports per agent the reward's spread, the share of its groups with zero variance, how often its turns were
invalid (environment check or broken format), its replies hit `max_new_tokens` and its calls were decoded under a
grammar (constrained: the format the call asked for, enforced), and one sample reply, then
the environment's `reward_metrics()` (a judge's calls and tokens); `CheckReport.warnings` says what to change
when most groups teach nothing. Nothing is trained; the episodes go to their own trace store, with their rewards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from drmas_graph.config import RolloutConfig
from drmas_graph.env import EpisodeScore
from drmas_graph.train.loop import _scoring
from drmas_graph.train.loop._calls import CallCheck, calls_of
from drmas_graph.train.loop._rollouts import roll_out
from drmas_graph.train.loop._state import HasRunState, RunState, run_state
from drmas_graph.train.loop.metrics import mean_std
from drmas_graph.types import Episode

__all__ = ["AgentCheck", "CheckReport", "preflight", "NO_SIGNAL_EXIT"]

NO_SIGNAL_EXIT = 3
"""`drmas-graph check`'s exit status when no group has any learning signal (0 otherwise, 2 for errors)."""

_REPLY_CHARS = 200


@dataclass(frozen=True)
class AgentCheck:
    """What the preflight saw of one agent."""

    episodes: int
    """Scored episodes the agent acted in."""
    reward_mean: float
    """Mean of its episode rewards."""
    reward_std: float
    """Unbiased std of its episode rewards."""
    reward_min: float
    """Lowest episode reward."""
    reward_max: float
    """Highest episode reward."""
    groups: int
    """Groups with at least two of its turns' rewards (the agent's advantage pools can only form there)."""
    zero_variance_groups: int
    """Of those, groups where every one of its turns got the same reward (advantage 0: nothing to learn)."""
    invalid_rate: float
    """Share of its turns that were invalid (`env.turn_is_valid`, a broken format, the model-error turn)."""
    format_error_rate: float
    """Share of its turns whose reply failed its structured-output request or whose tool calls do not parse."""
    truncated_reply_rate: float
    """Share of its replies that stopped at `max_new_tokens` (finish reason 'length')."""
    constrained_rate: float
    """Share of its turns decoded under the grammar of the format their call asked for (`Turn.sampling.grammar`)."""
    sample_reply: str
    """Its first reply in the first scored episode, cut to 200 characters."""

    @property
    def zero_variance_share(self) -> float:
        return self.zero_variance_groups / self.groups if self.groups else 1.0


@dataclass(frozen=True)
class CheckReport:
    """The preflight's findings (`preflight`)."""

    groups: int
    """Groups rolled out (tasks)."""
    group_size: int
    """Episodes per group."""
    episodes: int
    """Episodes scored (failed, bad-reward and masked truncated episodes are left out and counted)."""
    counts: dict[str, int]
    """The rollout's counts (failed_episodes, truncated_episodes, model_error_episodes, bad_reward_episodes,
    judge_failed_episodes, ...) and the environment's `reward_metrics()` (e.g. judge/calls)."""
    pools: int
    """Advantage pools the configured estimator formed."""
    signal_pools: int
    """Pools with a learning signal: two or more members whose rewards differ."""
    agents: dict[str, AgentCheck] = field(default_factory=dict)
    """Per agent that acted, by name."""
    silent: tuple[str, ...] = ()
    """Agents with a policy that acted in no scored episode."""
    calls: CallCheck | None = None
    """Which LLM calls the episodes made and who answered them (`calls_of`)."""
    model_errors: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per agent whose turn broke an episode (a model error): (such episodes, the first one's `Episode.model_error`:
    the turn, its node and what its reply failed, e.g. the structured-output request)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The config's `rollout` section: the limits that truncate episodes and the rewards unfinished ones get."""

    @property
    def reward_metrics(self) -> dict[str, float]:
        """The environment's `reward_metrics()` of the preflight's scoring (e.g. a judge's calls and tokens)."""
        return {k: v for k, v in self.counts.items() if "/" in k and not k.startswith(_scoring.TRAINER_PREFIXES)}

    @property
    def has_signal(self) -> bool:
        """Whether any group would teach anything (some pool's rewards differ)."""
        return self.signal_pools > 0

    def warnings(self) -> list[str]:
        """One line per problem: agents most of whose groups teach nothing, episodes that did not finish."""
        out = []
        for agent, a in self.agents.items():
            if a.zero_variance_share > 0.5:
                out.append(
                    f"{a.zero_variance_groups} of {a.groups} groups give agent {agent!r} no learning signal "
                    f"(every episode of such a group got the same reward; its rewards overall: mean {a.reward_mean:.3g}, "
                    f"range {a.reward_min:.3g}..{a.reward_max:.3g}): GRPO learns only where rewards in a group differ. "
                    "Make the tasks fit the base model (easier if it always fails, harder if it always succeeds), "
                    "change the prompt so it can sometimes succeed, or make the reward graded (partial credit) "
                    "instead of all-or-nothing; a larger group_size also helps")
            if a.truncated_reply_rate > 0.5:
                out.append(f"agent {agent!r}: {a.truncated_reply_rate:.0%} of its replies stopped at max_new_tokens: "
                           f"raise agents.{agent}.sampling.max_new_tokens or ask for shorter answers")
            if a.invalid_rate > 0.5:
                out.append(f"agent {agent!r}: {a.invalid_rate:.0%} of its turns were invalid (format errors "
                           f"{a.format_error_rate:.0%}); each costs invalid_penalty")
        out += [f"agent {a!r} acted in no scored episode: it would not be trained (does the graph reach it?)"
                for a in self.silent if self.calls is None or self.calls.served.get(a, 0) > 0]
        if self.calls is not None:
            out += self.calls.warnings()
        failed = sum(self.counts.get(k, 0)
                     for k in ("failed_episodes", "bad_reward_episodes", "judge_failed_episodes"))
        out += self._unfinished_warnings()
        total = self.groups * self.group_size
        if failed:
            out.append(f"{failed} of {total} episodes failed or got no usable reward: their errors are in the "
                       "check's traces.db")
        if not self.has_signal:
            out.append(f"no group has any learning signal ({self.pools} advantage pools, every one with equal "
                       "rewards): training would not change the model")
        return out

    def _unfinished_warnings(self) -> list[str]:
        """When more than half of the episodes did not finish: one line for those a limit truncated (naming the
        `rollout.<limit>` settings that stopped them) and one for model errors (by agent, the first one's turn and
        what its reply failed), each with the reward they train with."""
        truncated, model_errors = self.counts.get("truncated_episodes", 0), self.counts.get("model_error_episodes", 0)
        total = self.groups * self.group_size
        if truncated + model_errors <= total / 2:
            return []
        out = []
        if truncated:
            limits = ", ".join(f"{v} by rollout.{limit}: {_setting(getattr(self.rollout, limit, None))}"
                               for k, v in self.counts.items() if k.startswith("truncated/") and v
                               for limit in [k.split("/", 1)[1]])
            out.append(f"{truncated} of {total} episodes were truncated by a limit ({limits}): raise it if the "
                       f"episodes legitimately need more; they train with rollout.truncated_reward "
                       f"({_reward_text(self.rollout.truncated_reward)})")
        if model_errors:
            agents = "; ".join(f"agent {a!r} {n} (first: {first})" for a, (n, first) in self.model_errors.items())
            cut = " or ".join(f"agents.{a}.sampling.max_new_tokens" for a in self.model_errors)
            out.append(f"{model_errors} of {total} episodes were model errors, the policy's reply broke the app: "
                       f"{agents}. Make the agent's reply what its call asks for (its prompt and format "
                       f"instructions; {cut} if replies are cut off); they "
                       f"train with rollout.model_error_reward ({_reward_text(self.rollout.model_error_reward)})")
        return out

    def lines(self) -> list[str]:
        """The report as text: one row per agent, then the sample replies and the warnings."""
        c = self.counts
        rows = [f"{self.groups} groups x {self.group_size} episodes on the base models: {self.episodes} scored, "
                f"{self.signal_pools} of {self.pools} advantage pools with a learning signal",
                f"episodes: {c.get('truncated_episodes', 0)} truncated by a limit, {c.get('model_error_episodes', 0)} "
                f"model errors, {c.get('failed_episodes', 0)} failed, {c.get('bad_reward_episodes', 0)} bad rewards"
                + (f", {c['judge_failed_episodes']} not scored by the judge" if c.get("judge_failed_episodes") else ""),
                f"{'agent':<16}{'reward mean':>12}{'std':>8}{'min':>8}{'max':>8}{'no-signal groups':>18}"
                f"{'invalid':>9}{'format':>8}{'cut off':>9}{'constrained':>13}"]
        for agent, a in self.agents.items():
            rows.append(f"{agent:<16}{a.reward_mean:>12.3f}{a.reward_std:>8.3f}{a.reward_min:>8.3f}{a.reward_max:>8.3f}"
                        f"{f'{a.zero_variance_groups}/{a.groups}':>18}{a.invalid_rate:>9.0%}"
                        f"{a.format_error_rate:>8.0%}{a.truncated_reply_rate:>9.0%}{a.constrained_rate:>13.0%}")
        for agent, a in self.agents.items():
            rows.append(f"sample reply of {agent}: {a.sample_reply!r}")
        if self.calls is not None:
            rows += self.calls.lines()
        scoring = [f"{k} {v:g}" for k, v in self.reward_metrics.items()]
        if scoring:
            rows.append("scoring (the environment's reward_metrics): " + ", ".join(scoring))
        rows += [f"warning: {w}" for w in self.warnings()]
        return rows


def preflight(run: RunState | HasRunState, n_groups: int, progress: Any = None) -> CheckReport:
    """Roll out the first `n_groups` tasks of the training order (`RunState.task_order`) as training step 0 would,
    score them like training does (`_scoring.score_runs`), store their rewards (no training step), and report per agent
    (see `CheckReport`); `run` is a `RunState` or a `Trainer`. `progress(done, total)`: called as episodes end."""
    state = run_state(run)
    cfg = state.cfg
    tasks = state.task_order(0, n_groups)
    batch = roll_out(state.app, state.env, tasks, 0, cfg.group_size, phase="train", seed=cfg.seed,
                     rollout=cfg.rollout, base_config=state.rollout_config, slots=state.episode_slots,
                     progress=progress)
    counts = batch.counts
    groups, unscored = _scoring.score_runs(state.env, batch.runs, counts, invalid_penalty=state.invalid_penalty,
                                           rollout=cfg.rollout,
                                           on_error=_scoring.first_failures_logger(state.notes.logged_failures))
    # the store shows what each episode earned (`traces list`, the UI), and why one got nothing
    _scoring.store_scores(state.store, step=None, groups=groups, unscored=unscored)
    scored = [pair for group in groups for pair in group.scored()]
    _, stats = _scoring.with_advantages(groups, cfg)
    pools = stats.n_pools if stats is not None else 0
    signal = pools - stats.n_zero_variance_pools - stats.n_singleton_pools if stats is not None else 0
    agents = {a: _agent_check(a, scored) for a in state.agent_policies}
    episodes = [ep for _, ep in batch.runs] + [e.episode for e in batch.errors if e.episode is not None]
    return CheckReport(groups=len(tasks), group_size=cfg.group_size, episodes=len(scored), counts=dict(counts),
                       pools=pools, signal_pools=signal, agents={a: c for a, c in agents.items() if c is not None},
                       silent=tuple(a for a, c in agents.items() if c is None),
                       calls=calls_of(episodes, list(state.agent_policies), state.app.agent_for_node),
                       model_errors=_model_errors([ep for _, ep in batch.runs]), rollout=cfg.rollout)


def _setting(value: Any) -> str:
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _reward_text(reward: float | None) -> str:
    return "null: env.reward scores them" if reward is None else f"{reward:g}"


def _model_errors(episodes: Sequence[Episode]) -> dict[str, tuple[int, str]]:
    """Per agent whose turn broke an episode: (such episodes, what the first one's turn failed: `_model_error`)."""
    out: dict[str, tuple[int, str]] = {}
    for ep in episodes:
        if ep.outcome == "model_error":
            agent = ep.turns[ep.model_error_turn].agent
            n, first = out.get(agent, (0, ""))
            out[agent] = (n + 1, first or _model_error(ep))
    return out


def _model_error(episode: Episode) -> str:
    """'turn 2 failed its structured-output request (json_schema 'Answer'): InvalidReplyError: ...' (cut)."""
    turn = episode.turns[episode.model_error_turn]
    spec = turn.response_format
    if spec is not None:
        named = f" {spec['name']!r}" if spec.get("name") else ""
        asked = f"its structured-output request ({spec['type']}{named})"
    else:
        asked = "its tool calls' arguments" if turn.tool_calls else "what the app parses of its reply"
    why = episode.model_error.split("): ", 1)[-1]  # 'turn i (agent, node): <exception>'
    return f"turn {episode.model_error_turn} (node {turn.node!r}) failed {asked}: {why[:_REPLY_CHARS]}"


def _agent_check(agent: str, scored: Sequence[tuple[Episode, EpisodeScore]]) -> AgentCheck | None:
    rewards = [sc.rewards[agent] for _, sc in scored if agent in sc.rewards]
    if not rewards:
        return None
    turns = [(ep, i, sc) for ep, sc in scored for i, t in enumerate(ep.turns) if t.agent == agent]
    by_group: dict[str, list[float]] = defaultdict(list)
    for ep, i, sc in turns:
        by_group[ep.group_id].append(sc.turn_rewards[i])
    pooled = [r for r in by_group.values() if len(r) >= 2]
    mean, std = mean_std(rewards)
    return AgentCheck(
        episodes=len(rewards), reward_mean=mean, reward_std=std, reward_min=min(rewards), reward_max=max(rewards),
        groups=len(pooled), zero_variance_groups=sum(min(r) == max(r) for r in pooled),
        invalid_rate=sum(sc.invalid[i] for _, i, sc in turns) / len(turns),
        format_error_rate=sum(bool(ep.turns[i].format_error) for ep, i, _ in turns) / len(turns),
        truncated_reply_rate=sum(ep.turns[i].finish_reason == "length" for ep, i, _ in turns) / len(turns),
        constrained_rate=_scoring._constrained_share([ep.turns[i] for ep, i, _ in turns]),
        sample_reply=turns[0][0].turns[turns[0][1]].response_text[:_REPLY_CHARS])
