"""W&B Weave export: the real `weave.WeaveClient` against an in-memory trace server (tests/_weave_server.py).

weave.init is never called (it is replaced by a function that fails the test); the exporter gets the
injected client. Calls are read back with `client.get_calls` and checked: tree, thread ids, attributes,
usage roll-up, summaries, feedback, timestamps, sampling, evaluations, and that export errors never fail
training.
"""

import datetime
import math
import sys
import warnings

import pytest

pytest.importorskip("weave")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402

from drmas_graph import SamplingParams  # noqa: E402
from drmas_graph.traces import weave_export as wx  # noqa: E402
from drmas_graph.config import TrainConfig, config_reference  # noqa: E402
from drmas_graph.errors import ConfigError  # noqa: E402
from drmas_graph.traces.store import TraceStore  # noqa: E402
from drmas_graph.testing import tiny_policy  # noqa: E402
from drmas_graph.train.loop.trainer import Trainer  # noqa: E402
from drmas_graph.types import Episode, Turn  # noqa: E402
from tests._envs import ParityEnv  # noqa: E402
from tests._weave_server import InMemoryTraceServer, make_client  # noqa: E402
from tests.test_trainer import graph, small_config  # noqa: E402

T0 = 1_700_000_000.0


@pytest.fixture
def weave_env(monkeypatch):
    """(server, client) with weave enabled for this test only, the client current; weave.init fails the test."""
    import weave
    from weave.trace.context import weave_client_context

    monkeypatch.setenv("WEAVE_DISABLED", "false")
    monkeypatch.setattr(weave, "init", lambda *a, **k: pytest.fail("weave.init must not be called in tests"))
    server = InMemoryTraceServer()
    client = make_client(server)
    weave_client_context.set_weave_client_global(client)  # reading feedback back needs it current
    yield server, client
    client.flush()
    weave_client_context.set_weave_client_global(None)


def by_op(client, op):
    """The calls of one op by start time, calls that started together (turns of a trace without turn start
    times) by their `index` attribute. Never by arrival: the client sends call starts from a thread pool, so
    the server sees them in any order (and `get_calls` returns them in that order)."""
    return sorted((c for c in client.get_calls() if f"/op/{op}:" in c.op_name),
                  key=lambda c: (c.started_at, c.attributes.get("index", -1)))


def utc(ts):
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def hand_episode(error=None):
    turns = [
        Turn(agent="solver", node="solve", step=1, index=0, messages=(SystemMessage("sys"), HumanMessage("2+2?")),
             prompt_ids=(1, 2, 3), response_ids=(4, 5), response_logprobs=(-0.5, -1.5), response_text="4",
             policy="qwen", policy_version=3, latency_s=0.25, call_key="solve",
             sampling=SamplingParams(temperature=0.7)),
        Turn(agent="verifier", node="verify", step=2, index=1, messages=(HumanMessage("check 4"),),
             prompt_ids=(1, 2, 3, 4), response_ids=(6,), response_logprobs=(-0.125,), response_text="",
             tool_calls=({"name": "lookup", "args": {"q": "4"}, "id": "c1", "type": "tool_call"},),
             finish_reason="tool_calls", policy="qwen", policy_version=3, latency_s=0.5, call_key="verify"),
        Turn(agent="judge", node="judge", step=3, index=2, messages=(HumanMessage("judge"),), prompt_ids=(),
             response_ids=(), response_logprobs=(), response_text="fine", trainable=False, latency_s=0.125,
             call_key="judge"),
    ]
    return Episode(task_id="t1", group_id="train:0:t1", input={"question": "2+2?"}, turns=turns,
                   final_state={"answer": "4", "messages": [HumanMessage("2+2?")]},
                   rewards={"solver": 1.0, "verifier": 0.5}, turn_rewards=[1.0, 0.5, 0.0],
                   advantages=[0.75, -0.25, 0.0], error=error,
                   timings={"start": T0, "end": T0 + 2, "wall_s": 2.0, "turn_starts": [T0 + 0.1, T0 + 1.0, T0 + 1.5]},
                   metadata={"phase": "train", "step": 0})


