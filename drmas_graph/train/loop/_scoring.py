"""From finished episodes to training samples: rewards, advantages, and the step's metrics record.

Scoring returns its results (scores, advantages, errors) as values; it never writes them into the episodes.
`store_scores` is the one writer of scores to the trace store (training, evaluation, check).

- `score_episodes`: the one scoring path (training, evaluation, check, rescore): a reward per episode, checked,
  minus the invalid-turn penalty, or a `BadRewardError` (the caller leaves the episode out).
- `score_runs`: the step's `Group`s: the reward of every kept episode (minus the invalid-turn penalty): the
  environment's for a finished one, `rollout.truncated_reward` / `rollout.model_error_reward` for one that did not finish
  (`score_episode`); a truncated episode `rollout.mask_truncated` names is dropped and counted, so is one
  whose reward is unusable (None, NaN, the env raised, or its judge gave no score: `judge_failed_episodes`), returned
  as `Unscored`.
- `group_rewards`: the rewards of an environment with `reward_group`, one call per group, groups concurrently;
  `reward_metrics`: the environment's counters (`reward_metrics()`), checked, for the step or eval record.
- `turn_advantages`: the advantage of every turn (`compute_advantages`, estimator by name), from rows built in
  one place for training and `rescore`; `with_advantages`: a step's groups with theirs; `trained_samples`: one
  `Sample` per policy-served turn of a trained agent.
- `store_scores`: the scored episodes' rewards, turn rewards, advantages and judgements, and the unscored ones'
  errors, into the trace store.
- `step_record`: the metrics of one training step, per agent (truncated and model-error episodes and their
  share of the samples included); `unfinished_warning`: one line when most episodes did not finish;
  `ZeroSignalWatch`: one line when most advantage pools had zero variance for several steps in a row.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas_graph.config import RolloutConfig, TrainConfig
from drmas_graph.env import (
    ENV_REWARD,
    BadRewardError,
    EpisodeScore,
    Group,
    fixed_reward,
    group_key,
    score_episode,
    trainable_agent_turns,
)
from drmas_graph.errors import JudgeError, RolloutError
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.optim import AdvantageStats, compute_advantages
from drmas_graph.train.loop._timing import old_logprobs_seconds, rollout_times
from drmas_graph.train.loop.metrics import Stopwatch, mean_std
from drmas_graph.types import Episode, Sample, Turn

__all__ = ["Unscored", "score_runs", "first_failures_logger", "score_episodes", "group_rewards", "reward_metrics", "failure_metric", "masked",
           "turn_advantages", "with_advantages", "trained_samples", "store_scores", "step_record", "tool_use",
           "unfinished_metrics", "unfinished_warning", "nothing_to_train", "ZeroSignalWatch"]

log = logging.getLogger(__name__)

GROUP_THREADS = 16
"""At most this many groups are scored at once by an environment's `reward_group` (one thread each)."""


@dataclass(frozen=True)
class Unscored:
    """An episode scoring left out: the environment gave it no reward it can be trained on."""

    episode: Episode
    """The episode (its `judgement`, when a judge tried, is stored with the error)."""
    error: BadRewardError
    """Why: a bad reward (None, NaN, the env raised) or a judge that gave no score (`failure_metric`)."""

    @property
    def message(self) -> str:
        """The episode's stored error: 'BadRewardError: why' (`traces list --failed` finds it)."""
        return f"BadRewardError: {self.error}"


def score_runs(env: Any, runs: list[tuple[Any, Episode]], counts: dict[str, Any], *, invalid_penalty: float,
               rollout: RolloutConfig, on_error: Callable[[BadRewardError], None]
               ) -> tuple[list[Group], list[Unscored]]:
    """Score a training step's runs (`score_episodes`) into their groups, in run order; bad-reward and
    judge-failed episodes are counted in `counts` (`bad_reward_episodes`, `judge_failed_episodes`), reported to
    `on_error`, left out of their group and returned as `Unscored`; so are (counted, not reported, not returned)
    truncated episodes that `rollout.mask_truncated` drops. Then the environment's `reward_metrics()` go into
    `counts`."""
    scored, unscored = [], []
    counts.update(bad_reward_episodes=0, judge_failed_episodes=0, masked_truncated_episodes=0)
    kept = []
    for task, episode in runs:
        if masked(episode, rollout.mask_truncated):
            counts["masked_truncated_episodes"] += 1
        else:
            kept.append((task, episode))
    started = time.perf_counter()
    results = score_episodes(env, kept, invalid_penalty=invalid_penalty, truncated_reward=rollout.truncated_reward,
                             model_error_reward=rollout.model_error_reward)
    if hasattr(env, "reward_group"):  # a judge's calls
        counts["time/judge_s"] = time.perf_counter() - started
    for (task, episode), score in zip(kept, results):
        if isinstance(score, BadRewardError):
            counts[failure_metric(score)] += 1
            unscored.append(Unscored(episode, score))
            on_error(score)
            continue
        scored.append((task, episode, score))
    counts.update(reward_metrics(env))
    return _groups(scored), unscored


