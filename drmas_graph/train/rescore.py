"""Re-scoring a stored run: new rewards and advantages from another reward function or estimator, no model."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.types import Episode

__all__ = ["Rescored", "rescore", "POOLS", "pooled_episode_ids"]

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
    """Reward per agent, from the new reward function."""
    turn_rewards: list[float]
    """Per-turn reward R_i (the reward of the turn's agent), aligned with the episode's turns."""
    advantages: list[float]
    """Per-turn advantage, aligned with the turns; 0.0 for turns that are not trainable."""


def rescore(
    store: TraceStore | str | Path,
    reward_fn: Callable[[Episode], float | Mapping[str, float]],
    *,
    estimator: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    step: int | None = None,
    episodes: str | Iterable[str] = "trained",
    out: str | Path | None = None,
) -> dict[str, Rescored]:
    """Recompute the rewards and advantages of a stored run with another reward function or estimator,
    without any model. Returns {episode id: Rescored}; with ``out``, also writes a new store holding the
    episodes with their new rewards and advantages (the source store is never modified).

    Which episodes are pooled (advantages are normalised over them, group by group): ``episodes=
    "trained"`` (default) takes the episodes training used in the latest run: those with a training step
    and no error, less the ones a resume superseded (`TraceStore.trained_episodes`), so eval episodes,
    failed or bad-reward ones and the steps a killed run trained before it resumed from an earlier
    checkpoint stay out. ``"ok"`` takes every episode whose run did not fail, ``"all"`` every stored
    episode; or pass the episode ids. ``step`` keeps only that training step.

    ``reward_fn(episode)`` returns one team reward (given to every agent) or a reward per agent (it must
    name every agent of the episode). Samples are the trainable turns: sample i gets R_i = reward of its
    agent, group = the episode's group_id (else its task_id), turn id = how many calls its agent made
    before it in the episode; ``compute_advantages`` does the rest. ``step`` restricts to one training
    step. No invalid-turn penalty is applied.
    """
    from drmas_graph.train.advantages import compute_advantages

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

    rewards_N: list[float] = []
    group_ids: list[str] = []
    agent_ids: list[str] = []
    episode_ids: list[str] = []
    turn_ids: list[int] = []
    rewards_by_episode: dict[str, dict[str, float]] = {}
    for episode in episodes:
        rewards = _agent_rewards(episode, reward_fn(episode))
        rewards_by_episode[episode.id] = rewards
        group = episode.group_id if episode.group_id is not None else episode.task_id
        if group is None:
            raise ConfigError(f"episode {episode.id} has neither group_id nor task_id; cannot group it")
        calls_so_far: dict[str, int] = {}
        for turn in episode.turns:
            k = calls_so_far.get(turn.agent, 0)
            calls_so_far[turn.agent] = k + 1
            if turn.trainable:
                rewards_N.append(rewards[turn.agent])
                group_ids.append(group)
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
    result: dict[str, Rescored] = {}
    for episode in episodes:
        rewards = rewards_by_episode[episode.id]
        result[episode.id] = Rescored(
            rewards=rewards,
            turn_rewards=[rewards[t.agent] for t in episode.turns],
            advantages=[next(next_advantage) if t.trainable else 0.0 for t in episode.turns],
        )

    if out is not None:
        config = {
            "rescored_from": str(source_path),
            "estimator": estimator,
            "norm_by_std": norm_by_std,
            "eps": eps,
            "reward_fn": getattr(reward_fn, "__qualname__", repr(reward_fn)),
            "source_config": source_config,
        }
        with TraceStore(out, config=config) as target:
            for episode in episodes:
                new = result[episode.id]
                target.write_episode(
                    dataclasses.replace(
                        episode, rewards=new.rewards, turn_rewards=new.turn_rewards, advantages=new.advantages
                    ),
                    step=steps[episode.id],
                )
    return result


def pooled_episode_ids(store: TraceStore, episodes: str | Iterable[str], *, step: int | None = None) -> list[str]:
    """The ids `rescore` pools: a name from `POOLS` or the ids themselves (see `rescore`)."""
    if isinstance(episodes, str):
        if episodes not in POOLS:
            raise ConfigError(f"rescore episodes={episodes!r}: choose one of {', '.join(POOLS)} or pass episode ids")
        if episodes == "trained":
            return store.trained_episodes(step=step)
        return [s.id for s in store.episodes(step=step, failed=False if episodes == "ok" else None)]
    return list(dict.fromkeys(episodes))


def _agent_rewards(episode: Episode, reward: float | Mapping[str, float]) -> dict[str, float]:
    """reward_fn's answer as {agent: reward} covering every agent of the episode."""
    if isinstance(reward, numbers.Real):
        return {agent: float(reward) for agent in episode.agents}
    if not isinstance(reward, Mapping):
        raise ConfigError(
            f"reward_fn returned {type(reward).__name__} for episode {episode.id}; "
            "return a float or a dict {agent: float}"
        )
    missing = [agent for agent in episode.agents if agent not in reward]
    if missing:
        raise ConfigError(
            f"reward_fn gave no reward to agent(s) {', '.join(map(repr, missing))} of episode {episode.id}; "
            "return a reward for every agent that made a call"
        )
    return {agent: float(r) for agent, r in reward.items()}
