"""`Env`: what a user implements to train a graph: tasks, a reward, and an optional per-turn validity check."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from drmas_graph.errors import ConfigError, DrmasError
from drmas_graph.types import Episode, Turn

__all__ = ["Env", "Task", "score_episode", "EpisodeScore", "Group", "group_key", "fixed_reward", "BadRewardError"]


@dataclass(frozen=True)
class Task:
    """One graph input with a stable id (environments may use their own class with these attributes)."""

    id: str
    """Stable, unique id (groups, traces and resume key on it)."""
    input: Any
    """The graph input."""
    answer: Any = None
    """Reference answer, for the reward."""
    meta: dict = field(default_factory=dict)
    """Free-form extras (difficulty, kind, ...)."""


@runtime_checkable
class Env(Protocol):
    """The training environment.

    Required: `tasks(split)` returns the tasks of a split ('train', 'test', ...), each with `.id` and
    `.input`; `reward(task, episode)` returns a team reward (float) or a reward per agent
    ({agent: float}, see `reward`); a truncated or model-error episode is scored by the config's `rollout.truncated_reward` /
    `rollout.model_error_reward` unless those are null (then `reward` sees `episode.truncated` /
    `episode.model_error`, and `final_state` is the state as of the run's last completed superstep, not an answer). Optional: `turn_is_valid(task, turn) -> bool` (an invalid turn costs
    `invalid_penalty`, as in the paper: math 0.1, search 0.01) and `is_success(task, episode) -> bool`
    for avg@k/pass@k (default: team reward >= the config's success_threshold).

    Optional, for episodes that are several runs of one thread (the environment plays the human; at most
    `rollout.max_resumes` runs after the first; see `drmas_graph.instrumentation._segments`):
    `resume(task, episode, interrupts)` answers the LangGraph `Interrupt`s a run stopped at (a value,
    {interrupt id: value} for several, or a `Command`; None leaves the episode paused, and it fails), and
    `next_input(task, episode)` returns the next user input on the same thread after a run that finished, or
    None to end the conversation. Either may be `async def`; sync ones run on worker threads.

    Optional, for rewards that compare the episodes of a GRPO group or come from a judge model (see
    `drmas_graph.rewards`): `reward_group(task, episodes)` returns the rewards of a group's episodes (those of
    one task rolled out together, in their order), one item per episode: a float, a {agent: float} dict (as
    `reward`), or an exception instance for an episode it could not score (a `drmas_graph.errors.JudgeError`, what
a `rewards.Judge` returns for an episode it gave no usable score, is counted in the
    metric `judge_failed_episodes`, another exception in `bad_reward_episodes`; that episode gets
    `episode.error` and is not trained on). When present, training steps, evaluation and `drmas-graph check`
    call it instead of `reward`, once per group, groups concurrently (from a thread pool: it must be
    thread-safe). Episodes that `rollout.truncated_reward` / `rollout.model_error_reward` score, and truncated
    ones `rollout.mask_truncated` drops, are not passed to it (a group with none left is not sent); failed
    episodes never reach scoring. A list of the wrong length, or `reward_group` raising, makes every episode
    of the group a bad-reward episode (judge-failed if it raised a JudgeError), with an error naming the
    environment. It may set
    `episode.judgement` (a JSON-able dict, stored with the episode). `reward_metrics()` returns counters since
    its last call ({name: number}, e.g. a judge's `judge/calls`, `judge/input_tokens`), called after each
    training step's and each evaluation's scoring and merged into the step's metrics record and the
    evaluation record (keys are 'namespace/name' outside the trainer's own namespaces such as `agent/`).

    Optional, for a reward per LLM call (not only per agent): `turn_rewards(task, episode)` returns the reward
    of some or all of the episode's turns (a turn is one LLM call, `episode.turns[i]`): a list with one float
    per turn, in order, or a dict {turn position i: float} for the turns it pays (the others keep their agent's
    reward). That reward replaces the agent's for the turn's sample: R_i = turn reward - `invalid_penalty` x
    [turn invalid], and the advantage estimators normalize R_i per sample (`agent`, `step_global`,
    `agent_turn`; `episode_global` averages an episode's R_i). `reward` still gives the team and per-agent
    rewards (success, avg@k/pass@k, `agent/<a>/reward_mean`). E.g. a verifier that judges three answers in an
    episode is paid for each verdict: {1: 1.0, 2: 0.0, 3: 1.0}. It is called after `reward` (or
    `reward_group`) for every episode the environment scores, not for those `rollout.truncated_reward` /
    `rollout.model_error_reward` score; a wrong length, an unknown position or a non-finite value raises
    `BadRewardError` naming the environment and the turn (the episode is not trained on).
    """

    def tasks(self, split: str) -> Sequence[Any]: ...

    def reward(self, task: Any, episode: Episode) -> float | Mapping[str, float]:
        """The episode's reward: one float for the team (every agent that acted gets it), or {agent: float}
        with an entry for every agent that acted (each agent trains on its own).

        The team reward of a per-agent dict is the mean of the agents' rewards: it is what
        `success_threshold` is compared with for avg@k/pass@k (unless the environment has `is_success`),
        what `reward/team_mean` logs and what a stored episode's `reward` shows. E.g. {"solver": 1.0,
        "verifier": 0.0} is a team reward of 0.5, so `success_threshold: 1.0` never counts it as a success.
        """
        ...


@dataclass
class EpisodeScore:
    """Rewards of one episode, ready for advantage estimation."""

    rewards: dict[str, float]
    """Reward per agent that acted (a team reward is copied to every agent)."""
    turn_rewards: list[float]
    """R_i per turn = the turn's reward (its agent's, or its own from `env.turn_rewards`) - penalty * [turn
    invalid]; aligned with episode.turns."""
    invalid: list[bool]
    """Whether each turn failed the environment's validity check."""
    team: float
    """The team reward (mean over agents when the environment returned per-agent rewards)."""


@dataclass(frozen=True)
class Group:
    """One GRPO group once scored: a task, its episodes that got a usable reward (in rollout order), their scores."""

    task: Any
    """The task the episodes ran on (None once gathered from another process)."""
    id: str
    """The group's id (`group_key`): the advantage pools are (group, agent)."""
    episodes: tuple[Episode, ...]
    """The episodes kept for training (failed, bad-reward and masked ones are left out)."""
    scores: tuple[EpisodeScore, ...]
    """`scores[i]` is `episodes[i]`'s."""
    advantages: tuple[tuple[float, ...], ...] | None = None
    """`advantages[i]`: the advantage of each turn of `episodes[i]` (0.0 where no policy served the turn); None
    until the step's advantages are estimated (training's `with_advantages`)."""

    def scored(self) -> list[tuple[Episode, EpisodeScore]]:
        """(episode, score) pairs, in order."""
        return list(zip(self.episodes, self.scores))


def group_key(episode: Episode) -> str:
    """The GRPO group an episode is pooled (and judged) in: its group_id, else its task_id."""
    group = episode.group_id if episode.group_id is not None else episode.task_id
    if group is None:
        raise ConfigError(f"episode {episode.id} has neither group_id nor task_id; cannot group it")
    return group


class _EnvReward:
    def __repr__(self) -> str:
        return "ENV_REWARD"


ENV_REWARD: Any = _EnvReward()
"""`score_episode(reward=...)`'s default: ask `env.reward` (no reward given in advance)."""


class BadRewardError(DrmasError, ValueError):
    """The environment returned a reward that cannot be trained on (None, NaN, missing agent), or its `reward`
    or `turn_is_valid` raised (the exception is the `__cause__`)."""


def fixed_reward(episode: Episode, *, truncated_reward: float | None = None,
                 model_error_reward: float | None = None) -> float | None:
    """The configured team reward of an episode that did not finish (`truncated_reward` for a truncated one,
    `model_error_reward` for a model error); None when the environment scores it."""
    return {"truncated": truncated_reward, "model_error": model_error_reward}.get(episode.outcome)


def score_episode(env: Any, task: Any, episode: Episode, *, invalid_penalty: float,
                  truncated_reward: float | None = None, model_error_reward: float | None = None,
                  reward: Any = ENV_REWARD) -> EpisodeScore:
    """Call the environment's reward and validity check for one episode the trainer kept.

    The team reward of a truncated episode is `truncated_reward` and that of a model-error episode
    `model_error_reward` (the config's `rollout` fields); None asks `env.reward` (it sees `episode.truncated`
    / `episode.model_error`; `final_state` is the state as of the run's last completed superstep). `reward`, when given, is
    the raw reward the environment already gave for the episode (its item of `env.reward_group`): it is
    checked and used instead of calling `env.reward` (a configured reward above still takes precedence; an
    exception instance raises `BadRewardError` from it). A turn is invalid when
    `env.turn_is_valid` says so, when its reply failed its structured-output request or its tool calls do not
    parse (`Turn.format_error`), or when it is the turn that caused the model error. A turn's reward is its
    agent's, or the one `env.turn_rewards` gives it (`Env`; not asked for a configured reward above).

    Raises `BadRewardError` for an unusable reward and when `env.reward`, `env.turn_rewards` or
    `env.turn_is_valid` raises (chained), so one bad episode costs its group a sample, never the run.
    """
    fixed = fixed_reward(episode, truncated_reward=truncated_reward, model_error_reward=model_error_reward)
    if fixed is not None:
        raw = fixed
    elif reward is ENV_REWARD:
        raw = _call_env(env.reward, task, episode)
    elif isinstance(reward, BaseException):
        if isinstance(reward, BadRewardError):
            raise reward
        raise BadRewardError(f"env {type(env).__name__} gave no reward for task {getattr(task, 'id', task)!r}: "
                             f"{type(reward).__name__}: {reward}") from reward
    else:
        raw = reward
    agents = episode.agents
    if isinstance(raw, Mapping):
        missing = [a for a in agents if a not in raw]
        if missing:
            raise BadRewardError(f"reward dict for task {task.id!r} lacks agents {missing} (it has {sorted(raw)})")
        rewards = {a: _finite(raw[a], task, a) for a in agents}
        team = sum(rewards.values()) / len(rewards) if rewards else 0.0
    else:
        team = _finite(raw, task, "team")
        rewards = {a: team for a in agents}
    check = getattr(env, "turn_is_valid", None)
    invalid = [bool(t.format_error) or i == episode.model_error_turn
               or bool(check is not None and not _call_env(check, task, t)) for i, t in enumerate(episode.turns)]
    per_turn = [rewards[t.agent] for t in episode.turns]
    if fixed is None and getattr(env, "turn_rewards", None) is not None:
        per_turn = _turn_rewards(env, task, episode, per_turn)
    turn_rewards = [r - invalid_penalty * bad for r, bad in zip(per_turn, invalid)]
    return EpisodeScore(rewards=rewards, turn_rewards=turn_rewards, invalid=invalid, team=team)


def _turn_rewards(env: Any, task: Any, episode: Episode, per_turn: list[float]) -> list[float]:
    """`per_turn` (each turn's agent reward) with the turns `env.turn_rewards(task, episode)` pays replaced: a list
    (one float per turn) or {turn position: float}; anything else raises `BadRewardError`."""
    raw = _call_env(env.turn_rewards, task, episode)
    where = f"env {type(env).__name__}.turn_rewards() on task {getattr(task, 'id', task)!r}"
    n = len(episode.turns)
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, Sequence) and not isinstance(raw, str):
        if len(raw) != n:
            raise BadRewardError(f"{where} returned {len(raw)} rewards for the episode's {n} turns; return one per "
                                 "turn (episode.turns order) or a dict {turn position: reward}")
        items = list(enumerate(raw))
    else:
        raise BadRewardError(f"{where} returned {type(raw).__name__}; return a list (one reward per turn) or a "
                             "dict {turn position: reward}")
    out = list(per_turn)
    for i, value in items:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise BadRewardError(f"{where} returned a reward for turn {i!r}; the episode's turns are 0..{n - 1}")
        out[i] = _finite(value, task, f"turn {i} ({episode.turns[i].agent})")
    return out


def _call_env(fn: Any, task: Any, arg: Any) -> Any:
    try:
        return fn(task, arg)
    except Exception as exc:
        where = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        raise BadRewardError(f"env {where}() raised on task {getattr(task, 'id', task)!r}: "
                             f"{type(exc).__name__}: {exc}") from exc


def _finite(value: Any, task: Any, who: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise BadRewardError(f"reward of {who} for task {task.id!r} is {value!r}, not a number") from None
    if not math.isfinite(x):
        raise BadRewardError(f"reward of {who} for task {task.id!r} is {x}")
    return x


def is_success(env: Any, task: Any, episode: Episode, score: EpisodeScore, threshold: float) -> bool:
    check = getattr(env, "is_success", None)
    return bool(check(task, episode)) if check is not None else score.team >= threshold


def trainable_agent_turns(turns: Sequence[Turn]) -> list[int]:
    """For each turn, how many earlier turns of the same agent the episode has (agent-turn index)."""
    seen: dict[str, int] = {}
    out = []
    for t in turns:
        out.append(seen.get(t.agent, 0))
        seen[t.agent] = out[-1] + 1
    return out
