"""train_graph: a tiny two-agent graph trained for a few steps on CPU, with real assertions."""

import json
import math

import pytest
import torch

from drmas_graph import SamplingParams, Task
from drmas_graph.config import TrainConfig, load_config
from drmas_graph.errors import ConfigError
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import tiny_policy
from drmas_graph.train.loop.trainer import Trainer, train_graph
from tests import _graphs
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable


def small_config(tmp_path, **kw):
    base = dict(run_dir=str(tmp_path / "run"), steps=2, tasks_per_step=2, group_size=4, strict=True,
                update={"lr": 1e-3, "backend": "torch"},
                eval={"k": 2, "n_tasks": 2, "before_training": True},
                logging={"progress": False, "tensorboard": False})
    base.update(kw)
    return TrainConfig.model_validate(base)


def graph():
    return _graphs.solver_verifier(Unreachable()).compile()


def params(policy):
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def test_trains_each_trainable_model_and_leaves_frozen_ones(tmp_path):
    solver = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    verifier = tiny_policy(seed=1, arch="qwen2", vocab_size=384, sampling=SamplingParams(max_new_tokens=6))
    before_s, before_v = params(solver), params(verifier)
    cfg = small_config(tmp_path, agents={"solver": {"model": solver.name},
                                         "verifier": {"model": verifier.name, "frozen": True}})
    result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": solver, "verifier": verifier})
    moved = [k for k, v in params(solver).items() if not torch.equal(v, before_s[k])]
    assert len(moved) > 0.5 * len(before_s)  # the solver's model was updated
    assert all(torch.equal(v, before_v[k]) for k, v in params(verifier).items())  # the frozen one was not
    assert solver.version == 2 and verifier.version == 0
    assert [r["step"] for r in result.history] == [0, 1]
    last = result.history[-1]
    assert last["episodes"] == 8 and last["agent/solver/calls"] == 8 and last["agent/verifier/calls"] == 8
    assert last["agent/solver/logprob_mismatch"] < 1e-4  # embedded rollout logprobs == trainer's recompute
    assert "agent/verifier/logprob_mismatch" not in last  # frozen: never trained
    assert math.isfinite(last[f"model/{solver.name}/grad_norm"]) and last[f"model/{solver.name}/grad_norm"] > 0


def test_shared_model_two_agents_metrics_traces_and_checkpoint(tmp_path):
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    result = train_graph(graph(), ParityEnv(), small_config(tmp_path), policies={"solver": policy, "verifier": policy})
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "agent/solver/reward_mean" in x]
    assert [x["step"] for x in train_lines] == [0, 1]
    for x in train_lines:
        for key in ("agent/solver/advantage_mean", "agent/verifier/advantage_std", "agent/solver/pg_loss", "time/rollout_s",
                    "time/update_s", "rollout/tokens_per_s", "adv/zero_variance_pools", "agent/verifier/logprob_mismatch",
                    "agent/solver/clip_frac", "agent/verifier/invalid_rate"):
            assert key in x, key
        # agent-wise normalization: each agent's advantages have mean ~0 within every non-degenerate pool
        assert abs(x["agent/solver/advantage_mean"]) < 1e-5
    evals = [x for x in lines if "eval/avg@k" in x]
    assert [x["step"] for x in evals] == [0, 2] and [e["step"] for e in result.evals] == [0, 2]
    with TraceStore(run / "traces.db", readonly=True) as store:
        trained = store.episodes(step=1)
        assert len(trained) == 8  # every training episode is stored with the step it was used in
        episode = store.load_episode(trained[0].id)
        assert episode.advantages is not None and len(episode.advantages) == len(episode.turns) == 2
        assert episode.rewards["solver"] in (0.0, 1.0)
    ckpt = result.checkpoint
    assert ckpt == run / "checkpoints" / "step_000002" and (ckpt / policy.name / "model" / "config.json").exists()
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(ckpt / policy.name / "model")
    assert all(torch.equal(v, policy.model.state_dict()[k]) for k, v in reloaded.state_dict().items())
    assert "reward solver" in result.summary() and "avg@2" in result.summary()


