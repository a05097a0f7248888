"""Evaluation: avg@k and pass@k of the current policies on a split, with evaluation sampling.

Every task is rolled out k times with `eval.temperature` / `eval.top_p` (never trained on, so truncated
sampling is fine on every backend); an episode succeeds when its team reward reaches `success_threshold`
(or `env.is_success` says so; truncated and model-error episodes get their configured rewards, as in
training; an environment with `reward_group` scores each task's k episodes in one call, as a training group);
failed episodes, and those without a usable reward (counted: `bad_reward_episodes`, `judge_failed_episodes`),
count as failures. The environment's `reward_metrics()` join the record. The record also holds, per agent, its most frequent replies
(`top_replies`: whitespace-normalized, cut to 80 characters, with their count and mean turn reward), and
every scored episode's rewards go to the trace store (`traces list` shows them). Under a launcher each process evaluates its share of the tasks
and the counts are merged; the rollouts a caller asks for (rank 0's Weave export) come from every process.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from typing import Any

from drmas_graph.env import ENV_REWARD, BadRewardError, is_success, score_episode
from drmas_graph.errors import ConfigError
from drmas_graph.traces.weave_export import evaluation_episode
from drmas_graph.train import _distributed, _scoring

__all__ = ["evaluate", "top_replies", "reply_lines"]

log = logging.getLogger(__name__)

TOP_REPLIES = 5
"""How many of an agent's most frequent replies an evaluation record keeps."""
REPLY_CHARS = 80
"""Replies are cut to this many characters (after whitespace normalization) before counting."""


def evaluate(trainer: Any, *, step: int, split: str | None = None,
             rollouts: list[Any] | None = None) -> dict[str, Any]:
    """avg@k and pass@k of the current policies on a split, with evaluation sampling. `rollouts`, when given,
    receives (task, episode, score or None, success) for every finished rollout of every process, in rank
    order; the episodes of other processes arrive as `evaluation_episode` keeps them (the Weave export's part)."""
    ec = trainer.cfg.eval
    split = split or ec.split
    tasks = list(trainer.env.tasks(split))[: ec.n_tasks]
    _refuse_duplicate_ids(tasks, split)  # successes are kept per task id
    saved = dict(trainer.app.sampling)
    trainer.app.sampling.update({
        a: saved.get(a, policy.sampling).replace(temperature=ec.temperature, top_p=ec.top_p, top_k=0,
                                                 train_logprobs=False)  # never trained on: truncation is fine
        for a, policy in trainer.agent_policies.items()})
    try:
        runs, counts = trainer.rollouts(tasks, step, ec.k, phase="eval")
    finally:
        trainer.app.sampling.clear()
        trainer.app.sampling.update(saved)
    # every rank takes part in sending rollouts when any rank wants them (under a launcher: rank 0's exporter)
    local: list[Any] | None = [] if any(_distributed.gather(rollouts is not None)) else None
    successes: dict[str, list[bool]] = {t.id: [] for t in tasks}
    per_agent: dict[str, dict[str, list[float]]] = {}
    replies: list[tuple[str, str, float]] = []  # (agent, reply, turn reward) of every scored turn
    teams: list[float] = []  # team reward of every scored episode
    given = _scoring.group_rewards(trainer.env, runs, **trainer.unfinished_rewards)
    counts.update(bad_reward_episodes=0, judge_failed_episodes=0)
    for task, episode in runs:
        try:
            score = score_episode(trainer.env, task, episode, invalid_penalty=trainer.invalid_penalty,
                                  **trainer.unfinished_rewards, reward=given.get(episode.id, ENV_REWARD))
        except BadRewardError as exc:
            counts[_scoring.failure_metric(exc)] += 1
            episode.error = f"BadRewardError: {exc}"
            if episode.judgement is not None:
                trainer.store.update_training(episode.id, step=None, judgement=episode.judgement)
            successes[task.id].append(False)
            if local is not None:
                local.append((task, episode, None, False))
            continue
        trainer.store.update_training(episode.id, step=None, rewards=score.rewards, turn_rewards=score.turn_rewards,
                                      judgement=episode.judgement)
        teams.append(score.team)
        successes[task.id].append(is_success(trainer.env, task, episode, score, trainer.cfg.success_threshold))
        if local is not None:
            local.append((task, episode, score, successes[task.id][-1]))
        for turn, r, bad in zip(episode.turns, score.turn_rewards, score.invalid):
            stats = per_agent.setdefault(turn.agent, {"reward": [], "invalid": [], "len": []})
            stats["reward"].append(r)
            stats["invalid"].append(float(bad))
            stats["len"].append(float(len(turn.response_ids)))
            replies.append((turn.agent, turn.response_text, r))
    counts.update(_scoring.reward_metrics(trainer.env))
    successes, per_agent, counts, n_runs = _distributed.merge_eval(successes, per_agent, counts, len(runs))
    if local is not None:
        merged = _distributed.merge_rollouts(local, tasks, evaluation_episode)
        if rollouts is not None:
            rollouts.extend(merged)
    per_task = [sum(s) / ec.k for s in successes.values()]  # failed episodes count as failures
    record = {"step": step, "split": split, "k": ec.k, "tasks": len(tasks),
              "avg@k": sum(per_task) / len(per_task) if per_task else 0.0,
              "pass@k": sum(any(s) for s in successes.values()) / len(tasks) if tasks else 0.0,
              "failed_episodes": counts["failed_episodes"] + counts["no_llm_call_episodes"],
              "bad_reward_episodes": counts["bad_reward_episodes"],
              "judge_failed_episodes": counts["judge_failed_episodes"]}
    for agent, stats in sorted(per_agent.items()):
        n = len(stats["reward"])
        record[f"{agent}/reward"] = sum(stats["reward"]) / n
        record[f"{agent}/invalid_rate"] = sum(stats["invalid"]) / n
        record[f"{agent}/calls_per_episode"] = n / max(n_runs, 1)
        record[f"{agent}/response_length"] = sum(stats["len"]) / n
    for key, value in counts.items():  # the environment's reward_metrics (summed over processes)
        if "/" in key and not key.startswith(_scoring.TRAINER_PREFIXES):
            if key in record:
                raise ValueError(f"env {type(trainer.env).__name__}.reward_metrics() returned the key {key!r}, "
                                 "which the evaluation record has for an agent; rename it")
            record[key] = value
    for agent, top in top_replies([r for part in _distributed.gather(replies) for r in part]).items():
        record[f"{agent}/top_replies"] = top
    _check_threshold(trainer, [t for part in _distributed.gather(teams) for t in part], record)
    return record


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


def _check_threshold(trainer: Any, teams: list[float], record: dict[str, Any]) -> None:
    """Warn once per trainer when `success_threshold` is above every team reward of an evaluation (without
    `env.is_success`, avg@k and pass@k then stay 0 whatever the policies learn)."""
    threshold = trainer.cfg.success_threshold
    if (not teams or max(teams) >= threshold or getattr(trainer.env, "is_success", None) is not None
            or getattr(trainer, "threshold_warned", False) or not _distributed.is_main()):
        return
    trainer.threshold_warned = True
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
            lines.append(f"most frequent replies of {key.split('/')[0]} (step {record['step']}, {record['split']}):")
            lines += [f"  {r['count']:>4}x  reward {r['reward']:.2f}  {r['reply']!r}" for r in top]
    return lines
