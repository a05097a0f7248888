"""Evaluation: avg@k and pass@k of the current policies on a split, with evaluation sampling.

Every task is rolled out k times with `eval.temperature` / `eval.top_p` (never trained on, so truncated
sampling is fine on every backend); an episode succeeds when its team reward reaches `success_threshold`
(or `env.is_success` says so; truncated and model-error episodes get their configured rewards, as in
training; an environment with `reward_group` scores each task's k episodes in one call, as a training group);
failed episodes, and those without a usable reward (`bad_reward_episodes`), count as failures; an episode the
judge gave no score (`judge_failed_episodes`) is left out of avg@k and pass@k (as training leaves it out of the
update), counted in `unjudged_episodes` and logged, and a task none of whose episodes was judged is left out of
both (scoring is `_scoring.score_episodes`, training's); with no task left (the judge scored nothing, an empty
split) the record has no avg@k and no pass@k, never a 0 that was not measured. The environment's `reward_metrics()` join the record. The record also holds, per agent, its most frequent replies
(`top_replies`: whitespace-normalized, cut to 80 characters, with their count and mean turn reward), and
every scored episode's rewards go to the trace store (`traces list` shows them). Under a launcher each process evaluates its share of the tasks
and the counts are merged; the rollouts a caller asks for (rank 0's Weave export) come from every process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, defaultdict
from typing import Any

from drmas_graph.env import BadRewardError, EpisodeScore, is_success
from drmas_graph.errors import ConfigError
from drmas_graph.traces.weave_export import evaluation_episode
from drmas_graph.train.engines import distributed
from drmas_graph.train.loop import _scoring
from drmas_graph.train.loop._rollouts import roll_out
from drmas_graph.train.loop._state import HasRunState, RunState, run_state
from drmas_graph.types import Episode

__all__ = ["evaluate", "top_replies", "reply_lines"]

log = logging.getLogger(__name__)

TOP_REPLIES = 5
"""How many of an agent's most frequent replies an evaluation record keeps."""
REPLY_CHARS = 80
"""Replies are cut to this many characters (after whitespace normalization) before counting."""