def first_failures_logger(logged: set[str]) -> Callable[[BadRewardError], None]:
    """`score_runs`'s `on_error` for a run: logs the first env.reward / reward_group / turn_is_valid exception of the
    run, with its traceback, and the first judge failure (later ones are counted); `logged` holds the metrics
    (`failure_metric`) already logged (the run's notes: a resumed run keeps them)."""

    def on_error(exc: BadRewardError) -> None:
        metric = failure_metric(exc)
        if exc.__cause__ is not None and metric not in logged:
            logged.add(metric)
            kind = "a judge-failed" if metric == "judge_failed_episodes" else "a bad-reward"
            log.warning("%s; the episode counts as %s episode (metric %s), it is not trained on; later ones are "
                        "counted, not logged", exc, kind, metric, exc_info=exc.__cause__)

    return on_error


def _groups(scored: Sequence[tuple[Any, Episode, EpisodeScore]]) -> list[Group]:
    """(task, episode, score) rows as `Group`s, in the rows' order (a step's runs hold each group's episodes
    together, so the groups' episodes in turn are the rows)."""
    by_id: dict[str, tuple[Any, list[Episode], list[EpisodeScore]]] = {}
    for task, episode, score in scored:
        _, episodes, scores = by_id.setdefault(group_key(episode), (task, [], []))
        episodes.append(episode)
        scores.append(score)
    return [Group(task, group_id, tuple(episodes), tuple(scores)) for group_id, (task, episodes, scores) in by_id.items()]


def score_episodes(env: Any, runs: Sequence[tuple[Any, Episode]], *, invalid_penalty: float,
                   truncated_reward: float | None = None, model_error_reward: float | None = None,
                   max_workers: int | None = None) -> list[EpisodeScore | BadRewardError]:
    """The one scoring path of training, evaluation, `drmas-graph check` and `rescore`: a score or the error of
    each (task, episode) run, in order.

    The raw rewards come from `env.reward_group` when the environment has it (one call per group, `group_rewards`),
    else from `env.reward`; truncated and model-error episodes get `truncated_reward` / `model_error_reward` when
    set. Each is checked (a finite number, or one for every agent) and every invalid turn loses `invalid_penalty`
    (`env.score_episode`). The failure rule: an episode without a usable reward (the env raised, the judge gave no
    score, a reward that is not a finite number) gets a `BadRewardError` (the store keeps it as the episode's error:
    `Unscored.message`, `traces list --failed`), and the caller leaves it out (never trained on, never counted as
    a wrong answer). The episodes are not modified (a judge records its `judgement` in them)."""
    given = group_rewards(env, runs, truncated_reward=truncated_reward, model_error_reward=model_error_reward,
                          max_workers=max_workers)
    results: list[EpisodeScore | BadRewardError] = []
    for task, episode in runs:
        try:
            results.append(score_episode(env, task, episode, invalid_penalty=invalid_penalty,
                                         truncated_reward=truncated_reward, model_error_reward=model_error_reward,
                                         reward=given.get(episode.id, ENV_REWARD)))
        except BadRewardError as exc:
            results.append(exc)
    return results


def failure_metric(exc: BadRewardError) -> str:
    """The count an unusable reward goes to: `judge_failed_episodes` when a judge gave no score (a `JudgeError`
    caused it), else `bad_reward_episodes`."""
    return "judge_failed_episodes" if isinstance(exc.__cause__, JudgeError) else "bad_reward_episodes"


