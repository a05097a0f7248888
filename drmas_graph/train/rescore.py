"""Re-scoring a stored run: new rewards and advantages from another reward function, a judge model or another
estimator, no policy model."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas_graph.env import BadRewardError, Task
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode

__all__ = ["Rescored", "RescoreResult", "rescore", "POOLS", "pooled_episode_ids"]

POOLS = {
    "trained": "the episodes training used in the latest run: a training step set, no error, and not "
               "superseded by a resume (eval, failed, bad-reward and pre-resume episodes left out)",
    "ok": "every episode whose run did not fail (eval and superseded pre-resume episodes included)",
    "all": "every stored episode, failed ones included",
}
"""What `rescore(episodes=...)` pools, by name."""


@dataclass(frozen=True)
class Rescored:
    """New rewards and advantages of one stored episode (`rescore`)."""

    rewards: dict[str, float]
    """Reward per agent, from the new reward function or judge."""
    turn_rewards: list[float]
    """Per-turn reward R_i (the reward of the turn's agent), aligned with the episode's turns."""
    advantages: list[float]
    """Per-turn advantage, aligned with the turns; 0.0 for turns that are not trainable."""
    judgement: dict[str, Any] | None = None
    """What the judge made of the episode (`Episode.judgement`) when a judge gave the rewards; else None."""


class RescoreResult(dict[str, Rescored]):
    """{episode id: Rescored} of the episodes `rescore` scored, in pool order, and the ones the judge could not."""

    def __init__(self, rescored: Mapping[str, Rescored], failed: Mapping[str, str]):
        super().__init__(rescored)
        self.failed: dict[str, str] = dict(failed)
        """{episode id: 'ErrorType: why'} of the pooled episodes the judge gave no usable reward (left out of the
        advantages; in ``out`` with that error and no rewards). Always empty with a reward function."""


def rescore(
    store: TraceStore | str | Path,
    reward_fn: Callable[[Episode], float | Mapping[str, float]] | None = None,
    *,
    judge: Any = None,
    tasks: Iterable[Any] | Mapping[str, Any] | None = None,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    step: int | None = None,
    episodes: str | Iterable[str] = "trained",
    out: str | Path | None = None,
    max_workers: int = 8,
) -> RescoreResult:
    """Recompute the rewards and advantages of a stored run with another reward function, a judge model or
    another estimator, without any policy model. Returns {episode id: Rescored} (a `RescoreResult`); with
    ``out``, also writes a new store holding the episodes with their new rewards, advantages and judgements
    (the source store is never modified).

    Which episodes are pooled (advantages are normalised over them, group by group): ``episodes=
    "trained"`` (default) takes the episodes training used in the latest run: those with a training step
    and no error, less the ones a resume superseded (`TraceStore.trained_episodes`), so eval episodes,
    failed or bad-reward ones and the steps a killed run trained before it resumed from an earlier
    checkpoint stay out. ``"ok"`` takes every episode whose run did not fail, ``"all"`` every stored
    episode; or pass the episode ids. ``step`` keeps only that training step.

    The rewards come from exactly one of: ``reward_fn(episode)``, which returns one team reward (given to every
    agent) or a reward per agent (it must name every agent of the episode); or ``judge``, any object with the
    environment's group hook ``reward_group(task, episodes)`` (a `drmas_graph.rewards.Judge` or `JudgedEnv`),
    called once per group of pooled episodes (episodes grouped by group_id, else task_id, in pool order; at most
    ``max_workers`` groups at once), which returns one reward (float or {agent: float}) or exception per episode
    and sets each episode's `judgement`. The judge sees the task: looked up by the episodes' task_id in
    ``tasks`` (the env's tasks, so the rubric sees reference answers; a task_id missing from them is a
    ConfigError), or without ``tasks`` rebuilt as ``Task(id=task_id, input=<the stored input>)`` (no reference
    answer). An exception item (e.g. a JudgeError after the judge's retries) leaves that episode out of the
    advantages: it is listed in the result's ``failed`` and written to ``out`` with the error and no rewards; if
    the judge scored none of the pooled episodes, rescore raises BadRewardError naming the first failure. A
    ``reward_group`` that raises stops the rescore (the error names the group); a list of the wrong length is a
    ConfigError. The stored judgements of the source are never carried over: ``out`` holds the new judge's, or
    none with a reward function.

    Samples are the trainable turns: sample i gets R_i = reward of its agent, group = the episode's group_id
    (else its task_id), turn id = how many calls its agent made before it in the episode;
    ``compute_advantages`` does the rest. No invalid-turn penalty is applied.
    """
    if (reward_fn is None) == (judge is None):
        raise ConfigError("rescore: give exactly one of reward_fn (episode -> reward) and judge (an object with "
                          "reward_group(task, episodes), e.g. drmas_graph.rewards.Judge)")
    if judge is not None and (isinstance(judge, type) or not callable(getattr(judge, "reward_group", None))):
        raise ConfigError(f"rescore judge={judge!r}: not an object with a reward_group(task, episodes) method; "
                          "pass a drmas_graph.rewards.Judge, a JudgedEnv or an env with that method (an instance)")
    if tasks is not None and judge is None:
        raise ConfigError("rescore tasks=... is for a judge (it shows the judge each task); reward_fn sees only "
                          "the episode")
    source = store if isinstance(store, TraceStore) else TraceStore(store, readonly=True)
    try:
        ids = pooled_episode_ids(source, episodes, step=step)
        summaries = {s.id: s for s in source.episodes(step=step)}
        missing = [i for i in ids if i not in summaries]
        if missing:
            raise ConfigError(f"rescore: episode(s) {', '.join(missing[:5])} are not in {source.path}"
                              + (f" at step {step}" if step is not None else ""))
        episodes = [source.load_episode(i) for i in ids]
        steps = {i: summaries[i].step for i in ids}
        source_path, source_config = source.path, source.config
    finally:
        if source is not store:
            source.close()
    groups: dict[str, list[Episode]] = {}
    for episode in episodes:
        episode.judgement = None  # the stored verdict is not the new rewards': only the new judge's is kept
        groups.setdefault(_group_of(episode), []).append(episode)
    for members in groups.values():  # a group in the order training scored it (the store holds finishing order)
        if all(isinstance(e.metadata.get("group_index"), int) for e in members):
            members.sort(key=lambda e: e.metadata["group_index"])

    failed: dict[str, BaseException] = {}
    if judge is not None:
        rewards_by_episode, failed = _judge_groups(judge, groups, tasks, max_workers)
    else:
        rewards_by_episode = {e.id: _agent_rewards(e, reward_fn(e), "reward_fn") for e in episodes}
    if episodes and len(failed) == len(episodes):
        first_id, first = next(iter(failed.items()))
        raise BadRewardError(f"rescore: the judge scored none of the {len(episodes)} pooled episodes; the first "
                             f"failure (episode {first_id}): {type(first).__name__}: {first}") from first
    scored = [e for e in episodes if e.id not in failed]
    result = RescoreResult(_rescored(scored, rewards_by_episode, estimator=estimator, norm_by_std=norm_by_std, eps=eps),
                           {i: f"{type(e).__name__}: {e}" for i, e in failed.items()})

    if out is not None:
        config = {
            "rescored_from": str(source_path),
            "estimator": estimator,
            "norm_by_std": norm_by_std,
            "eps": eps,
            "reward_fn": None if reward_fn is None else getattr(reward_fn, "__qualname__", repr(reward_fn)),
            "judge": None if judge is None else _judge_name(judge),
            "source_config": source_config,
        }
        with TraceStore(out, config=config) as target:
            for episode in episodes:
                new = result.get(episode.id)
                changes = (dict(rewards=new.rewards, turn_rewards=new.turn_rewards, advantages=new.advantages)
                           if new is not None else
                           dict(rewards={}, turn_rewards=None, advantages=None, error=result.failed[episode.id]))
                target.write_episode(dataclasses.replace(episode, **changes), step=steps[episode.id])
    return result


def _rescored(episodes: list[Episode], rewards_by_episode: Mapping[str, dict[str, float]], *, estimator: str,
              norm_by_std: bool, eps: float) -> dict[str, Rescored]:
    """The new rewards, per-turn rewards and advantages of `episodes` (pooled by `_group_of`), with the
    judgement each episode now holds."""
    from drmas_graph.train.advantages import compute_advantages

    rewards_N: list[float] = []
    group_ids: list[str] = []
    agent_ids: list[str] = []
    episode_ids: list[str] = []
    turn_ids: list[int] = []
    for episode in episodes:
        rewards = rewards_by_episode[episode.id]
        calls_so_far: dict[str, int] = {}
        for turn in episode.turns:
            k = calls_so_far.get(turn.agent, 0)
            calls_so_far[turn.agent] = k + 1
            if turn.trainable:
                rewards_N.append(rewards[turn.agent])
                group_ids.append(_group_of(episode))
                agent_ids.append(turn.agent)
                episode_ids.append(episode.id)
                turn_ids.append(k)

    advantages_N = (
        compute_advantages(
            rewards_N, group_ids=group_ids, agent_ids=agent_ids, episode_ids=episode_ids, turn_ids=turn_ids,
            estimator=estimator, norm_by_std=norm_by_std, eps=eps,
        ).tolist()
        if rewards_N
        else []
    )  # fmt: skip
    next_advantage = iter(advantages_N)
    return {
        episode.id: Rescored(
            rewards=rewards_by_episode[episode.id],
            turn_rewards=[rewards_by_episode[episode.id][t.agent] for t in episode.turns],
            advantages=[next(next_advantage) if t.trainable else 0.0 for t in episode.turns],
            judgement=episode.judgement,
        )
        for episode in episodes
    }


def _group_of(episode: Episode) -> str:
    """The GRPO group an episode is pooled (and judged) in: its group_id, else its task_id."""
    group = episode.group_id if episode.group_id is not None else episode.task_id
    if group is None:
        raise ConfigError(f"episode {episode.id} has neither group_id nor task_id; cannot group it")
    return group


def _judge_name(judge: Any) -> str:
    return getattr(judge, "name", None) or type(judge).__qualname__


def _judge_groups(judge: Any, groups: Mapping[str, list[Episode]], tasks: Iterable[Any] | Mapping[str, Any] | None,
                  max_workers: int) -> tuple[dict[str, dict[str, float]], dict[str, BaseException]]:
    """One ``judge.reward_group(task, episodes)`` call per group (at most `max_workers` at once): the rewards
    of the episodes it scored, and the exception item of each one it could not."""
    by_id = None if tasks is None else _tasks_by_id(tasks)
    where = f"{type(judge).__name__}.reward_group"
    jobs = [(group_id, _task_of(group_id, members, by_id), members) for group_id, members in groups.items()]

    def call(job: tuple[str, Any, list[Episode]]) -> Any:
        group_id, task, members = job
        try:
            return judge.reward_group(task, members)
        except Exception as exc:
            exc.add_note(f"rescore: {where} raised for group {group_id!r} "
                         f"({len(members)} episodes)")
            raise

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(jobs)))) as pool:
        answers = list(pool.map(call, jobs))
    rewards: dict[str, dict[str, float]] = {}
    failed: dict[str, BaseException] = {}
    for (group_id, _, members), answer in zip(jobs, answers, strict=True):
        if not isinstance(answer, Sequence) or isinstance(answer, str | bytes) or len(answer) != len(members):
            got = f"{len(answer)} items" if isinstance(answer, Sequence) else type(answer).__name__
            raise ConfigError(f"{where} returned {got} for the {len(members)} episodes of "
                              f"group {group_id!r}; return one reward (or exception) per episode, in order")
        for episode, item in zip(members, answer, strict=True):
            if isinstance(item, BaseException):
                failed[episode.id] = item
            else:
                rewards[episode.id] = _agent_rewards(episode, item, where)
    return rewards, failed


def _tasks_by_id(tasks: Iterable[Any] | Mapping[str, Any]) -> dict[str, Any]:
    by_id: dict[str, Any] = {}
    for task in tasks.values() if isinstance(tasks, Mapping) else tasks:
        if task.id in by_id and by_id[task.id] != task:
            raise ConfigError(f"rescore tasks: two different tasks have id {task.id!r}; task ids must be unique")
        by_id[task.id] = task
    return by_id


def _task_of(group_id: str, members: list[Episode], by_id: dict[str, Any] | None) -> Any:
    """The task a group's episodes ran on: from `by_id` (the env's tasks), else rebuilt from the stored input."""
    task_ids = list(dict.fromkeys(e.task_id for e in members))
    if len(task_ids) > 1:
        raise ConfigError(f"rescore: group {group_id!r} holds episodes of tasks {', '.join(map(repr, task_ids))}; a "
                          "judge compares the episodes of one task")
    task_id = task_ids[0]
    if by_id is None:
        return Task(id=task_id if task_id is not None else group_id, input=members[0].input)
    if task_id not in by_id:
        raise ConfigError(f"rescore: task {task_id!r} (group {group_id!r}) is not in the tasks given; pass the "
                          "env's tasks of every split the run used (train and test), or no tasks to rebuild each "
                          "task from its stored input (without a reference answer)")
    return by_id[task_id]


def pooled_episode_ids(store: TraceStore, episodes: str | Iterable[str], *, step: int | None = None) -> list[str]:
    """The ids `rescore` pools: a name from `POOLS` or the ids themselves (see `rescore`)."""
    if isinstance(episodes, str):
        if episodes not in POOLS:
            raise ConfigError(f"rescore episodes={episodes!r}: choose one of {', '.join(POOLS)} or pass episode ids")
        if episodes == "trained":
            return store.trained_episodes(step=step)
        return [s.id for s in store.episodes(step=step, failed=False if episodes == "ok" else None)]
    return list(dict.fromkeys(episodes))


def _agent_rewards(episode: Episode, reward: float | Mapping[str, float], source: str) -> dict[str, float]:
    """A reward function's or judge's answer (`source` names it) as {agent: reward} covering every agent of the
    episode."""
    if isinstance(reward, numbers.Real):
        return {agent: float(reward) for agent in episode.agents}
    if not isinstance(reward, Mapping):
        raise ConfigError(
            f"{source} returned {type(reward).__name__} for episode {episode.id}; "
            "return a float or a dict {agent: float}"
        )
    missing = [agent for agent in episode.agents if agent not in reward]
    if missing:
        raise ConfigError(
            f"{source} gave no reward to agent(s) {', '.join(map(repr, missing))} of episode {episode.id}; "
            "return a reward for every agent that made a call"
        )
    return {agent: float(r) for agent, r in reward.items()}
