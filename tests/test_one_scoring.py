"""One scoring path (`_scoring.score_episodes`) for training, evaluation, `drmas-graph check` and rescore: the same
validation, the same invalid-turn penalty, the same failure rule (an episode without a usable reward is left out,
gets its error, and the store keeps it)."""

import logging

import pytest

from drmas_graph import SamplingParams
from drmas_graph.testing import tiny_policy
from drmas_graph.traces.store import TraceStore
from drmas_graph.train.loop.rescore import rescore
from drmas_graph.train.loop.trainer import Trainer, TrainResult, evaluate, train_graph
from tests._envs import ParityEnv, RankingEnv
from tests.test_trainer import graph, small_config


def test_rescoring_a_run_with_its_training_reward_reproduces_its_rewards_exactly(tmp_path):
    """ParityEnv: team reward by the solver's first token, verifier turns of 8+ tokens invalid (penalty 0.1).
    Rescore used to take the reward without the penalty; now both go through `score_episodes`."""
    env = ParityEnv(n_train=4)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=10))
    cfg = small_config(tmp_path, steps=2, tasks_per_step=2, group_size=4, eval={"k": 1, "before_training": False,
                                                                               "n_tasks": 1})
    train_graph(graph(), env, cfg, policies={"solver": policy, "verifier": policy})
    path = tmp_path / "run" / "traces.db"
    with TraceStore(path, readonly=True) as store:
        trained = {i: store.load_episode(i) for i in store.trained_episodes()}
    assert len(trained) == 16
    penalised = [(ep.id, i) for ep in trained.values() for i, t in enumerate(ep.turns)
                 if ep.turn_rewards[i] != ep.rewards[t.agent]]
    assert penalised, "no invalid turn: the test would not see the penalty"
    for ep_id, i in penalised:
        ep = trained[ep_id]
        assert ep.turn_rewards[i] == ep.rewards[ep.turns[i].agent] - 0.1

    result = rescore(path, env=ParityEnv(n_train=4), tasks=env.tasks("train"))
    assert result.failed == {} and list(result) == list(trained)
    for ep_id, new in result.items():
        assert new.rewards == trained[ep_id].rewards
        assert new.turn_rewards == trained[ep_id].turn_rewards  # penalties included, to the last digit
        assert new.advantages == pytest.approx(trained[ep_id].advantages, abs=1e-6)


def test_evaluation_leaves_unjudged_episodes_out_and_counts_and_logs_each(tmp_path, caplog):
    """test-1's judge call raises a JudgeError (both episodes unjudged: the task is left out), test-0's episode 0
    gets a JudgeError item: avg@2 and pass@2 are test-0's one judged episode; calls per episode count only the
    scored one; every failure is logged and stored with its error."""
    env = RankingEnv(n_train=2, n_test=2, fail_tasks={"test-0"}, fail_index=0, raise_on={"test-1"},
                     raises="JudgeError")
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    cfg = small_config(tmp_path, eval={"k": 2, "n_tasks": 2, "before_training": False})
    trainer = Trainer(graph(), env, cfg, policies={"solver": policy, "verifier": policy}, train=False)
    rows = []
    try:
        with caplog.at_level(logging.WARNING, logger="drmas_graph.train"):
            record = evaluate(trainer, step=0, rollouts=rows)
        stored = {s.id: s for s in trainer.state.store.episodes()}
        failed = [trainer.state.store.load_episode(s.id) for s in trainer.state.store.episodes(failed=True)]
    finally:
        trainer.close()
    judged = [(task, ep, success) for task, ep, score, success in rows if score is not None]
    assert [task.id for task, _, _ in judged] == ["test-0"]
    (_, episode, success), = judged
    assert record["unjudged_episodes"] == 3 and record["judge_failed_episodes"] == 3
    assert record["avg@k"] == record["pass@k"] == float(success)
    solver_calls = sum(t.agent == "solver" for t in episode.turns)
    assert record["solver/calls_per_episode"] == solver_calls  # one scored episode, not 4
    left_out = [r for r in caplog.records if "left out of avg@k and pass@k" in r.getMessage()]
    assert len(left_out) == 3
    assert len(failed) == 3 and all(ep.error.startswith("BadRewardError: env RankingEnv.reward_group()")
                                    for ep in failed)
    assert len(stored) == 4


def test_the_summary_shows_unjudged_episodes_only_when_there_are_some():
    evals = [{"step": 0, "split": "test", "k": 2, "avg@k": 0.5, "pass@k": 1.0, "unjudged_episodes": 0},
             {"step": 2, "split": "test", "k": 2, "avg@k": 0.75, "pass@k": 1.0, "unjudged_episodes": 3}]
    summary = TrainResult(run_dir="run", evals=evals).summary()
    assert f"{'  unjudged episodes':<28}{0:>12}{3:>12}" in summary.splitlines()
    assert "unjudged" not in TrainResult(run_dir="run", evals=evals[:1]).summary()


def test_the_summary_names_agents_whose_name_holds_a_slash():
    """rev6_c: an agent 'team/solve' (a node inside a subgraph) was read as 'team': a row 'reward team nan' and its
    replies labelled 'team'."""
    top = [{"reply": "4", "count": 2, "reward": 1.0}]
    record = {"step": 1, "split": "test", "k": 1, "avg@k": 1.0, "pass@k": 1.0, "team/solve/reward": 1.0,
              "team/solve/invalid_rate": 0.0, "tools/model/reward": 0.5, "team/solve/top_replies": top}
    lines = TrainResult(run_dir="run", evals=[record]).summary().splitlines()
    assert [ln for ln in lines if ln.startswith("  reward ")] == [f"{'  reward team/solve':<28}{1.0:>12.3f}",
                                                                   f"{'  reward tools/model':<28}{0.5:>12.3f}"]
    assert "most frequent replies of team/solve (step 1, test):" in lines