def group_rewards(env: Any, runs: Sequence[tuple[Any, Episode]], *, truncated_reward: float | None,
                  model_error_reward: float | None, max_workers: int | None = None) -> dict[str, Any]:
    """The raw rewards `env.reward_group` gives, by episode id: {} when the environment has no `reward_group`.

    The runs that need the environment's reward (not the truncated / model-error ones `truncated_reward` /
    `model_error_reward` score) are grouped by `group_id` (a training group, or one task's k evaluation
    episodes), keeping their order; each group is one `reward_group(task, episodes)` call, the groups run
    concurrently on up to `max_workers` threads (default `GROUP_THREADS`). An item is a reward (float or {agent: float}, checked
    later by `score_episode`) or a `BadRewardError` (the item was an exception, caused by it; or the group's
    call raised or returned the wrong number of items: then every episode of the group gets one)."""
    call = getattr(env, "reward_group", None)
    if call is None:
        return {}
    groups: dict[str, tuple[Any, list[Episode]]] = {}
    for task, episode in runs:
        if fixed_reward(episode, truncated_reward=truncated_reward, model_error_reward=model_error_reward) is None:
            groups.setdefault(episode.group_id or str(task.id), (task, []))[1].append(episode)
    if not groups:
        return {}
    threads = min(len(groups), max_workers or GROUP_THREADS)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward-group") as pool:
        futures = [(episodes, pool.submit(_reward_group, env, call, group_id, task, episodes))
                   for group_id, (task, episodes) in groups.items()]
        return {ep.id: item for episodes, future in futures for ep, item in zip(episodes, future.result())}


def _reward_group(env: Any, call: Callable[..., Any], group_id: str, task: Any, episodes: list[Episode]
                  ) -> list[Any]:
    """One group's `reward_group` items, exceptions (the items' own, the call's) turned into BadRewardErrors."""
    where = f"env {type(env).__name__}.reward_group()"
    group = f"group {group_id!r} (task {getattr(task, 'id', task)!r})"
    try:
        items = list(call(task, list(episodes)))
    except Exception as exc:
        error = BadRewardError(f"{where} raised on {group}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return [error] * len(episodes)
    if len(items) != len(episodes):
        error = BadRewardError(f"{where} returned {len(items)} rewards for the {len(episodes)} episodes of {group}; "
                               "it must return one per episode, in their order")
        return [error] * len(episodes)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, BaseException):
            error = BadRewardError(f"{where} gave no reward for episode {i} ({episodes[i].id}) of {group}: "
                                   f"{type(item).__name__}: {item}")
            error.__cause__ = item
            item = error
        out.append(item)
    return out


TRAINER_PREFIXES = ("agent/", "model/", "adv/", "time/", "samples/", "reward/", "rollout/", "async/", "truncated/",
                    "eval/")
"""Namespaces of the trainer's own metrics, which an environment's `reward_metrics()` keys must not use."""


def reward_metrics(env: Any) -> dict[str, float]:
    """The environment's `reward_metrics()` (counters since its last call), {} when it has none. Each key is
    'namespace/name' outside the trainer's namespaces (`TRAINER_PREFIXES`), each value a number; otherwise a
    TypeError or ValueError names the environment and the key."""
    call = getattr(env, "reward_metrics", None)
    if call is None:
        return {}
    where = f"env {type(env).__name__}.reward_metrics()"
    metrics = call()
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} returned {type(metrics).__name__}, not a dict {{name: number}}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or "/" not in key.strip("/") or key.startswith(TRAINER_PREFIXES):
            raise ValueError(f"{where} returned the key {key!r}: keys are 'namespace/name' (e.g. 'judge/calls'), "
                             f"outside the trainer's own namespaces {', '.join(TRAINER_PREFIXES)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where} returned {key!r}: {value!r}, not a number")
        out[key] = value if isinstance(value, int) else float(value)
    return out


def masked(episode: Episode, mask_truncated: bool | Sequence[str]) -> bool:
    """True for a truncated episode that `rollout.mask_truncated` drops (all of them, or those of the limits
    it lists)."""
    if episode.truncated_by is None:
        return False
    return mask_truncated is True or (not isinstance(mask_truncated, bool) and episode.truncated_by in mask_truncated)