def _boom_graph():
    """solver (raises on the question 'boom') -> verifier (never calls an LLM)."""
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, StateGraph

    llm = Unreachable()

    def solver(state):
        if state["question"] == "boom":
            raise ValueError("this task makes the graph raise")
        return {"answer": llm.invoke([HumanMessage(state["question"])]).content}

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_node("verifier", lambda s: {"verdict": "never calls an LLM"})
    g.add_edge(START, "solver")
    g.add_edge("solver", "verifier")
    g.add_edge("verifier", END)
    return g.compile()


class RaisingRewardEnv(ParityEnv):
    """train-0 makes the graph raise, train-1 gets a NaN reward, train-2's reward raises, train-3's
    turn_is_valid raises; the rest are fine."""

    def __init__(self, **kw):
        super().__init__(bad_reward={"train-1"}, **kw)
        self.train[0] = type(self.train[0])(id="train-0", input={"question": "boom"})

    def reward(self, task, episode):
        if task.id == "train-2":
            raise ZeroDivisionError("the reward function has a bug")
        return super().reward(task, episode)

    def turn_is_valid(self, task, turn):
        if task.id == "train-3":
            raise KeyError("turn_is_valid has a bug too")
        return super().turn_is_valid(task, turn)


def test_bad_rewards_failing_tasks_and_idle_agents_are_counted_not_fatal(tmp_path, caplog):
    env = RaisingRewardEnv(n_train=5)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=5, eval={"k": 1, "n_tasks": 1, "before_training": False})
    with caplog.at_level("WARNING", logger="drmas_graph.train.loop.trainer"):
        result = train_graph(_boom_graph(), env, cfg, policies={"solver": policy, "verifier": policy})
    rec = result.history[0]
    # 5 tasks x G=4: train-0 fails in the graph; train-1 (NaN), train-2 and train-3 (raising env) are bad rewards
    assert rec["failed_episodes"] == 4 and rec["bad_reward_episodes"] == 12 and rec["episodes"] == 4
    assert rec["agent/verifier/calls"] == 0 and rec["agent/verifier/never_acted"] == 1
    raised = [r for r in caplog.records if "raised on task" in r.getMessage()]
    assert len(raised) == 1 and raised[0].exc_info is not None  # logged once, with the traceback
    assert isinstance(raised[0].exc_info[1], (ZeroDivisionError, KeyError))
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        failed = store.episodes(failed=True)
        assert len(failed) >= 4 and "this task makes the graph raise" in store.load_episode(failed[0].id).error


def test_a_step_whose_every_episode_fails_stops_the_run_with_the_first_error(tmp_path):
    from drmas_graph.errors import RolloutError

    env = ParityEnv(n_train=1)
    env.train[0] = type(env.train[0])(id="train-0", input={"question": "boom"})
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=3, tasks_per_step=1, eval={"k": 1, "n_tasks": 1, "before_training": False})
    with pytest.raises(RolloutError, match=r"step 0: all 4 episodes failed .*this task makes the graph raise") as info:
        train_graph(_boom_graph(), env, cfg, policies={"solver": policy, "verifier": policy})
    first = info.value.__cause__
    assert isinstance(first, RolloutError) and first.episode.task_id == "train-0"
    assert isinstance(first.__cause__, ValueError)  # the graph's own exception, chained
    assert policy.version == 0  # no update ran on an empty batch
    assert not (tmp_path / "run" / "checkpoints").exists()
    # what the failed step measured is in metrics.jsonl and the summary (it wrote nothing before issue 48)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["episodes"], r["failed_episodes"]) for r in lines] == [(0, 0, 4)]
    assert lines[0]["time/rollout_s"] > 0
    summary = info.value.result.summary().splitlines()
    assert summary[:2] == ["training reward (team)" + " " * 6 + "      step 0", " " * 28 + "           -"]
    assert summary[2:6] == [f"  {label:<26}{n:>12}" for label, n in (
        ("episodes with a reward", 0), ("unjudged episodes", 0), ("failed episodes", 4), ("bad-reward episodes", 0))]