def evaluate(run: RunState | HasRunState, *, step: int, split: str | None = None,
             rollouts: list[Any] | None = None, progress: Any = None) -> dict[str, Any]:
    """avg@k and pass@k of the current policies on a split, with evaluation sampling; `run` is a `RunState` or a
    `Trainer`. `rollouts`, when given, receives (task, episode, score or None, success) for every finished rollout
    of every process, in rank order; the episodes of other processes arrive as `evaluation_episode` keeps them
    (the Weave export's part). `progress(done, total)`: called as this process's episodes end."""
    started = time.perf_counter()
    state = run_state(run)
    ec = state.cfg.eval
    split = split or ec.split
    tasks = list(state.env.tasks(split))[: ec.n_tasks]
    _refuse_duplicate_ids(tasks, split)  # successes are kept per task id
    saved = dict(state.app.sampling)
    state.app.sampling.update({
        a: saved.get(a, policy.sampling).replace(temperature=ec.temperature, top_p=ec.top_p, top_k=0,
                                                 train_logprobs=False)  # never trained on: truncation is fine
        for a, policy in state.agent_policies.items()})
    try:
        batch = roll_out(state.app, state.env, tasks, step, ec.k, phase="eval", seed=state.cfg.seed,
                         rollout=state.cfg.rollout, base_config=state.rollout_config, slots=state.episode_slots,
                         progress=progress)
        runs, counts = batch.runs, batch.counts
    finally:
        state.app.sampling.clear()
        state.app.sampling.update(saved)
    # every rank takes part in sending rollouts when any rank wants them (under a launcher: rank 0's exporter)
    local: list[Any] | None = [] if any(distributed.gather(rollouts is not None)) else None
    successes, per_agent, replies, teams = _score(state, tasks, runs, counts, local, step)
    successes, per_agent, counts, n_scored = distributed.merge_eval(successes, per_agent, counts, len(teams))
    if local is not None:
        merged = distributed.merge_rollouts(local, tasks, evaluation_episode)
        if rollouts is not None:
            rollouts.extend(merged)
    # per task: the share of its judged episodes that succeeded (failed episodes count as failures, unjudged
    # ones are left out); a task none of whose episodes was judged is left out of avg@k and pass@k, and with no
    # task left (the judge scored nothing, an empty split) the record has neither: nothing was measured
    judged = {t: ec.k - s.count(None) for t, s in successes.items()}
    per_task = [sum(x is True for x in s) / judged[t] for t, s in successes.items() if judged[t] > 0]
    measured = {"avg@k": sum(per_task) / len(per_task),
                "pass@k": sum(any(x is True for x in s) for s in successes.values()) / len(per_task)} if per_task else {}
    if not per_task:
        log.warning("evaluation at step %d on split %r: no task has a judged episode (%d tasks, %d unjudged "
                    "episodes): no avg@k or pass@k logged", step, split, len(tasks),
                    sum(s.count(None) for s in successes.values()))
    record = {"step": step, "split": split, "k": ec.k, "tasks": len(tasks), **measured,
              "failed_episodes": counts["failed_episodes"] + counts["no_llm_call_episodes"],
              "bad_reward_episodes": counts["bad_reward_episodes"],
              "judge_failed_episodes": counts["judge_failed_episodes"],
              "unjudged_episodes": sum(s.count(None) for s in successes.values())}
    for agent, stats in sorted(per_agent.items()):
        n = len(stats["reward"])
        record[f"{agent}/reward"] = sum(stats["reward"]) / n
        record[f"{agent}/invalid_rate"] = sum(stats["invalid"]) / n
        record[f"{agent}/calls_per_episode"] = n / max(n_scored, 1)  # over the scored episodes
        record[f"{agent}/response_length"] = sum(stats["len"]) / n
    for key, value in counts.items():  # the environment's reward_metrics (summed over processes)
        if "/" in key and not key.startswith(_scoring.TRAINER_PREFIXES):
            if key in record:
                raise ValueError(f"env {type(state.env).__name__}.reward_metrics() returned the key {key!r}, "
                                 "which the evaluation record has for an agent; rename it")
            record[key] = value
    for agent, top in top_replies([r for part in distributed.gather(replies) for r in part]).items():
        record[f"{agent}/top_replies"] = top
    _check_threshold(state, [t for part in distributed.gather(teams) for t in part], record)
    record["time_s"] = time.perf_counter() - started
    return record


def _score(state: RunState, tasks: list[Any], runs: list[tuple[Any, Episode]], counts: dict[str, int],
           local: list[Any] | None, step: int
           ) -> tuple[dict[str, list[bool | None]], dict[str, dict[str, list[float]]], list[tuple[str, str, float]],
                      list[float]]:
    """Score the evaluation's runs (`_scoring.score_episodes`, as training does) and store their rewards: per task
    its episodes' successes (None: the judge gave no score, left out), per agent its turns' rewards, invalid flags
    and lengths, every scored turn's (agent, reply, reward), every scored episode's team reward. Every failure
    is logged and counted (`bad_reward_episodes`, `judge_failed_episodes`) and stored with its error."""
    successes: dict[str, list[bool | None]] = {t.id: [] for t in tasks}
    per_agent: dict[str, dict[str, list[float]]] = {}
    replies: list[tuple[str, str, float]] = []
    teams: list[float] = []
    scored: list[tuple[Episode, EpisodeScore]] = []
    unscored: list[_scoring.Unscored] = []
    counts.update(bad_reward_episodes=0, judge_failed_episodes=0)
    results = _scoring.score_episodes(state.env, runs, invalid_penalty=state.invalid_penalty,
                                      truncated_reward=state.cfg.rollout.truncated_reward,
                                      model_error_reward=state.cfg.rollout.model_error_reward)
    for (task, episode), score in zip(runs, results):
        if isinstance(score, BadRewardError):
            metric = _scoring.failure_metric(score)
            counts[metric] += 1
            unjudged = metric == "judge_failed_episodes"
            log.warning("evaluation at step %d: episode %s of task %r %s: %s", step, episode.id, task.id,
                        "left out of avg@k and pass@k (the judge gave no score)" if unjudged
                        else "counts as a failure (no usable reward)", score)
            unscored.append(_scoring.Unscored(episode, score))
            successes[task.id].append(None if unjudged else False)
            if local is not None:
                local.append((task, dataclasses.replace(episode, error=unscored[-1].message), None, False))
            continue
        scored.append((episode, score))
        teams.append(score.team)
        successes[task.id].append(is_success(state.env, task, episode, score, state.cfg.success_threshold))
        if local is not None:
            local.append((task, episode, score, successes[task.id][-1]))
        for turn, r, bad in zip(episode.turns, score.turn_rewards, score.invalid):
            stats = per_agent.setdefault(turn.agent, {"reward": [], "invalid": [], "len": []})
            stats["reward"].append(r)
            stats["invalid"].append(float(bad))
            stats["len"].append(float(len(turn.response_ids)))
            replies.append((turn.agent, turn.response_text, r))
    _scoring.store_scores(state.store, step=None, scored=scored, unscored=unscored)
    counts.update(_scoring.reward_metrics(state.env))
    return successes, per_agent, replies, teams