def test_episode_becomes_a_root_call_with_one_child_per_llm_call(weave_env):
    server, client = weave_env
    root = wx.export_episode(client, hand_episode(), train_step=7, run="r1")
    client.flush()
    [ep] = by_op(client, wx.EPISODE_OP)
    turns = by_op(client, wx.TURN_OP)
    assert ep.id == root.id and ep.parent_id is None and [t.parent_id for t in turns] == [ep.id] * 3
    assert {c.thread_id for c in [ep, *turns]} == {"train:0:t1"}  # the G rollouts of a task share a thread
    assert ep.started_at == utc(T0) and ep.ended_at == utc(T0 + 2)
    assert [t.started_at for t in turns] == [utc(T0 + 0.1), utc(T0 + 1.0), utc(T0 + 1.5)]
    assert [t.ended_at for t in turns] == [utc(T0 + 0.35), utc(T0 + 1.5), utc(T0 + 1.625)]
    assert ep.inputs["task_id"] == "t1" and ep.inputs["input"] == {"question": "2+2?"}
    assert ep.output["messages"] == [{"role": "user", "content": "2+2?"}] and ep.exception is None
    assert ep.attributes["train_step"] == 7 and ep.attributes["phase"] == "train" and ep.attributes["run"] == "r1"
    solver, verifier, judge = turns
    assert solver.inputs["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "2+2?"}]
    assert {k: solver.attributes[k] for k in ("agent", "node", "step", "call_key", "trainable", "policy_version")} \
        == {"agent": "solver", "node": "solve", "step": 1, "call_key": "solve", "trainable": True, "policy_version": 3}
    assert solver.attributes["sampling"]["temperature"] == 0.7 and judge.attributes["trainable"] is False
    assert solver.output["choices"][0]["message"]["content"] == "4"
    call = verifier.output["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["tool_calls"][0]["function"] == {
        "name": "lookup", "arguments": '{"q": "4"}'}
    # turn summaries: reward, advantage, logprob stats, tokens
    assert dict(solver.summary["drmas"]) == {"turn_reward": 1.0, "advantage": 0.75, "tokens": 2,
                                             "logprob_sum": -2.0, "logprob_mean": -1.0, "logprob_min": -1.5}
    assert verifier.summary["drmas"]["logprob_min"] == -0.125 and judge.summary["drmas"]["logprob_sum"] is None
    assert dict(solver.summary["usage"]["qwen"]) == {"requests": 1, "prompt_tokens": 3, "completion_tokens": 2,
                                                     "total_tokens": 5}
    # Weave rolls usage up to the episode: 2 policy calls (7 prompt + 3 completion tokens) + 1 app-model call
    assert dict(ep.summary["usage"]["qwen"]) == {"requests": 2, "prompt_tokens": 7, "completion_tokens": 3,
                                                 "total_tokens": 10}
    assert dict(ep.summary["usage"][wx.APP_MODEL]) == {"requests": 1}
    assert ep.summary["drmas"]["team_reward"] == 0.75 and "turn_reward" not in ep.summary["drmas"]
    feedback = sorted((f.payload["agent"], f.payload["value"]) for f in ep.feedback if f.feedback_type == wx.REWARD_FEEDBACK)
    assert feedback == [("solver", 1.0), ("verifier", 0.5)]
    assert "weave.init" not in server.requests and {"call_start", "call_end", "obj_create", "feedback_create"} <= set(server.requests)


def test_failed_episode_is_a_call_with_its_error_as_exception(weave_env):
    _, client = weave_env
    episode = hand_episode(error="ValueError: the graph raised")
    episode.rewards = {}
    wx.export_episode(client, episode)
    client.flush()
    [ep] = by_op(client, wx.EPISODE_OP)
    assert "the graph raised" in ep.exception and "EpisodeError" in ep.exception
    assert list(ep.feedback) == []


def test_the_judges_verdict_is_a_child_call_and_feedback_of_its_episode(weave_env):
    _, client = weave_env
    judged = hand_episode()
    prompt = [{"role": "system", "content": "Rubric: correct answers score 1."},
              {"role": "user", "content": "#0 solver (solve): 4\n#1 solver (solve): 5"}]
    judged.judgement = {"mode": "group", "model": "judge-7b", "rubric_sha": "3f2a9c0d1e4b", "prompt": prompt,
                        "replies": ["oops", '{"scores": [1.0, 0.0], "reasons": ["right", "wrong"]}'],
                        "scores": 1.0, "reasons": "right", "attempts": 2, "input_tokens": 120, "output_tokens": 30,
                        "cached": False, "seconds": 0.75, "group_size": 2, "index": 0, "error": None}
    failed = hand_episode()
    failed.judgement = {"mode": "episode", "model": "judge-7b", "prompt": prompt, "replies": ["no", "still no"],
                        "scores": None, "reasons": None, "attempts": 3, "cached": False,
                        "error": "JudgeError: no usable score after 3 attempts; last reply: 'still no'"}
    wx.export_episode(client, judged, train_step=1)
    wx.export_episode(client, failed, train_step=1)
    client.flush()
    roots = {c.id: c for c in by_op(client, wx.EPISODE_OP)}
    judges = by_op(client, wx.JUDGE_OP)
    [ok], [bad] = [c for c in judges if c.exception is None], [c for c in judges if c.exception is not None]
    assert ok.parent_id in roots and bad.parent_id in roots and ok.parent_id != bad.parent_id
    assert ok.started_at == ok.ended_at == utc(T0 + 2)  # at the episode's end (its record says how long it took)
    assert ok.inputs["messages"] == prompt and ok.inputs["mode"] == "group" and ok.inputs["index"] == 0
    assert ok.output["scores"] == 1.0 and ok.output["reasons"] == "right" and ok.output["model"] == "judge-7b"
    assert ok.output["reply"] == '{"scores": [1.0, 0.0], "reasons": ["right", "wrong"]}'
    assert ok.output["replies"] == ["oops", ok.output["reply"]] and ok.exception is None
    assert dict(ok.summary["drmas"]) == {"attempts": 2, "input_tokens": 120, "output_tokens": 30, "seconds": 0.75,
                                         "cached": False}
    assert "JudgementError" in bad.exception and "last reply: 'still no'" in bad.exception
    root = roots[ok.parent_id]
    assert "judge-7b" not in root.summary["usage"]  # one group call judged G episodes: no per-episode usage
    verdicts = [f.payload for f in root.feedback if f.feedback_type == wx.JUDGEMENT_FEEDBACK]
    assert verdicts == [{"mode": "group", "model": "judge-7b", "scores": 1.0, "reasons": "right", "error": None}]
    [verdict] = [f.payload for f in roots[bad.parent_id].feedback if f.feedback_type == wx.JUDGEMENT_FEEDBACK]
    assert verdict["scores"] is None and verdict["error"].startswith("JudgeError: no usable score")


def test_traces_without_turn_start_times_fall_back_to_the_episode_start(weave_env):
    _, client = weave_env
    episode = hand_episode()
    del episode.timings["turn_starts"]
    wx.export_episode(client, episode)
    client.flush()
    turns = by_op(client, wx.TURN_OP)
    assert [t.started_at for t in turns] == [utc(T0)] * 3
    assert [t.ended_at for t in turns] == [utc(T0 + 0.25), utc(T0 + 0.5), utc(T0 + 0.125)]  # start + latency
    assert [t.attributes["start_recorded"] for t in turns] == [False] * 3


def test_sample_groups_is_seeded_per_step():
    groups = [f"g{i}" for i in range(10)] * 4  # 10 groups of 4 rollouts
    a = wx.sample_groups(groups, 3, seed=0, step=5)
    assert len(a) == 3 and a == wx.sample_groups(reversed(groups), 3, seed=0, step=5)  # order-independent
    assert wx.sample_groups(groups, 3, seed=0, step=6) != a or wx.sample_groups(groups, 3, seed=1, step=5) != a
    assert wx.sample_groups(groups, None, seed=0, step=0) == sorted(set(groups))
    assert wx.sample_groups(groups, 0, seed=0, step=0) == []


def weave_trainer(tmp_path, **weave_cfg):
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, logging={"progress": False, "tensorboard": False,
                                          "weave": {"project": "ent/proj", **weave_cfg}})
    return Trainer(graph(), ParityEnv(), cfg, policies={"solver": policy, "verifier": policy})