def turn_advantages(scored: Sequence[tuple[Episode, EpisodeScore]], *, estimator: str, norm_by_std: bool,
                    eps: float) -> tuple[list[list[float]], AdvantageStats | None]:
    """The advantage of every turn of each (episode, score), 0.0 where no policy served the turn, and the pools'
    statistics (None when no turn was policy-served). Training and `rescore` build their rows here: a row is a
    policy-served turn, R_i its turn reward, its group `group_key(episode)`, its agent the turn's, its turn id how
    many turns its agent had before it in the episode; `compute_advantages` does the rest."""
    advantages_E = [[0.0] * len(episode.turns) for episode, _ in scored]
    rows = []  # (episode position, turn position)
    rewards_N, group_ids, agent_ids, episode_ids, turn_ids = [], [], [], [], []
    for e, (episode, score) in enumerate(scored):
        agent_turns = trainable_agent_turns(episode.turns)
        for i, turn in enumerate(episode.turns):
            if turn.trainable:
                rows.append((e, i))
                rewards_N.append(score.turn_rewards[i])
                group_ids.append(group_key(episode))
                agent_ids.append(turn.agent)
                episode_ids.append(episode.id)
                turn_ids.append(agent_turns[i])
    if not rows:
        return advantages_E, None
    adv_N, stats = compute_advantages(rewards_N, group_ids=group_ids, agent_ids=agent_ids, episode_ids=episode_ids,
                                      turn_ids=turn_ids, estimator=estimator, norm_by_std=norm_by_std, eps=eps,
                                      return_stats=True)
    for (e, i), adv in zip(rows, adv_N.tolist()):
        advantages_E[e][i] = adv
    return advantages_E, stats


def with_advantages(groups: Sequence[Group], cfg: TrainConfig) -> tuple[list[Group], AdvantageStats | None]:
    """The groups with the advantage of every turn of their episodes (`Group.advantages`, `turn_advantages` over
    all of them: the pools are (group, agent)), and the estimator's statistics."""
    scored = [pair for group in groups for pair in group.scored()]
    advantages_E, stats = turn_advantages(scored, estimator=cfg.estimator, norm_by_std=cfg.norm_by_std,
                                          eps=cfg.adv_eps)
    out, start = [], 0
    for group in groups:
        end = start + len(group.episodes)
        out.append(dataclasses.replace(group, advantages=tuple(tuple(a) for a in advantages_E[start:end])))
        start = end
    return out, stats


def trained_samples(groups: Sequence[Group], trained_agents: Sequence[str]) -> list[Sample]:
    """One `Sample` per policy-served turn of a trained agent, with its advantage (groups `with_advantages`)."""
    trained = set(trained_agents)
    return [Sample.from_turn(turn, adv, episode.id)
            for group in groups for episode, advantages_T in zip(group.episodes, _advantages(group))
            for turn, adv in zip(episode.turns, advantages_T) if turn.trainable and turn.agent in trained]


def _advantages(group: Group) -> tuple[tuple[float, ...], ...]:
    if group.advantages is None:
        raise ValueError(f"group {group.id!r} has no advantages yet: pass the groups through with_advantages")
    return group.advantages


def store_scores(store: TraceStore, *, step: int | None, groups: Iterable[Group] = (),
                 scored: Iterable[tuple[Episode, EpisodeScore]] = (), unscored: Iterable[Unscored] = ()) -> None:
    """The one writer of scores to the trace store. Each episode of `groups` (and each `scored` pair) gets its
    rewards, turn rewards, its group's advantages when estimated, and its judgement when a judge gave one; with
    `step`, that training step (None: evaluation, `check`: the stored step stays). Each `unscored` episode gets
    its error and judgement (never a training step)."""
    rows = [(ep, sc, None if g.advantages is None else g.advantages[i])
            for g in groups for i, (ep, sc) in enumerate(g.scored())] + [(ep, sc, None) for ep, sc in scored]
    if rows:  # nothing to write touches no store (a rollout thread may outlive a stopped run's store)
        store.record_training(step, [dataclasses.replace(episode, rewards=score.rewards,
                                                         turn_rewards=score.turn_rewards,
                                                         advantages=None if adv is None else list(adv))
                                     for episode, score, adv in rows])
    for u in unscored:
        store.update_training(u.episode.id, step=None, judgement=u.episode.judgement, error=u.message)


def _constrained_share(turns: Sequence[Turn]) -> float:
    """The share of `turns` (at least one) decoded under the grammar of the format their call asked for
    (`Turn.sampling.grammar` set: `drmas_graph.grammar`): `agent/<a>/constrained_rate` and `check`'s column."""
    return sum(t.sampling is not None and t.sampling.grammar is not None for t in turns) / len(turns)