def _refuse_duplicate_ids(tasks: list[Any], split: str) -> None:
    """avg@k and pass@k count per task id: two tasks of the split with one id would merge into one (2k
    outcomes over k), so they are refused, naming the id."""
    seen: set[str] = set()
    for position, task in enumerate(tasks):
        if task.id in seen:
            raise ConfigError(
                f"env.tasks({split!r}) holds task id {task.id!r} more than once (again at position {position}); "
                "evaluation counts avg@k and pass@k per task id, so ids must be unique: give each task its own "
                "id (e.g. add its index) or drop the duplicate")
        seen.add(task.id)


def _check_threshold(state: RunState, teams: list[float], record: dict[str, Any]) -> None:
    """Warn once per trainer when `success_threshold` is above every team reward of an evaluation (without
    `env.is_success`, avg@k and pass@k then stay 0 whatever the policies learn)."""
    threshold = state.cfg.success_threshold
    if (not teams or max(teams) >= threshold or getattr(state.env, "is_success", None) is not None
            or state.notes.threshold_warned or not distributed.is_main()):
        return
    state.notes.threshold_warned = True
    log.warning("success_threshold %g is above every team reward of the evaluation at step %d (%d episodes, "
                "highest %g, lowest %g; a per-agent reward dict counts as the mean of the agents' rewards): "
                "avg@k and pass@k stay 0. Set success_threshold to the team reward of a success, or give the "
                "environment an is_success(task, episode) method", threshold, record["step"], len(teams),
                max(teams), min(teams))


def top_replies(replies: list[tuple[str, str, float]], n: int = TOP_REPLIES) -> dict[str, list[dict[str, Any]]]:
    """Per agent, its `n` most frequent replies among (agent, reply, reward) triples, as {"reply", "count",
    "reward" (mean)}; replies are compared whitespace-normalized and cut to `REPLY_CHARS` characters."""
    rewards: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for agent, text, reward in replies:
        reply = " ".join(text.split())
        rewards[agent][reply[:REPLY_CHARS] + ("..." if len(reply) > REPLY_CHARS else "")].append(reward)
    out = {}
    for agent, by_reply in sorted(rewards.items()):
        counts = Counter({reply: len(r) for reply, r in by_reply.items()})
        out[agent] = [{"reply": reply, "count": count, "reward": sum(by_reply[reply]) / count}
                      for reply, count in counts.most_common(n)]
    return out


def reply_lines(record: dict[str, Any]) -> list[str]:
    """An evaluation record's most frequent replies as text, per agent: '  12x  reward 0.50  "The answer is 4."'."""
    lines = []
    for key, top in record.items():
        if key.endswith("/top_replies"):
            agent = key[:-len("/top_replies")]  # an agent's name may hold '/' (a node inside a subgraph)
            lines.append(f"most frequent replies of {agent} (step {record['step']}, {record['split']}):")
            lines += [f"  {r['count']:>4}x  reward {r['reward']:.2f}  {r['reply']!r}" for r in top]
    return lines