def test_the_progress_line_and_summary_show_unjudged_and_failed_episodes(tmp_path):
    from drmas_graph.train.loop.metrics import progress_status
    from drmas_graph.train.loop.trainer import TrainResult

    record = {"step": 1, "episodes": 4, "judge_failed_episodes": 3, "failed_episodes": 1, "reward/team_mean": 0.5,
              "agent/solver/reward_mean": 0.5}
    assert progress_status(["solver"], record) == "reward solver=0.50  unjudged 3/8  failed 1/8"
    summary = TrainResult(tmp_path, history=[{**record, "step": 0, "judge_failed_episodes": 0}, record]).summary()
    assert summary.splitlines()[2:6] == [f"  {label:<26}{a:>12}{b:>12}" for label, a, b in (
        ("episodes with a reward", 4, 4), ("unjudged episodes", 0, 3), ("failed episodes", 1, 1),
        ("bad-reward episodes", 0, 0))]


def test_kill_and_resume_gives_the_same_batches_and_weights(tmp_path):
    def run(run_dir, steps, resume=False, seed_policy=0):
        policy = tiny_policy(seed=seed_policy, sampling=SamplingParams(max_new_tokens=4))
        cfg = small_config(tmp_path, run_dir=str(run_dir), steps=steps, resume=resume, checkpoint_every=1,
                           max_concurrency=8, eval={"k": 1, "n_tasks": 1, "before_training": False})
        result = train_graph(graph(), ParityEnv(n_train=5), cfg, policies={"solver": policy, "verifier": policy})
        return result, policy

    straight, p_straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)  # "killed" after step 2's checkpoint
    resumed, p_resumed = run(tmp_path / "b", 4, resume=True)
    assert [r["step"] for r in resumed.history] == [2, 3]
    with TraceStore(tmp_path / "a" / "traces.db", readonly=True) as a, \
            TraceStore(tmp_path / "b" / "traces.db", readonly=True) as b:
        for step in (2, 3):
            assert sorted(e.task_id for e in a.episodes(step=step)) == sorted(e.task_id for e in b.episodes(step=step))
            assert _sampled(a, step) == _sampled(b, step)  # the same tokens, with 8 episodes in flight
    for k, v in p_straight.model.state_dict().items():
        assert torch.equal(p_resumed.model.state_dict()[k], v), k  # bit for bit
    lines = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    # steps 0,1 + the first run's evaluation after 2 steps (the checkpoint resumed from: kept) + steps 2,3 + eval at 4
    assert sorted(s for s in lines) == [0, 1, 2, 2, 3, 4]


def _sampled(store, step):
    """(task, group, seed, response ids) of every trained call of a step, in a canonical order."""
    out = []
    for ref in store.episodes(step=step):
        ep = store.load_episode(ref.id)
        out += [(ep.task_id, ep.metadata["seed"], t.call_key, t.node_call_index, t.sampling.seed, t.response_ids)
                for t in ep.turns]
    return sorted(out)


