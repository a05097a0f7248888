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
from drmas_graph.train.loop import _scoring
from drmas_graph.train.loop._metric_reference import is_documented
from drmas_graph.train.loop.trainer import Trainer, train_graph
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
    assert failed.error is None  # scoring returns its results: the episode the judge saw is not modified
    message = ("BadRewardError: env RankingEnv.reward_group() gave no reward for episode 1 "
               f"({failed.id}) of group 'train:0:train-1' (task 'train-1'): JudgeError: no usable "
               "score for episode 1 after 3 attempts (last reply: 'maybe')")
    assert failed.judgement == {"mode": "group", "index": 1, "chars": [solver_chars(ep) for ep in by_task["train-1"]]}

    # rewards and advantages: the group's scores, normalised per (group, agent) over the episodes kept
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        trained = {ep_id: store.load_episode(ep_id) for ep_id in store.trained_episodes(step=0)}
        stored_failed = store.load_episode(failed.id)
        failed_step = next(e.step for e in store.episodes() if e.id == failed.id)
        stored_eval = [store.load_episode(ep.id) for _, eps, _ in eval_calls for ep in eps]
    assert failed.id not in trained and len(trained) == 7
    # every judgement is stored: the failed episode's (never trained), the trained ones', the evaluation's
    assert stored_failed.judgement == failed.judgement and failed_step is None and not stored_failed.rewards
    assert stored_failed.error == message  # kept by the store: `traces show` shows it, `list --failed` finds it
    assert [ep.judgement for ep in stored_eval] == [ep.judgement for _, eps, _ in eval_calls for ep in eps]
    for task_id, episodes, _ in train_calls:
        scores = group_scores(episodes)
        kept = [(ep, s) for i, (ep, s) in enumerate(zip(episodes, scores)) if not (task_id == "train-1" and i == 1)]
        advantages = pool_advantages([s for _, s in kept])
        for (ep, score), adv in zip(kept, advantages):
            stored = trained[ep.id]
            assert stored.rewards == {"solver": score, "verifier": score}
            assert stored.turn_rewards == [score, score]  # every verifier reply is valid (< 8 tokens)
            assert stored.advantages == pytest.approx([adv, adv], abs=1e-6)  # float32 tensors
            assert stored.judgement == ep.judgement == {"mode": "group", "index": episodes.index(ep),
                                                        "chars": [solver_chars(e) for e in episodes]}

    # evaluation: reward_group too, its counters in the eval record
    evaluation = result.evals[-1]
    assert evaluation["judge/calls"] == 2 and evaluation["judge_failed_episodes"] == 0
    eval_scores = [s for _, eps, _ in eval_calls for s in group_scores(eps)]
    assert evaluation["solver/reward"] == pytest.approx(sum(eval_scores) / 4)

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["judge/calls"] for line in lines if "reward/team_mean" in line] == [2]
    assert [line["eval/judge/calls"] for line in lines if "eval/avg@k" in line] == [2]
    assert [k for line in lines for k in line if not is_documented(k)] == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Step 0's rollouts of a tiny model on RankingEnv's two training tasks, 4 episodes each (not scored)."""
    tmp_path = tmp_path_factory.mktemp("rollouts")
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=2, group_size=4)
    trainer = Trainer(graph(), RankingEnv(n_train=2), cfg, policies={"solver": policy, "verifier": policy}, train=False)
    try:
        out, counts = trainer.rollouts(trainer.batch_tasks(0), 0, 4, phase="train")
    finally:
        trainer.close()
    assert len(out) == 8 and counts["failed_episodes"] == 0
    return out


def score(env, runs, **rollout):
    """`score_runs` on copies of the runs: (scored, errors, counts, the copies)."""
    runs = copy.deepcopy(runs)
    counts = {}
    groups, unscored = _scoring.score_runs(env, runs, counts, invalid_penalty=0.1, rollout=RolloutConfig(**rollout),
                                         on_error=lambda exc: None)
    assert all(ep.error is None and not ep.rewards for _, ep in runs)  # results are returned, never written in
    return [(g.task, ep, score) for g in groups for ep, score in g.scored()], [u.error for u in unscored], counts, runs


def test_truncated_and_masked_episodes_are_never_sent_to_reward_group(runs):
    runs = copy.deepcopy(runs)
    (_, a), (_, b), (_, c) = runs[0], runs[2], runs[5]
    a.truncated, b.truncated = "max_llm_calls: 2 calls", "max_llm_calls: 2 calls"
    c.truncated = "timeout_s: 60 s"
    env = RankingEnv(n_train=2)
    scored, errors, counts, runs = score(env, runs, truncated_reward=0.25, mask_truncated=["timeout_s"])
    first, second = runs[0][0].id, runs[4][0].id
    sent = {task: [ep.id for ep in eps] for task, eps, _ in env.calls}
    assert sent == {first: [runs[1][1].id, runs[3][1].id], second: [runs[4][1].id, runs[6][1].id, runs[7][1].id]}
    assert counts["masked_truncated_episodes"] == 1 and errors == [] and len(scored) == 7
    rewards = {ep.id: score.rewards["solver"] for _, ep, score in scored}
    assert rewards[runs[0][1].id] == rewards[runs[2][1].id] == 0.25  # rollout.truncated_reward
    assert [rewards[runs[i][1].id] for i in (1, 3)] == group_scores([runs[1][1], runs[3][1]])
    assert counts["judge/calls"] == 2

    # truncated_reward null: the environment scores them too (the masked one still never)
    env = RankingEnv(n_train=2)
    score(env, runs, truncated_reward=None, mask_truncated=["timeout_s"])
    assert sorted(len(eps) for _, eps, _ in env.calls) == [3, 4]


def test_a_group_whose_truncated_episodes_all_have_a_configured_reward_is_not_sent(runs):
    runs = copy.deepcopy(runs)
    for _, ep in runs[:4]:
        ep.truncated = "max_llm_calls: 2 calls"
    env = RankingEnv(n_train=2)
    scored, _, _, runs = score(env, runs, truncated_reward=0.0)
    assert [task for task, _, _ in env.calls] == [runs[4][0].id] and len(scored) == 8


def test_a_wrong_length_list_or_a_raising_reward_group_fails_the_whole_group_naming_the_env(runs):
    second = runs[4][0].id
    scored, errors, counts, copies = score(RankingEnv(n_train=2, wrong_length={second}), runs)
    assert len(scored) == 4 and counts["bad_reward_episodes"] == 4 and counts["judge_failed_episodes"] == 0
    message = (f"env RankingEnv.reward_group() returned 3 rewards for the 4 episodes of group 'train:0:{second}' "
               f"(task '{second}'); it must return one per episode, in their order")
    assert [str(e) for e in errors] == [message] * 4 and all(isinstance(e, BadRewardError) for e in errors)
    assert [ep.error for _, ep in copies[4:]] == [None] * 4  # the error is returned (the store gets it in training)

    scored, errors, counts, _ = score(RankingEnv(n_train=2, raise_on={second}), runs)
    assert len(scored) == 4 and counts["bad_reward_episodes"] == 4
    assert str(errors[0]) == (f"env RankingEnv.reward_group() raised on group 'train:0:{second}' (task '{second}'): "
                              f"ValueError: the judge broke on {second}")
    assert isinstance(errors[0].__cause__, ValueError)

    # a JudgeError raised for the whole group: every episode of it counts as judge-failed
    _, errors, counts, _ = score(RankingEnv(n_train=2, raise_on={second}, raises="JudgeError"), runs)
    assert counts["judge_failed_episodes"] == 4 and counts["bad_reward_episodes"] == 0


def test_groups_are_scored_concurrently_and_keep_the_job_order(runs):
    import threading

    second_called = threading.Event()

    class FirstWaitsForSecond(RankingEnv):
        def reward_group(self, task, episodes):
            if task.id == runs[0][0].id:  # finishes only once the second group's call began: they overlap
                assert second_called.wait(timeout=30), "the groups were scored one after the other"
            else:
                second_called.set()
            return super().reward_group(task, episodes)

    env = FirstWaitsForSecond(n_train=2)
    scored, _, _, copies = score(env, runs)
    assert [ep.id for _, ep, _ in scored] == [ep.id for _, ep in copies]  # job order, not completion order
    assert [task for task, _, _ in env.calls] == [runs[4][0].id, runs[0][0].id]
    assert len({thread for _, _, thread in env.calls}) == 2
    assert [score.rewards["solver"] for _, _, score in scored] == group_scores(
        [ep for _, ep in copies[:4]]) + group_scores([ep for _, ep in copies[4:]])


def test_score_episode_takes_a_reward_given_in_advance(runs):
    task, episode = copy.deepcopy(runs[0])
    env = RankingEnv(n_train=2)  # its reward() raises: never called
    got = score_episode(env, task, episode, invalid_penalty=0.1, reward={"solver": 1.0, "verifier": 0.5})
    assert got.rewards == {"solver": 1.0, "verifier": 0.5} and got.team == 0.75 and got.turn_rewards == [1.0, 0.5]
    with pytest.raises(BadRewardError, match=r"reward of team for task 'train-\d' is nan"):
        score_episode(env, task, episode, invalid_penalty=0.1, reward=float("nan"))
    with pytest.raises(BadRewardError, match="env RankingEnv gave no reward for task .*: KeyError: 'score'") as info:
        score_episode(env, task, episode, invalid_penalty=0.1, reward=KeyError("score"))
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("metrics, error", [
    ({"episodes": 3}, "returned the key 'episodes': keys are 'namespace/name'"),
    ({"agent/solver/calls": 3}, "returned the key 'agent/solver/calls': keys are 'namespace/name'"),
    ({"judge/calls": "3"}, "returned 'judge/calls': '3', not a number"),
    ([("judge/calls", 3)], "returned list, not a dict"),
])
def test_reward_metrics_must_be_namespaced_numbers(metrics, error):
    class Env:
        def reward_metrics(self):
            return metrics

    with pytest.raises((TypeError, ValueError), match=f"env Env.reward_metrics\\(\\) {error}"):
        _scoring.reward_metrics(Env())
    assert _scoring.reward_metrics(object()) == {}


def test_check_scores_groups_with_reward_group_and_reports_the_judge(tmp_path, capsys):
    cfg = write_config(tmp_path, env="tests._envs:RankingEnv",
                       env_kwargs={"n_train": 2, "n_test": 2, "fail_tasks": ["train-0", "train-1"]}, group_size=4)
    status = main(["check", str(cfg), "--groups", "2"])
    out = capsys.readouterr().out
    assert status == 0  # the groups' scores differ: a learning signal
    assert "2 groups x 4 episodes on the base models: 6 scored, 4 of 4 advantage pools with a learning signal" in out
    assert "0 failed, 0 bad rewards, 2 not scored by the judge" in out
    assert "scoring (the environment's reward_metrics): judge/calls 2, judge/input_tokens " in out
    assert "2 of 8 episodes failed or got no usable reward" in out


def test_a_group_judge_trains_through_reward_group_with_its_counters_and_records(tmp_path):
    """The real `rewards.Judge` (group mode) behind a scripted judge model that scores attempt i of n as
    (i - 1) / (n - 1): episode j of every group gets reward j / (G - 1), its judgement holds the group's reply."""
    import re

    from drmas_graph.rewards import Judge, JudgedEnv
    from tests._envs import ParityEnv
    from tests.test_judge import scripted

    def ranked(messages):
        n = len(re.findall(r"^Attempt \d+:$", messages[-1].content, flags=re.M))
        return json.dumps({f"attempt_{i}": {"reason": f"attempt {i}", "score": (i - 1) / (n - 1)}
                           for i in range(1, n + 1)})

    model = scripted(default=ranked)
    env = JudgedEnv(ParityEnv(n_train=2, n_test=2), Judge(model, "Longer is better.", mode="group"))
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=2, group_size=4,
                       eval={"k": 2, "n_tasks": 2, "before_training": False})
    result = train_graph(graph(), env, cfg, policies={"solver": policy, "verifier": policy})

    record, evaluation = result.history[0], result.evals[-1]
    assert len(model.log.calls) == 4  # 2 training groups + 2 evaluation groups, one call each
    assert (record["judge/calls"], record["judge/retries"], record["judge/failed_calls"]) == (2, 0, 0)
    # the scripted model's usage: one token per word of the prompt (training's two calls come first)
    assert record["judge/input_tokens"] == sum(len(str(c).split()) for call in model.log.calls[:2]
                                               for _, c in call["messages"])
    assert record["judge_failed_episodes"] == 0 and record["episodes"] == 8
    assert evaluation["judge/calls"] == 2 and evaluation["solver/reward"] == pytest.approx(0.5)  # (0 + 1) / 2
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        trained = [store.load_episode(i) for i in store.trained_episodes(step=0)]
    by_group = {}
    for ep in trained:
        by_group.setdefault(ep.group_id, []).append(ep)
    assert sorted(by_group) == ["train:0:train-0", "train:0:train-1"]
    position = {episode_seed(cfg.seed, "train", 0, b, j): j for b in range(2) for j in range(4)}
    advantages = pool_advantages([0.0, 1 / 3, 2 / 3, 1.0])
    for episodes in by_group.values():  # episode j of the group was attempt j + 1 of the judge's call
        episodes.sort(key=lambda ep: position[ep.metadata["seed"]])
        assert [position[ep.metadata["seed"]] for ep in episodes] == [0, 1, 2, 3]
        assert [ep.rewards for ep in episodes] == [{"solver": j / 3, "verifier": j / 3} for j in range(4)]
        assert [ep.advantages for ep in episodes] == [pytest.approx([a, a], abs=1e-6) for a in advantages]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [k for line in lines for k in line if not is_documented(k)] == []


def test_asynchronous_training_scores_each_step_with_reward_group(tmp_path):
    env = RankingEnv(n_train=2, n_test=2)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=2, tasks_per_step=2, group_size=2, eval={"k": 1, "n_tasks": 1,
                       "before_training": False}, **{"async": {"max_staleness": 1}})
    result = train_graph(graph(), env, cfg, policies={"solver": policy, "verifier": policy})
    assert "async/wait_s" in result.history[0]  # pipelined
    train_groups = sorted(eps[0].group_id for task, eps, _ in env.calls if task.startswith("train-"))
    assert train_groups == ["train:0:train-0", "train:0:train-1", "train:1:train-0", "train:1:train-1"]
    assert [r["judge/calls"] for r in result.history] == [2, 2] and result.evals[-1]["judge/calls"] == 1