def step_record(step: int, agents: Sequence[str], groups: Sequence[Group], counts: dict[str, int],
                adv_stats: AdvantageStats | None, update_metrics: dict[str, float], times: Stopwatch,
                sync_s: float) -> dict[str, Any]:
    """The metrics of one step: counts, time split (`times`: the laps rollout, score and update, whose `sync_s`
    seconds pushed weights), team reward, and per agent reward, advantage, calls, invalid rate, response length and
    tool use (`tool_use`); then the updaters' metrics."""
    scored = [pair for group in groups for pair in group.scored()]
    advantages = {ep.id: adv for group in groups for ep, adv in zip(group.episodes, _advantages(group))}
    rollout_s, old_s = times.laps["rollout"], old_logprobs_seconds(update_metrics)
    record: dict[str, Any] = {"step": step, **counts, "episodes": len(scored),
                              "time/rollout_s": rollout_s, "time/score_s": times.laps["score"],
                              "time/old_logprobs_s": old_s, "time/update_s": times.laps["update"] - sync_s - old_s,
                              "time/sync_s": sync_s, "time/step_s": times.total()}
    episodes = [ep for ep, _ in scored]
    record.update(rollout_times(agents, episodes))
    n_tokens = sum(len(turn.response_ids) for ep in episodes for turn in ep.turns)
    record["rollout/tokens_per_s"] = n_tokens / max(rollout_s, 1e-9)
    record["reward/team_mean"] = mean_std([s.team for _, s in scored])[0]
    record["adv/zero_variance_pools"] = adv_stats.n_zero_variance_pools if adv_stats is not None else 0
    record["adv/pools"] = adv_stats.n_pools if adv_stats is not None else 0
    record.update(unfinished_metrics(agents, episodes))
    for agent in agents:
        rewards = [sc.rewards[agent] for _, sc in scored if agent in sc.rewards]
        turns = [(ep, i) for ep in episodes for i, turn in enumerate(ep.turns) if turn.agent == agent]
        served = [(ep.turns[i], advantages[ep.id][i]) for ep, i in turns if ep.turns[i].trainable]  # have one
        invalid = [sc.invalid[i] for ep, sc in scored for i, turn in enumerate(ep.turns) if turn.agent == agent]
        record[f"agent/{agent}/reward_mean"], record[f"agent/{agent}/reward_std"] = mean_std(rewards)
        record[f"agent/{agent}/advantage_mean"], record[f"agent/{agent}/advantage_std"] = mean_std(
            [adv for _, adv in served], ddof=0)
        record[f"agent/{agent}/advantage_sq_mean"] = (
            sum(adv * adv for _, adv in served) / len(served) if served else 0.0)  # E[A^2] (Dr. MAS's argument)
        record[f"agent/{agent}/calls"] = len(turns)
        record[f"agent/{agent}/invalid_rate"] = sum(invalid) / len(invalid) if invalid else 0.0
        if turns:  # the share of its calls decoded under a grammar (constrained decoding)
            record[f"agent/{agent}/constrained_rate"] = _constrained_share([ep.turns[i] for ep, i in turns])
        record[f"agent/{agent}/response_length"] = (
            sum(len(t.response_ids) for t, _ in served) / len(served) if served else 0.0)
        record.update(tool_use(agent, [ep.turns[i] for ep, i in turns]))
        if not turns:
            record[f"agent/{agent}/never_acted"] = 1
    record.update(update_metrics)
    return record


def tool_use(agent: str, turns: Sequence[Turn]) -> dict[str, float]:
    """The agent's tool use over its `turns` with tools bound: `agent/<a>/tool_calls_per_turn` (the calls that parsed,
    `Turn.tool_calls`, per such turn; absent without one) and `agent/<a>/tool_calls_well_formed` (the share of those
    that attempted a call, a parsed one or one that does not parse, whose calls all parse; absent where none did)."""
    tooled = [t for t in turns if t.tools]
    if not tooled:
        return {}
    out = {f"agent/{agent}/tool_calls_per_turn": sum(len(t.tool_calls) for t in tooled) / len(tooled)}
    attempted = [t for t in tooled if t.tool_calls or _broken_tool_calls(t)]
    if attempted:
        out[f"agent/{agent}/tool_calls_well_formed"] = sum(not _broken_tool_calls(t) for t in attempted) / len(attempted)
    return out


def _broken_tool_calls(turn: Turn) -> bool:
    """The turn's `format_error` is about its tool calls: tool calls that do not parse (a call without a
    structured-output request), or a reply that failed a forced tool call (`tool` / `any_tool` request)."""
    spec = turn.response_format
    return turn.format_error is not None and (spec is None or spec.get("type") in ("tool", "any_tool"))