def test_weights_are_identical_at_any_max_concurrency(tmp_path):
    """Seeds come from each call's identity (run seed, step, group, episode, call_key, node_call_index), not
    from arrival order, and the update recomputes old logprobs: 1 or 8 episodes in flight give the same run."""
    def run(conc):
        policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
        cfg = small_config(tmp_path, run_dir=str(tmp_path / f"c{conc}"), steps=2, tasks_per_step=4,
                           max_concurrency=conc, eval={"k": 2, "n_tasks": 2, "before_training": False})
        result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})
        return result, params(policy)

    (r1, w1), (r8, w8) = run(1), run(8)
    assert all(torch.equal(w1[k], w8[k]) for k in w1)
    assert [h["reward/team_mean"] for h in r1.history] == [h["reward/team_mean"] for h in r8.history]
    assert r1.evals[-1]["avg@k"] == r8.evals[-1]["avg@k"]
    for h in r8.history:  # the recomputed old logprobs differ from the rollout's by batching noise only
        assert 0 <= h["agent/solver/rollout_logprob_gap"] < 1e-5 and h["agent/solver/logprob_mismatch"] < 1e-6
    with TraceStore(tmp_path / "c1" / "traces.db", readonly=True) as a, \
            TraceStore(tmp_path / "c8" / "traces.db", readonly=True) as b:
        for step in (0, 1):
            calls = _sampled(a, step)
            assert calls == _sampled(b, step) and len(calls) == 32
            # every call has its own seed: the G episodes of a group sample differently
            assert len({c[4] for c in calls}) == 32 and len({c[1] for c in calls}) == 16


def test_call_seeds_are_stable_across_processes():
    from drmas_graph.instrumentation._seeds import call_seed, episode_seed, stable_seed

    # pinned values: blake2b of the parts, not Python's per-process salted hash()
    assert stable_seed("episode", 0, "train", 0, 0, 0) == episode_seed(0, "train", 0, 0, 0)
    assert episode_seed(0, "train", 3, 1, 2) == 336580226
    assert call_seed(12345, "solver", 0) == 241304889
    assert call_seed(12345, "solver", 0) != call_seed(12345, "solver", 1) != call_seed(12345, "verifier", 1)
    assert 0 <= call_seed(1, "x", 0) < 2**31


def test_task_order_is_seeded_and_covers_the_split(tmp_path):
    policy = tiny_policy(seed=0)
    trainer = Trainer(graph(), ParityEnv(n_train=5), small_config(tmp_path), policies={"solver": policy,
                                                                                        "verifier": policy})
    ids = [t.id for s in range(5) for t in trainer.batch_tasks(s)]  # 10 positions = 2 epochs of 5
    assert sorted(ids[:5]) == sorted(ids[5:]) == [f"train-{i}" for i in range(5)]
    assert ids[:5] != ids[5:]  # each epoch reshuffled
    trainer.close()


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"estimator.*unknown estimator 'per-agent'; valid: \['agent'"):
        policy = tiny_policy()
        train_graph(graph(), ParityEnv(), estimator="per-agent", policies={"solver": policy, "verifier": policy})
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\ngroup_sise: 4\n")
    with pytest.raises(ConfigError, match="group_sise"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    small_config(tmp_path).to_yaml(good)
    cfg = load_config(good, ["steps=7", "eval.k=3", "update.lr=0.5"])
    assert (cfg.steps, cfg.eval.k, cfg.update.lr) == (7, 3, 0.5)


def test_evaluate_avg_and_pass_at_k_per_agent_stats(tmp_path):
    from drmas_graph.train.loop.trainer import evaluate

    class HalfEnv(ParityEnv):
        def reward(self, task, episode):
            return 1.0 if task.id in ("test-0", "test-1") else 0.0

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, eval={"k": 3, "n_tasks": 4})
    trainer = Trainer(graph(), HalfEnv(), cfg, policies={"solver": policy, "verifier": policy}, train=False)
    record = evaluate(trainer, step=0)
    trainer.close()
    assert (record["tasks"], record["k"], record["avg@k"], record["pass@k"]) == (4, 3, 0.5, 0.5)
    assert record["solver/calls_per_episode"] == record["verifier/calls_per_episode"] == 1.0
    assert record["solver/reward"] == 0.5 and record["solver/invalid_rate"] == 0.0
    assert record["verifier/response_length"] == 4.0  # max_new_tokens, the tiny model never stops
    # evaluation sampling does not leak into training sampling
    assert "solver" not in trainer.state.app.sampling and policy.sampling.temperature == 1.0


