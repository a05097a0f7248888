"""Re-scoring a stored run: new rewards and advantages from another reward function, a judge model or another
estimator, no policy model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas_graph.env import BadRewardError, EpisodeScore, Task, group_key
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop._scoring import Unscored, score_episodes, turn_advantages
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
        """{episode id: 'BadRewardError: why'} of the pooled episodes without a usable reward (the judge gave no
        score, a reward that is not a finite number): left out of the advantages; in ``out`` with that error and no
        rewards."""


def rescore(
    store: TraceStore | str | Path,
    reward_fn: Callable[[Episode], float | Mapping[str, float]] | None = None,
    *,
    judge: Any = None,
    env: Any = None,
    tasks: Iterable[Any] | Mapping[str, Any] | None = None,
    invalid_penalty: float | None = None,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    step: int | None = None,
    episodes: str | Iterable[str] = "trained",
    out: str | Path | None = None,
    max_workers: int = 8,
) -> RescoreResult:
    """Score a stored run again, without any policy model: with another reward function, a judge model, the
    environment or another estimator, through training's own scoring (`_scoring.score_episodes`: the same
    validation, invalid-turn penalty and failure rule), so the run's own reward reproduces training's rewards.
    Returns {episode id: Rescored} (a `RescoreResult`); with ``out``, also writes a new store holding the
    episodes with their new rewards, advantages and judgements (the source store is never modified).

    Which episodes are pooled (advantages are normalised over them, group by group): ``episodes=
    "trained"`` (default) takes the episodes training used in the latest run: those with a training step
    and no error, less the ones a resume superseded (`TraceStore.trained_episodes`), so eval episodes,
    failed or bad-reward ones and the steps a killed run trained before it resumed from an earlier
    checkpoint stay out. ``"ok"`` takes every episode whose run did not fail, ``"all"`` every stored
    episode; or pass the episode ids. ``step`` keeps only that training step.

    The rewards come from exactly one of: ``reward_fn(episode)``, which returns one team reward (given to every
    agent) or a reward per agent (it must name every agent of the episode); ``judge``, any object with the
    environment's group hook ``reward_group(task, episodes)`` (a `drmas_graph.rewards.Judge` or `JudgedEnv`),
    called once per group of pooled episodes (episodes grouped by group_id, else task_id, in the order training
    scored them; at most ``max_workers`` groups at once), which returns one reward (float or {agent: float}) or
    exception per episode and sets each episode's `judgement`; or ``env``, an environment (its ``reward_group``,
    else ``reward(task, episode)``, and its ``turn_is_valid``). The judge or env sees the task: looked up by the
    episodes' task_id in ``tasks`` (the env's tasks, so the rubric sees reference answers; a task_id missing from
    them is a ConfigError), or without ``tasks`` rebuilt as ``Task(id=task_id, input=<the stored input>)`` (no
    reference answer).

    Every episode is scored as training scores it (`_scoring.score_episodes`, one path for training, evaluation,
    check and rescore): the reward is checked (a finite number for every agent), a turn that is invalid
    (``turn_is_valid`` says so, its reply broke its format, it caused the model error) loses ``invalid_penalty``
    (None: the run's, as training took it: the stored config's ``invalid_penalty``, else the judge's or env's
    ``invalid_penalty`` attribute, else 0), and truncated / model-error episodes get the stored config's
    ``rollout.truncated_reward`` / ``model_error_reward`` when set. So rescoring a run with the reward it trained
    with reproduces its rewards exactly. An episode without a usable reward (the judge gave no score, the
    reward_group call raised or returned the wrong number of items, a reward that is not a finite number) is
    left out of the advantages: it is listed in the result's ``failed`` with its error and written to ``out`` with
    that error and no rewards; if none of the pooled episodes got a reward, rescore raises BadRewardError naming
    the first failure. The stored judgements of the source are never carried over: ``out`` holds the new
    judge's, or none with a reward function.

    Samples are the trainable turns: sample i gets R_i = its turn reward (its agent's reward, less the penalty
    of an invalid turn), group = the episode's group_id (else its task_id), turn id = how many calls its agent made
    before it in the episode; ``compute_advantages`` does the rest.
    """
    source_of_rewards = _reward_source(reward_fn, judge, env, tasks)
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
        groups.setdefault(group_key(episode), []).append(episode)
    for members in groups.values():  # a group in the order training scored it (the store holds finishing order)
        if all(isinstance(e.metadata.get("group_index"), int) for e in members):
            members.sort(key=lambda e: e.metadata["group_index"])
    by_id = None if tasks is None else _tasks_by_id(tasks)
    runs = [(_task_of(group_id, members, by_id), e) for group_id, members in groups.items() for e in members]
    run_config = source_config or {}
    rollout = run_config.get("rollout") or {}
    if invalid_penalty is None:
        invalid_penalty = run_config.get("invalid_penalty")
    if invalid_penalty is None:
        invalid_penalty = float(getattr(source_of_rewards, "invalid_penalty", 0.0))
    results = score_episodes(source_of_rewards, runs, invalid_penalty=invalid_penalty,
                             truncated_reward=rollout.get("truncated_reward"),
                             model_error_reward=rollout.get("model_error_reward"), max_workers=max_workers)
    scores = {e.id: score for (_, e), score in zip(runs, results) if isinstance(score, EpisodeScore)}
    failed = {e.id: score for (_, e), score in zip(runs, results) if not isinstance(score, EpisodeScore)}
    if episodes and len(failed) == len(episodes):
        first_id, first = next(iter(failed.items()))
        raise BadRewardError(f"rescore: none of the {len(episodes)} pooled episodes got a usable reward; the first "
                             f"failure (episode {first_id}): {first}") from first
    result = RescoreResult(
        _rescored([e for e in episodes if e.id in scores], scores, estimator=estimator, norm_by_std=norm_by_std,
                  eps=eps),
        {e.id: Unscored(e, failed[e.id]).message for e in episodes if e.id in failed})

    if out is not None:
        _write(out, episodes, steps, result, {
            "rescored_from": str(source_path), "estimator": estimator, "norm_by_std": norm_by_std, "eps": eps,
            "invalid_penalty": invalid_penalty,
            "reward_fn": None if reward_fn is None else getattr(reward_fn, "__qualname__", repr(reward_fn)),
            "judge": None if judge is None else _judge_name(judge),
            "env": None if env is None else type(env).__qualname__, "source_config": source_config})
    return result


def _write(out: str | Path, episodes: list[Episode], steps: Mapping[str, int | None], result: RescoreResult,
           config: dict[str, Any]) -> None:
    """A new store at `out` holding `episodes` with their new rewards and advantages (or their error)."""
    with TraceStore(out, config=config) as target:
        for episode in episodes:
            new = result.get(episode.id)
            changes = (dict(rewards=new.rewards, turn_rewards=new.turn_rewards, advantages=new.advantages)
                       if new is not None else
                       dict(rewards={}, turn_rewards=None, advantages=None, error=result.failed[episode.id]))
            target.write_episode(dataclasses.replace(episode, **changes), step=steps[episode.id])


def _reward_source(reward_fn: Callable[[Episode], Any] | None, judge: Any, env: Any,
                   tasks: Iterable[Any] | Mapping[str, Any] | None) -> Any:
    """The object `score_episodes` scores with: the judge, the env, or the reward function as an environment."""
    if sum(x is not None for x in (reward_fn, judge, env)) != 1:
        raise ConfigError("rescore: give exactly one of reward_fn (episode -> reward), judge (an object with "
                          "reward_group(task, episodes), e.g. drmas_graph.rewards.Judge) and env (an environment)")
    if judge is not None and (isinstance(judge, type) or not callable(getattr(judge, "reward_group", None))):
        raise ConfigError(f"rescore judge={judge!r}: not an object with a reward_group(task, episodes) method; "
                          "pass a drmas_graph.rewards.Judge, a JudgedEnv or an env with that method (an instance)")
    if env is not None and (isinstance(env, type) or not (callable(getattr(env, "reward_group", None))
                                                          or callable(getattr(env, "reward", None)))):
        raise ConfigError(f"rescore env={env!r}: not an environment (an instance with reward(task, episode) or "
                          "reward_group(task, episodes))")
    if tasks is not None and reward_fn is not None:
        raise ConfigError("rescore tasks=... is for a judge or an env (it shows them each task); reward_fn sees only "
                          "the episode")
    return judge if judge is not None else env if env is not None else _RewardFn(reward_fn)


class _RewardFn:
    """`rescore`'s ``reward_fn(episode)`` as an environment's ``reward(task, episode)``."""

    def __init__(self, fn: Callable[[Episode], Any]) -> None:
        def reward(task: Any, episode: Episode) -> Any:
            return fn(episode)

        reward.__qualname__ = getattr(fn, "__qualname__", repr(fn))  # errors name the user's function
        self.reward = reward


def _rescored(episodes: list[Episode], scores: Mapping[str, EpisodeScore], *, estimator: str,
              norm_by_std: bool, eps: float) -> dict[str, Rescored]:
    """The new rewards, per-turn rewards and advantages of `episodes` (pooled by `group_key`, rows built as
    training builds them: `_scoring.turn_advantages`), with the judgement each episode now holds."""
    scored = [(episode, scores[episode.id]) for episode in episodes]
    advantages, _ = turn_advantages(scored, estimator=estimator, norm_by_std=norm_by_std, eps=eps)
    return {
        episode.id: Rescored(rewards=score.rewards, turn_rewards=list(score.turn_rewards), advantages=advantages_T,
                             judgement=episode.judgement)
        for (episode, score), advantages_T in zip(scored, advantages)
    }


def _judge_name(judge: Any) -> str:
    return getattr(judge, "name", None) or type(judge).__qualname__


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
