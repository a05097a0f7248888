"""An environment's `reward_group` (a group reward, as a judge gives) and `reward_metrics` in training steps,
evaluation and `drmas-graph check`: one call per group with its episodes in order, the rewards and advantages
computed from the group's scores, judge failures counted and never trained on."""

import copy
import json
import math

import pytest

from drmas_graph import SamplingParams
from drmas_graph.cli import main
from drmas_graph.config import RolloutConfig
from drmas_graph.env import BadRewardError, score_episode
from drmas_graph.instrumentation._seeds import episode_seed
from drmas_graph.testing import tiny_policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train import _scoring
from drmas_graph.train._metric_reference import is_documented
from drmas_graph.train.trainer import Trainer, train_graph
from tests._envs import RankingEnv, solver_chars
from tests.test_cli_train import write_config
from tests.test_trainer import graph, small_config


def group_scores(episodes):
    """RankingEnv's scores, by hand: the share of the other episodes whose solver reply is shorter."""
    chars = [solver_chars(ep) for ep in episodes]
    return [sum(c < x for c in chars) / (len(chars) - 1) for x in chars]


def pool_advantages(rewards, eps=1e-6):
    """The `agent` estimator on one (group, agent) pool: (R - mean) / (unbiased std + eps); equal rewards: 0."""
    mu = sum(rewards) / len(rewards)
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mu) / (sigma + eps) for r in rewards]


def test_training_and_evaluation_score_each_group_with_one_reward_group_call(tmp_path):
    env = RankingEnv(n_train=2, n_test=2, fail_tasks={"train-1"}, fail_index=1)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=2, group_size=4,
                       eval={"k": 2, "n_tasks": 2, "before_training": False})
    result = train_graph(graph(), env, cfg, policies={"solver": policy, "verifier": policy})

    train_calls = [c for c in env.calls if c[0].startswith("train-")]
    eval_calls = [c for c in env.calls if c[0].startswith("test-")]
    # one call per group, with its G episodes in job order (the seeds of positions 0..3 of its batch slot)
    assert sorted(task for task, _, _ in train_calls) == ["train-0", "train-1"]
    for task_id, episodes, thread in train_calls:
        group = episodes[0].group_id
        assert {ep.group_id for ep in episodes} == {group} and group == f"train:0:{task_id}"
        b = int(episodes[0].metadata["seed"] != episode_seed(cfg.seed, "train", 0, 0, 0))
        assert [ep.metadata["seed"] for ep in episodes] == [episode_seed(cfg.seed, "train", 0, b, j) for j in range(4)]
        assert thread.startswith("reward-group")  # scored on the pool's threads
    assert sorted((task, len(eps)) for task, eps, _ in eval_calls) == [("test-0", 2), ("test-1", 2)]

    record = result.history[0]
    assert record["judge_failed_episodes"] == 1 and record["bad_reward_episodes"] == 0 and record["episodes"] == 7
    assert record["judge/calls"] == 2 and record["judge/input_tokens"] == sum(
        solver_chars(ep) for _, eps, _ in train_calls for ep in eps)

    # the failed episode: its error says why, the env's judgement stays, it is not trained on
    by_task = {task: eps for task, eps, _ in train_calls}
    failed = by_task["train-1"][1]
    assert failed.error == ("BadRewardError: env RankingEnv.reward_group() gave no reward for episode 1 "
                            f"({failed.id}) of group 'train:0:train-1' (task 'train-1'): JudgeError: no usable "
                            "score for episode 1 after 3 attempts (last reply: 'maybe')")
    assert failed.judgement == {"mode": "group", "index": 1, "chars": [solver_chars(ep) for ep in by_task["train-1"]]}

    # rewards and advantages: the group's scores, normalised per (group, agent) over the episodes kept
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        trained = {ep_id: store.load_episode(ep_id) for ep_id in store.trained_episodes(step=0)}
    assert failed.id not in trained and len(trained) == 7
    for task_id, episodes, _ in train_calls:
        scores = group_scores(episodes)
        kept = [(ep, s) for i, (ep, s) in enumerate(zip(episodes, scores)) if not (task_id == "train-1" and i == 1)]
        advantages = pool_advantages([s for _, s in kept])
        for (ep, score), adv in zip(kept, advantages):
            stored = trained[ep.id]
            assert stored.rewards == {"solver": score, "verifier": score}
            assert stored.turn_rewards == [score, score]  # every verifier reply is valid (< 8 tokens)
            assert stored.advantages == pytest.approx([adv, adv], abs=1e-6)  # float32 tensors

    # evaluation: reward_group too, its counters in the eval record
    evaluation = result.evals[-1]
    assert evaluation["judge/calls"] == 2 and evaluation["judge_failed_episodes"] == 0
    eval_scores = [s for _, eps, _ in eval_calls for s in group_scores(eps)]
    assert evaluation["solver/reward"] == pytest.approx(sum(eval_scores) / 4)

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["judge/calls"] for line in lines if "reward/team_mean" in line] == [2]
    assert [line["eval/judge/calls"] for line in lines if "eval/avg@k" in line] == [2]
    assert [k for line in lines for k in line if not is_documented(k)] == []
