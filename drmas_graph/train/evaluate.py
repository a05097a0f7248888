"""Evaluation: avg@k and pass@k of the current policies on a split, with evaluation sampling.

Every task is rolled out k times with `eval.temperature` / `eval.top_p` (never trained on, so truncated
sampling is fine on every backend); an episode succeeds when its team reward reaches `success_threshold`
(or `env.is_success` says so; truncated and model-error episodes get their configured rewards, as in
training); failed episodes count as failures. Under a launcher each process evaluates its share of the tasks
and the counts are merged; the rollouts a caller asks for (rank 0's Weave export) come from every process.
"""

from __future__ import annotations

from typing import Any

from drmas_graph.env import BadRewardError, is_success, score_episode
from drmas_graph.traces.weave_export import evaluation_episode
from drmas_graph.train import _distributed

__all__ = ["evaluate"]


def evaluate(trainer: Any, *, step: int, split: str | None = None,
             rollouts: list[Any] | None = None) -> dict[str, Any]:
    """avg@k and pass@k of the current policies on a split, with evaluation sampling. `rollouts`, when given,
    receives (task, episode, score or None, success) for every finished rollout of every process, in rank
    order; the episodes of other processes arrive as `evaluation_episode` keeps them (the Weave export's part)."""
    ec = trainer.cfg.eval
    split = split or ec.split
    tasks = list(trainer.env.tasks(split))[: ec.n_tasks]
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
    for task, episode in runs:
        try:
            score = score_episode(trainer.env, task, episode, invalid_penalty=trainer.invalid_penalty,
                                  **trainer.unfinished_rewards)
        except BadRewardError:
            successes[task.id].append(False)
            if local is not None:
                local.append((task, episode, None, False))
            continue
        successes[task.id].append(is_success(trainer.env, task, episode, score, trainer.cfg.success_threshold))
        if local is not None:
            local.append((task, episode, score, successes[task.id][-1]))
        for turn, r, bad in zip(episode.turns, score.turn_rewards, score.invalid):
            stats = per_agent.setdefault(turn.agent, {"reward": [], "invalid": [], "len": []})
            stats["reward"].append(r)
            stats["invalid"].append(float(bad))
            stats["len"].append(float(len(turn.response_ids)))
    successes, per_agent, counts, n_runs = _distributed.merge_eval(successes, per_agent, counts, len(runs))
    if local is not None:
        merged = _distributed.merge_rollouts(local, tasks, evaluation_episode)
        if rollouts is not None:
            rollouts.extend(merged)
    per_task = [sum(s) / ec.k for s in successes.values()]  # failed episodes count as failures
    record = {"step": step, "split": split, "k": ec.k, "tasks": len(tasks),
              "avg@k": sum(per_task) / len(per_task) if per_task else 0.0,
              "pass@k": sum(any(s) for s in successes.values()) / len(tasks) if tasks else 0.0,
              "failed_episodes": counts["failed_episodes"] + counts["no_llm_call_episodes"]}
    for agent, stats in sorted(per_agent.items()):
        n = len(stats["reward"])
        record[f"{agent}/reward"] = sum(stats["reward"]) / n
        record[f"{agent}/invalid_rate"] = sum(stats["invalid"]) / n
        record[f"{agent}/calls_per_episode"] = n / max(n_runs, 1)
        record[f"{agent}/response_len"] = sum(stats["len"]) / n
    return record