def unfinished_metrics(agents: Sequence[str], episodes: Sequence[Episode]) -> dict[str, float]:
    """Among the scored episodes: the share of the policy-served turns (the samples) that come from truncated
    and from model-error episodes, over all agents (`samples/...`) and per agent; per agent also the
    model-error episodes whose offending turn was its."""
    record: dict[str, float] = {}
    served = [(ep, t) for ep in episodes for t in ep.turns if t.trainable]
    for prefix, rows in [("samples", served)] + [(f"agent/{a}", [r for r in served if r[1].agent == a]) for a in agents]:
        for kind in ("truncated", "model_error"):
            record[f"{prefix}/{kind}_share"] = sum(ep.outcome == kind for ep, _ in rows) / len(rows) if rows else 0.0
    for agent in agents:
        record[f"agent/{agent}/model_error_episodes"] = sum(
            ep.outcome == "model_error" and ep.turns[ep.model_error_turn].agent == agent for ep in episodes)
    return record


def unfinished_warning(record: dict[str, Any], n_episodes: int) -> str | None:
    """One line when more than half of a step's `n_episodes` were truncated or model errors, naming the limits
    and the agents; None otherwise."""
    truncated, model_errors = record.get("truncated_episodes", 0), record.get("model_error_episodes", 0)
    if truncated + model_errors <= n_episodes / 2:
        return None
    parts = []
    if truncated:
        limits = ", ".join(f"{k.split('/', 1)[1]} {int(v)}" for k, v in record.items()
                           if k.startswith("truncated/") and v)
        parts.append(f"{truncated} truncated ({limits}; raise the limit in the config's `rollout` "
                     "section if episodes legitimately need more)")
    if model_errors:
        agents = ", ".join(f"{k[len('agent/'):-len('/model_error_episodes')]} {int(v)}" for k, v in record.items()
                           if k.startswith("agent/") and k.endswith("/model_error_episodes") and v)
        parts.append(f"{model_errors} model errors (by agent: {agents}; the policy's output broke the app, e.g. "
                     "not the JSON its structured-output call asked for)")
    return (f"step {record['step']}: {truncated + model_errors} of {n_episodes} episodes did not finish: "
            + "; ".join(parts) + ". They are trained on with rollout.truncated_reward / rollout.model_error_reward "
            "(metrics truncated_episodes, model_error_episodes)")


class ZeroSignalWatch:
    """Warns when more than half of the advantage pools (`adv/zero_variance_pools` of `adv/pools`) had zero
    variance for `patience` consecutive steps: those groups train on nothing. Once per streak."""

    def __init__(self, patience: int = 3) -> None:
        self.patience = patience
        self.streak: list[tuple[int, int, int]] = []
        """(step, zero-variance pools, pools) of the current streak of mostly-zero-variance steps."""

    def observe(self, record: dict[str, Any]) -> str | None:
        """Take a step's record; return the warning on the step that completes `patience` such steps in a row."""
        zero, pools = int(record.get("adv/zero_variance_pools", 0)), int(record.get("adv/pools", 0))
        if not pools or zero <= pools / 2:
            self.streak = []
            return None
        self.streak.append((record["step"], zero, pools))
        if len(self.streak) != self.patience:
            return None
        shares = ", ".join(f"step {s}: {z}/{p}" for s, z, p in self.streak)
        return (f"most advantage pools had zero variance (every episode of the group got the same reward, so the "
                f"group teaches nothing) for {self.patience} steps in a row ({shares}; metric "
                "adv/zero_variance_pools): the tasks are too easy or too hard for the model, or the reward does "
                "not tell answers apart. Change the prompt, the task difficulty or the reward (partial credit), or "
                "raise group_size; `drmas-graph check` shows the reward spread per agent")


def nothing_to_train(step: int, n: int, errors: Sequence[BaseException], run_dir: Path) -> RolloutError:
    """The error that stops a run whose step lost every episode (raised with the first failure chained)."""
    first = (list(errors) or [None])[0]
    err = RolloutError(f"step {step}: all {n} episodes failed or got no usable reward (or rollout.mask_truncated "
                       f"dropped them), nothing to train on; "
                       f"the first: {first}. Fix the graph or the environment (failed episodes are in "
                       f"{run_dir / 'traces.db'}, with their error)", getattr(first, "episode", None))
    err.__cause__ = first
    return err