def test_training_exports_sampled_groups_and_evaluations(weave_env, tmp_path, monkeypatch):
    _, client = weave_env
    monkeypatch.setattr(wx, "connect", lambda project: client if project == "ent/proj" else pytest.fail(project))
    trainer = weave_trainer(tmp_path, sample_per_step=1)
    result = trainer.run()
    trainer.close()
    assert trainer.weave.errors == 0 and trainer.weave.exported_episodes == 8  # 2 steps x 1 group x G=4
    episodes = [c for c in by_op(client, wx.EPISODE_OP) if c.attributes["phase"] == "train"]
    assert sorted(c.attributes["train_step"] for c in episodes) == [0, 0, 0, 0, 1, 1, 1, 1]
    for step in (0, 1):
        threads = {c.thread_id for c in episodes if c.attributes["train_step"] == step}
        assert len(threads) == 1 and next(iter(threads)).startswith(f"train:{step}:")
    turns = by_op(client, wx.TURN_OP)
    assert len(turns) == 16 and {t.parent_id for t in turns} == {c.id for c in episodes}
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        for c in episodes:
            stored = store.load_episode(c.attributes["episode_id"])
            kids = sorted((t for t in turns if t.parent_id == c.id), key=lambda t: t.attributes["index"])
            assert [t.summary["drmas"]["advantage"] for t in kids] == pytest.approx(stored.advantages)
            assert [t.summary["drmas"]["turn_reward"] for t in kids] == pytest.approx(stored.turn_rewards)
            assert [t.summary["drmas"]["logprob_sum"] for t in kids] == pytest.approx(
                [math.fsum(t.response_logprobs) for t in stored.turns])
            starts = stored.timings["turn_starts"]  # recorded by the instrumented graph as each call began
            assert stored.timings["start"] <= starts[0] <= starts[1] <= stored.timings["end"]
            assert [t.started_at for t in kids] == [utc(s) for s in starts]
            assert all(t.attributes["start_recorded"] for t in kids)
            assert c.started_at <= kids[0].started_at and kids[-1].ended_at <= c.ended_at + datetime.timedelta(0, 1e-3)
            usage = c.summary["usage"][stored.turns[0].policy]
            assert usage["completion_tokens"] == sum(t.n_response_tokens for t in stored.turns)
            assert usage["prompt_tokens"] == sum(t.n_prompt_tokens for t in stored.turns)
            feedback = {f.payload["agent"]: f.payload["value"] for f in c.feedback}
            assert feedback == pytest.approx(stored.rewards)
    # evaluations (before training and at the end) through weave.EvaluationLogger
    evals = sorted((c for c in client.get_calls() if "Evaluation.evaluate" in c.op_name),
                   key=lambda c: c.attributes["step"])
    assert [c.attributes["step"] for c in evals] == [0, 2]
    for call, record in zip(evals, result.evals):
        out = call.output
        assert out["output"]["avg@k"] == pytest.approx(record["avg@k"])
        assert out["output"]["pass@k"] == pytest.approx(record["pass@k"])
        assert out["avg_at_k"]["mean"] == pytest.approx(record["avg@k"])  # the mean over tasks of per-task avg@k
        assert out["pass_at_k"]["mean"] == pytest.approx(record["pass@k"])
        assert out["solver_reward"]["mean"] == pytest.approx(record["solver/reward"])
        assert {"solver_pass_at_k", "verifier_avg_at_k", "verifier_reward"} <= set(out)