def test_distinct_policies_with_one_name_are_refused_naming_both_agents(tmp_path):
    solver, verifier = tiny_policy(seed=0), tiny_policy(seed=0)  # one base checkpoint -> one default name (rev_n)
    with pytest.raises(ConfigError, match=r"policies\['solver'\] and policies\['verifier'\] are different Policy "
                                          r"objects with the same name 'tiny-llama-v512-s0'.*name="):
        train_graph(graph(), ParityEnv(), small_config(tmp_path), policies={"solver": solver, "verifier": verifier})
    solver.name, verifier.name = "solver-model", "verifier-model"  # the fix the error names
    for p in (solver, verifier):
        p.sampling = SamplingParams(max_new_tokens=4)
    cfg = small_config(tmp_path, steps=1, eval={"k": 1, "n_tasks": 1, "before_training": False})
    result = train_graph(graph(), ParityEnv(), cfg, policies={"solver": solver, "verifier": verifier})
    assert solver.version == verifier.version == 1  # two models, two updaters
    assert sorted(p.name for p in result.checkpoint.iterdir() if p.is_dir()) == ["solver-model", "verifier-model"]


def test_every_forward_pass_of_an_embedded_model_runs_on_its_decoding_thread(tmp_path):
    # rollouts, the old-logprob pass, the update and evaluation: one OS thread does the model's compute
    # (on CPU a second thread running torch ops slows decoding down for the rest of the process)
    import threading

    solver = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    seen = []
    solver.model.register_forward_hook(lambda m, a, o: seen.append((threading.current_thread().name,
                                                                    torch.is_grad_enabled())))
    cfg = small_config(tmp_path, steps=1, agents={"solver": {"model": solver.name},
                                                  "verifier": {"model": solver.name}})
    train_graph(graph(), ParityEnv(), cfg, policies={"solver": solver, "verifier": solver})
    assert {name for name, _ in seen} == {f"{solver.name}-batcher"}
    assert any(grad for _, grad in seen) and any(not grad for _, grad in seen)  # the update and decoding


def test_a_task_twice_in_one_step_is_two_groups_with_their_own_ids_whatever_the_sharding(tmp_path):
    """rev3_a: a step that straddles the end of a 3-task split holds train-1 twice. Each copy is its own GRPO
    group (4 group ids, 4 x 2 agent pools); seeds stay those of the batch positions (so groups that do not
    repeat sample as before), and two processes (groups 0-1 and 2-3) compute the advantages of one."""
    from drmas_graph.instrumentation._seeds import episode_seed
    from drmas_graph.train.loop._scoring import first_failures_logger, score_runs, trained_samples, with_advantages

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=4, group_size=4, eval={"k": 1, "before_training": False})
    trainer = Trainer(graph(), ParityEnv(n_train=3), cfg, policies={"solver": policy, "verifier": policy})
    try:
        tasks = trainer.batch_tasks(0)
        assert [t.id for t in tasks] == ["train-1", "train-0", "train-2", "train-1"]
        runs, counts = trainer.rollouts(tasks, 0, cfg.group_size, phase="train")
        run = trainer.state
        groups, _ = score_runs(run.env, runs, counts, invalid_penalty=run.invalid_penalty, rollout=cfg.rollout,
                               on_error=first_failures_logger(set()))
        trained = trainer.state.trained_agents()
        groups, stats = with_advantages(groups, cfg)
        samples = trained_samples(groups, trained)
        halves = (trained_samples(with_advantages(groups[:2], cfg)[0], trained)
                  + trained_samples(with_advantages(groups[2:], cfg)[0], trained))
    finally:
        trainer.close()
    episodes = [ep for group in groups for ep in group.episodes]
    assert [ep.group_id for ep in episodes[::4]] == ["train:0:train-1", "train:0:train-0", "train:0:train-2",
                                                     "train:0#2:train-1"]
    assert stats.n_pools == 8
    assert [ep.metadata["seed"] for ep in episodes] == [episode_seed(cfg.seed, "train", 0, b, j)
                                                        for b in range(4) for j in range(4)]
    assert [s.advantage for s in halves] == [s.advantage for s in samples]