def test_failed_rollouts_of_a_step_are_exported_with_their_error(weave_env, tmp_path, monkeypatch):
    from langchain_core.messages import HumanMessage as Human

    from tests import _graphs
    from tests.test_instrument import Unreachable

    _, client = weave_env
    monkeypatch.setattr(wx, "connect", lambda project: client)
    llm = Unreachable()

    def solver(state):
        if state["question"] == "boom":
            raise ValueError("this task makes the graph raise")
        return {"answer": llm.invoke([Human(state["question"])]).content}

    from langgraph.graph import END, START, StateGraph

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    env = ParityEnv(n_train=2)
    env.train[0] = type(env.train[0])(id="train-0", input={"question": "boom"})
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=1, eval={"k": 1, "n_tasks": 1, "before_training": False},
                       logging={"progress": False, "tensorboard": False,
                                "weave": {"project": "p", "sample_per_step": None, "evaluations": False}})
    trainer = Trainer(g.compile(), env, cfg, policies={"solver": policy})
    trainer.run()
    trainer.close()
    episodes = by_op(client, wx.EPISODE_OP)
    failed = [c for c in episodes if c.exception]
    assert len(episodes) == 8 and len(failed) == 4 and trainer.weave.errors == 0
    assert {c.inputs["task_id"] for c in failed} == {"train-0"} and {c.attributes["train_step"] for c in failed} == {0}
    assert all("this task makes the graph raise" in c.exception for c in failed)


def test_rollouts_whose_reward_failed_are_exported_as_not_trained_on(weave_env, tmp_path, monkeypatch):
    """train-1's reward is NaN: its 4 rollouts finished (no error stored) but the step did not train on them;
    they are exported with their step, marked by why, next to train-0's trained rollouts."""
    _, client = weave_env
    monkeypatch.setattr(wx, "connect", lambda project: client)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    cfg = small_config(tmp_path, steps=1, eval={"k": 1, "n_tasks": 1, "before_training": False},
                       logging={"progress": False, "tensorboard": False,
                                "weave": {"project": "p", "sample_per_step": None, "evaluations": False}})
    trainer = Trainer(graph(), ParityEnv(n_train=2, bad_reward=("train-1",)), cfg,
                      policies={"solver": policy, "verifier": policy})
    result = trainer.run()
    trainer.close()
    assert result.history[0]["bad_reward_episodes"] == 4
    episodes = [c for c in by_op(client, wx.EPISODE_OP) if c.attributes["phase"] == "train"]
    assert trainer.weave.errors == 0 and len(episodes) == 8 and {c.attributes["train_step"] for c in episodes} == {0}
    untrained = [c for c in episodes if c.exception]
    assert {c.inputs["task_id"] for c in untrained} == {"train-1"} and len(untrained) == 4
    # the reason scoring stored, under the step it was not trained in
    reason = wx.unused_error(0, "reward of team for task 'train-1' is nan")
    assert all(reason in c.exception for c in untrained), untrained[0].exception
    assert all(c.summary["drmas"]["rewards"] == {} for c in untrained)  # no reward was recorded for them


def test_export_errors_never_fail_training_and_are_reported_once(weave_env, tmp_path, monkeypatch):
    _, client = weave_env
    monkeypatch.setattr(wx, "connect", lambda project: client)

    def broken(*args, **kwargs):
        raise RuntimeError("weave server unreachable")

    monkeypatch.setattr(wx, "export_episode", broken)
    monkeypatch.setattr(wx, "log_evaluation", broken)
    trainer = weave_trainer(tmp_path, sample_per_step=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.run()
        trainer.close()
    assert [r["step"] for r in result.history] == [0, 1] and result.checkpoint is not None
    assert trainer.weave.errors == 4  # 2 steps + 2 evaluations
    reported = [w for w in caught if issubclass(w.category, wx.WeaveExportWarning)]
    assert len(reported) == 1 and "weave server unreachable" in str(reported[0].message)


def test_cli_exports_a_stored_run(weave_env, tmp_path, monkeypatch):
    from drmas_graph.cli import main

    _, client = weave_env
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    trainer = Trainer(graph(), ParityEnv(), small_config(tmp_path, steps=1, eval={"k": 1, "n_tasks": 1}),
                      policies={"solver": policy, "verifier": policy})
    trainer.run()
    trainer.close()
    monkeypatch.setattr(wx, "connect", lambda project: client if project == "ent/proj" else pytest.fail(project))
    assert main(["traces", "export", "--weave", "ent/proj", str(tmp_path / "run"), "--sample-per-step", "1"]) == 0
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        n_eval = len([s for s in store.episodes() if s.step is None])
    episodes = by_op(client, wx.EPISODE_OP)
    train = [c for c in episodes if c.attributes["train_step"] == 0]
    assert len(train) == 4 and len({c.thread_id for c in train}) == 1  # one group of G=4 rollouts
    assert len(episodes) == 4 + n_eval and n_eval == 2  # eval before and after training, k=1, 1 task


def test_weave_disabled_exports_nothing_and_says_so(tmp_path, monkeypatch):
    import weave

    monkeypatch.setenv("WEAVE_DISABLED", "true")
    monkeypatch.setattr(weave, "init", lambda *a, **k: pytest.fail("weave.init must not be called"))
    cfg = TrainConfig.model_validate({"logging": {"weave": {"project": "p"}}})
    with pytest.warns(wx.WeaveExportWarning, match="WEAVE_DISABLED"):
        assert wx.start_exporter(cfg, tmp_path / "traces.db") is None
    # why: with WEAVE_DISABLED a client logs nothing at all (create_call returns a placeholder)
    server = InMemoryTraceServer()
    client = make_client(server)
    call = client.create_call(wx.EPISODE_OP, {})
    client.finish_call(call)
    client.flush()
    assert server.calls == {}


def test_connect_turns_weave_implicit_patching_off(monkeypatch):
    import weave

    seen = {}
    monkeypatch.setattr(weave, "init", lambda project, **kw: seen.update(project=project, **kw) or "client")
    assert wx.connect("e/p") == "client"
    assert seen["project"] == "e/p" and seen["settings"]["implicitly_patch_integrations"] is False


def test_missing_weave_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "weave", None)
    with pytest.raises(ConfigError, match=r"pip install 'drmas-graph\[weave\]'"):
        wx.require_weave()


def test_logging_weave_config():
    assert TrainConfig.model_validate({"logging": {"weave": False}}).logging.weave is None
    with pytest.raises(ConfigError, match="logging.weave needs a project"):
        from drmas_graph.config import merge_overrides

        merge_overrides(None, {"logging__weave": True})
    wc = TrainConfig.model_validate({"logging": {"weave": {"project": "e/p"}}}).logging.weave
    assert (wc.project, wc.sample_per_step, wc.evaluations) == ("e/p", 4, True)
    rows = {r[0] for r in config_reference()}
    assert {"logging.weave", "logging.weave.project", "logging.weave.sample_per_step"} <= rows