def test_group_ids_cannot_collide_whatever_the_task_ids():
    """rev6_d: a step holding 'q' twice and a task 'q#2' (or '2:q', '#2:q') once: every position's group is its own
    (the second 'q' was 'train:0:q#2' before, the plain group id of task 'q#2')."""
    from drmas_graph.train.loop._rollouts import group_ids

    tasks = [Task(id=i, input=None) for i in ("q", "q#2", "q", "2:q", "#2:q", "q", "0#2:q")]
    ids = group_ids(tasks, "train", 0)
    assert ids == ["train:0:q", "train:0:q#2", "train:0#2:q", "train:0:2:q", "train:0:#2:q", "train:0#3:q",
                   "train:0:0#2:q"]
    assert len(set(ids)) == len(ids)
    assert [g.split(":", 2)[2] for g in ids] == [t.id for t in tasks]  # the task id is all after the second ':'


def test_the_progress_line_and_the_warning_say_which_episodes_did_not_finish():
    from drmas_graph.train.loop._scoring import unfinished_warning
    from drmas_graph.train.loop.metrics import progress_status

    record = {"step": 3, "agent/solver/reward_mean": 0.5, "episodes": 6, "failed_episodes": 1,
              "no_llm_call_episodes": 0, "bad_reward_episodes": 0, "masked_truncated_episodes": 1,
              "truncated_episodes": 3, "truncated/max_llm_calls": 2, "truncated/timeout_s": 1,
              "truncated/recursion_limit": 0, "model_error_episodes": 2, "agent/solver/model_error_episodes": 2,
              "agent/judge/model_error_episodes": 0}
    assert progress_status(["solver"], record) == "reward solver=0.50  truncated 3/8  model errors 2/8  failed 1/8"
    warning = unfinished_warning(record, 8)
    assert warning.startswith("step 3: 5 of 8 episodes did not finish: 3 truncated (max_llm_calls 2, timeout_s 1;")
    assert "2 model errors (by agent: solver 2;" in warning
    assert unfinished_warning({**record, "model_error_episodes": 1}, 8) is None  # 4 of 8: not more than half


def test_resume_restores_the_runs_notes(tmp_path):
    """Suspected in issue 48: resume started the run's notes over (a zero-signal streak of 2 steps warned again
    only 3 steps after the resume; once-per-run warnings came again). They are in trainer_state.json now."""
    from drmas_graph.train.loop import _checkpoints

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=2))
    cfg = small_config(tmp_path, steps=2, eval={"k": 1, "n_tasks": 1, "before_training": False})
    first = Trainer(graph(), ParityEnv(n_train=3), cfg, policies={"solver": policy, "verifier": policy})
    try:
        notes = first.state.notes
        notes.logged_failures.add("judge_failed_episodes")
        notes.threshold_warned = True
        for step in (0, 1):
            assert notes.zero_signal.observe({"step": step, "adv/zero_variance_pools": 3, "adv/pools": 4}) is None
        first.save_checkpoint(1)
    finally:
        first.close()
    cfg = small_config(tmp_path, steps=2, resume=True, eval={"k": 1, "n_tasks": 1, "before_training": False})
    second = Trainer(graph(), ParityEnv(n_train=3), cfg, policies={"solver": policy, "verifier": policy})
    try:
        assert _checkpoints.resume(second.state) == 1
        notes = second.state.notes
        assert notes.logged_failures == {"judge_failed_episodes"} and notes.threshold_warned
        assert notes.zero_signal.streak == [(0, 3, 4), (1, 3, 4)]
        warning = notes.zero_signal.observe({"step": 2, "adv/zero_variance_pools": 4, "adv/pools": 4})
        assert warning is not None and "(step 0: 3/4, step 1: 3/4, step 2: 4/4;" in warning
    finally:
        second.close()
