"""Episodes that do not finish are learning signal (issue 22): where the boundary between a model error (kept)
and a failure (dropped) sits, and that truncated and model-error episodes reach the update with the rewards
the README names; truncated recordings in the store, replay and the CLI."""

import dataclasses

import pytest
import torch
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, StateGraph

from drmas_graph import SamplingParams, TraceStore, instrument
from drmas_graph._structured import InvalidReplyError
from drmas_graph.cli import main
from drmas_graph.errors import RolloutError, StructuredOutputError
from drmas_graph.instrumentation._outcomes import note_stop
from drmas_graph.testing import scripted_policy, tiny_policy
from drmas_graph.traces.replay import replay
from drmas_graph.train.loop.trainer import Trainer, collect, learn
from drmas_graph.types import Episode, Turn
from graphs.research.env import ResearchEnv
from graphs.research.graph import build_graph as build_research
from tests import _graphs
from tests.test_instrument import Unreachable
from tests.test_rollout_config import Loop, LoopEnv
from tests.test_trainer import params, small_config


# --- the boundary: which exceptions are the policy's doing ---------------------------------------------------


def _turn(index, *, text="", trainable=True, tool_calls=()):
    return Turn(agent=f"a{index}", node=f"n{index}", step=index, index=index, messages=(), prompt_ids=(1,),
                response_ids=(2,), response_logprobs=(-0.5,), response_text=text, trainable=trainable,
                tool_calls=tuple(tool_calls))


def _stop(exc, turns=None, **episode):
    ep = Episode(turns=turns if turns is not None else [_turn(0, text="first"), _turn(1, text='{"x": 1 oops')],
                 error="whatever _recording wrote", **episode)
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - a real traceback, as in a run
        note_stop(ep, raised)
    return ep


def _invalid_reply(turn_index):
    exc = InvalidReplyError("agent 'a1' (node 'n1'): the call asks for a JSON object (json_schema), but ...")
    exc.turn_index = turn_index
    return exc


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _tool_validation_error():
    try:
        add.invoke({"a": "not a number"})
    except Exception as exc:  # noqa: BLE001 - what a LangChain tool raises for bad arguments
        return exc
    raise AssertionError("add accepted bad arguments")


def test_a_reply_that_broke_its_structured_output_request_is_a_model_error_at_its_turn():
    ep = _stop(_invalid_reply(1))
    assert ep.outcome == "model_error" and ep.model_error_turn == 1 and ep.error is None
    assert ep.model_error.startswith("turn 1 (agent 'a1', node 'n1'): InvalidReplyError: agent 'a1'")
    wrapped = RuntimeError("the app re-raised it")  # `raise ... from exc` keeps the cause
    wrapped.__cause__ = _invalid_reply(0)
    assert _stop(wrapped).model_error_turn == 0


def test_output_parser_and_tool_argument_errors_are_model_errors_at_the_turn_that_caused_them():
    ep = _stop(OutputParserException("bad", llm_output='{"x": 1 oops'))
    assert ep.outcome == "model_error" and ep.model_error_turn == 1
    calls = [_turn(0, tool_calls=[{"name": "add", "args": {"a": "x"}, "id": "c0"}]), _turn(1, text="done")]
    ep = _stop(_tool_validation_error(), turns=calls)
    assert ep.outcome == "model_error" and ep.model_error_turn == 0 and "ValidationError" in ep.model_error
    from langgraph.prebuilt.tool_node import ToolInvocationError

    invocation = ToolInvocationError("add", _tool_validation_error(), {"a": "x"})
    assert _stop(invocation, turns=calls).model_error_turn == 0


def test_failures_that_are_not_the_policys_doing_stay_failures():
    ep = _stop(ConnectionError("Connection refused"))  # e.g. a model that is not trained
    assert ep.outcome == "failed" and ep.error == "ConnectionError: Connection refused" and ep.model_error is None
    assert _stop(ValueError("the app's own bug")).outcome == "failed"
    assert _stop(StructuredOutputError("tool_choice forces tool 'x', which is not bound")).outcome == "failed"
    served_by_the_app = [_turn(0, text='{"x": 1 oops', trainable=False)]
    assert _stop(OutputParserException("bad", llm_output='{"x": 1 oops'), turns=served_by_the_app).outcome == "failed"
    assert _stop(_invalid_reply(7)).outcome == "failed"  # no such turn: never guessed
    assert _stop(_tool_validation_error(), turns=[_turn(0, text="no tool calls")]).outcome == "failed"


def test_a_limit_or_the_recursion_limit_truncates_whatever_the_app_raised_afterwards():
    ep = _stop(IndexError("the app choked on the refused call"), truncated="max_llm_calls: cap 5")
    assert ep.outcome == "truncated" and ep.truncated == "max_llm_calls: cap 5" and ep.error is None
    ep = _stop(GraphRecursionError("Recursion limit of 3 reached"))
    assert ep.truncated_by == "recursion_limit" and "after 2 LLM call(s)" in ep.truncated


# --- end to end -----------------------------------------------------------------------------------------


def _judge_until_done(solver_llm, judge_llm):
    """solver -> judge -> solver ... until the judge's reply is 'done'."""

    def solver(state):
        return {"answer": solver_llm.invoke([HumanMessage(state["question"])]).content,
                "rounds": state.get("rounds", 0) + 1}

    def judge(state):
        return {"verdict": judge_llm.invoke([HumanMessage(f"{state['question']} -> {state['answer']}")]).content}

    g = StateGraph(Loop)
    g.add_node("solver", solver)
    g.add_node("judge", judge)
    g.add_edge(START, "solver")
    g.add_edge("solver", "judge")
    g.add_conditional_edges("judge", lambda s: END if s["verdict"].strip() == "done" else "solver", ["solver", END])
    return g.compile()


class FinishedOnlyEnv(LoopEnv):
    """Team reward 1 for a finished episode; records every episode it was asked to score."""

    def __init__(self):
        super().__init__(["q"])
        self.scored = []

    def reward(self, task, episode):
        self.scored.append(episode)
        return 1.0


def _one_step(graph, env, cfg, policies, monkeypatch):
    """(the step's record, model name -> the Samples its updater received) of one training step."""
    trainer = Trainer(graph, env, cfg, policies=policies)
    seen = {}
    for name, updater in ((m.name, m.updater) for m in trainer.state.trained_models()):
        def update(samples, _real=updater.update, _name=name, **kwargs):
            seen[_name] = list(samples)
            return _real(samples, **kwargs)
        monkeypatch.setattr(updater, "update", update)
    try:
        return trainer.train_step(0), seen
    finally:
        trainer.close()


def test_a_truncated_episodes_samples_reach_the_update_with_the_truncated_reward(tmp_path, monkeypatch):
    """Episode 0 finishes (the judge says 'done'; env reward 1), episode 1 loops into max_llm_calls=4 (4 turns,
    rollout.truncated_reward 0.0 by default, env.reward never asked). Per agent the pool is [1, 0, 0]: mean 1/3,
    unbiased std sqrt(1/3) = 0.5773503, so A = (R - mu) / (std + 1e-6) = +1.1546985 for the finished turn and
    -0.5773493 for each truncated one."""
    solver = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=4))
    judge = scripted_policy(["done", "again", "again"], seed=1)
    before = params(solver), params(judge)
    cfg = small_config(tmp_path, steps=1, tasks_per_step=1, group_size=2, max_concurrency=1,
                       eval={"k": 1, "before_training": False}, rollout={"max_llm_calls": 4})
    env = FinishedOnlyEnv()
    record, seen = _one_step(_judge_until_done(Unreachable(), Unreachable()), env, cfg,
                             {"solver": solver, "judge": judge}, monkeypatch)
    assert record["truncated_episodes"] == 1 and record["episodes"] == 2
    assert [ep.outcome for ep in env.scored] == ["finished"]  # the truncated one got truncated_reward, not env's
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        finished, truncated = (store.load_episode(s.id) for s in store.episodes(step=0))
    assert finished.outcome == "finished" and truncated.truncated_by == "max_llm_calls"
    assert truncated.turn_rewards == [0.0] * 4 and finished.turn_rewards == [1.0, 1.0]
    for name, turns in ((solver.name, [0, 2]), (judge.name, [1, 3])):
        samples = {(s.episode_id, s.turn_index): s for s in seen[name]}
        assert len(samples) == 3
        assert samples[(finished.id, turns[0])].advantage == pytest.approx(1.1546985, abs=1e-5)
        for i in turns:
            sample = samples[(truncated.id, i)]
            assert sample.advantage == pytest.approx(-0.5773493, abs=1e-5)
            assert sample.response_ids == truncated.turns[i].response_ids  # the recorded ids, exactly
    assert all(any(not torch.equal(v, b[k]) for k, v in params(p).items()) for p, b in zip((solver, judge), before))


_CLARIFY_OK = '{"need_clarification": true, "question": "Which Vamberg?", "verification": ""}'


def test_broken_json_turns_are_penalised_and_a_model_error_episode_is_trained(tmp_path, monkeypatch):
    """The research app's clarifier (json_schema, 3 attempts). Episode 0: 'oops' (invalid), then valid JSON ->
    finished, reward 0 (no report). Episode 1: three replies that are not JSON -> model error at its third
    turn, rollout.model_error_reward 0. Turn rewards (penalty 0.1): [-0.1, 0] and [-0.1, -0.1, -0.1]; the
    clarifier's pool mean -0.08, unbiased std sqrt(0.008 / 4) = 0.0447214: A = (R - mu) / (std + 1e-6) =
    -0.02 / 0.0447224 = -0.4472036 and 0.08 / 0.0447224 = +1.7888144."""
    clarifier = scripted_policy(["oops", _CLARIFY_OK, "x", "y", "z"], name="clarifier")
    cfg = small_config(tmp_path, steps=1, tasks_per_step=1, group_size=2, max_concurrency=1,
                       eval={"k": 1, "before_training": False})
    record, seen = _one_step(build_research(Unreachable()), ResearchEnv(), cfg, {"clarify": clarifier}, monkeypatch)
    assert record["model_error_episodes"] == 1 and record["agent/clarify/model_error_episodes"] == 1
    assert record["samples/model_error_share"] == pytest.approx(3 / 5)
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        finished, broken = (store.load_episode(s.id) for s in store.episodes(step=0))
    assert finished.outcome == "finished" and finished.turn_rewards == pytest.approx([-0.1, 0.0])
    assert broken.outcome == "model_error" and broken.model_error_turn == 2
    assert broken.model_error.startswith("turn 2 (agent 'clarify', node 'clarify'): InvalidReplyError")
    assert broken.turn_rewards == pytest.approx([-0.1, -0.1, -0.1])
    assert [t.format_error is not None for t in finished.turns + broken.turns] == [True, False, True, True, True]
    advantages = {(s.episode_id, s.turn_index): s.advantage for s in seen[clarifier.name]}
    assert advantages == pytest.approx({(finished.id, 0): -0.4472036, (finished.id, 1): 1.7888144,
                                        (broken.id, 0): -0.4472036, (broken.id, 1): -0.4472036,
                                        (broken.id, 2): -0.4472036}, abs=1e-5)


def _research_reply(prompt):
    if "need_clarification" in prompt:
        return '{"need_clarification": false, "question": "", "verification": "the river"}'
    if "research_brief" in prompt:
        return '{"research_brief": "Which river flows through Vamberg?"}'
    return '<tool_call>{"name": "web_search", "arguments": {"max_results": "many"}}</tool_call>'


def test_tool_arguments_that_fail_the_tools_schema_are_a_model_error_of_the_turn_that_called_it(tmp_path):
    policy = scripted_policy(_research_reply)
    store = TraceStore(tmp_path / "t.db")
    app = instrument(build_research(Unreachable()), {a: policy for a in ("clarify", "write_brief", "researcher")},
                     store=store)
    with pytest.raises(RolloutError, match="stopped after 3 LLM call"):
        app.rollout({"messages": [HumanMessage("Which river flows through Vamberg?")]})
    (episode,) = store.iter_episodes()
    store.close()
    assert episode.outcome == "model_error" and episode.model_error_turn == 2
    assert episode.model_error.startswith("turn 2 (agent 'researcher', node 'researcher'): ValidationError")


def test_a_connection_error_of_a_model_that_is_not_trained_is_dropped_and_counted(tmp_path, monkeypatch):
    """The checker node keeps the app's own ChatOpenAI (no policy, strict off): it cannot connect. That is not
    the policy's doing: those episodes fail and are dropped, the others train."""
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    checker = ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=5)

    def solver(state):
        return {"answer": Unreachable().invoke([HumanMessage(state["question"])]).content}

    def check(state):
        return {"verdict": checker.invoke([HumanMessage(state["answer"])]).content}

    g = StateGraph(_graphs.QA)
    g.add_node("solver", solver)
    g.add_node("check", check)
    g.add_edge(START, "solver")
    g.add_conditional_edges("solver", lambda s: "check" if s["question"].startswith("check") else END,
                            ["check", END])
    g.add_edge("check", END)
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))
    cfg = small_config(tmp_path, steps=1, tasks_per_step=2, group_size=2, strict=False,
                       eval={"k": 1, "before_training": False})
    trainer = Trainer(g.compile(), LoopEnv(["plain", "check this"]), cfg, policies={"solver": policy})
    try:  # one step, collect and learn apart: the batch carries the rollouts' errors
        batch = collect(trainer.state, 0)
        record = learn(trainer.state, batch, pipelined=False)
    finally:
        trainer.close()
    assert record["failed_episodes"] == 2 and record["episodes"] == 2 and record["model_error_episodes"] == 0
    assert len(batch.rollout_errors) == 2 and all("Connection error" in str(e) for e in batch.rollout_errors)
    with TraceStore(tmp_path / "run" / "traces.db", readonly=True) as store:
        failed = [store.load_episode(s.id) for s in store.episodes(outcome="failed")]
    assert len(failed) == 2 and all(ep.error.startswith("OpenAIConnectionError: Connection error") for ep in failed)


# --- traces: store, replay, CLI -------------------------------------------------------------------------------


def _truncated_recording(tmp_path):
    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=3))
    graph = _judge_until_done(Unreachable(), Unreachable())
    store = TraceStore(tmp_path / "t.db")
    app = instrument(graph, {"solver": policy, "judge": policy}, store=store)
    with pytest.raises(RolloutError, match="stopped after 3 LLM call"):
        app.rollout({"question": "q"}, metadata={"max_llm_calls": 3})  # the trainer's limit, given by hand
    store.close()
    return graph, tmp_path / "t.db"


def test_a_truncated_episode_is_stored_as_such_and_replays_up_to_where_it_stopped(tmp_path, capsys):
    graph, path = _truncated_recording(tmp_path)
    with TraceStore(path, readonly=True) as store:
        (summary,) = store.episodes(outcome="truncated")
        episode = store.load_episode(summary.id)
        assert store.episodes(outcome="failed") == [] and store.stats().n_truncated == 1
    assert summary.outcome == "truncated" and episode.truncated_by == "max_llm_calls" and len(episode.turns) == 3
    result = replay(graph, path, episode.id)
    assert result.stopped and result.divergences == [] and len(result.turns) == 3  # not an unrecorded call
    assert main(["traces", "list", str(path), "--truncated"]) == 0
    assert f"{episode.id}" in capsys.readouterr().out
    assert main(["traces", "show", str(path), episode.id]) == 0
    assert "truncated max_llm_calls: episode" in capsys.readouterr().out
    assert main(["traces", "replay", str(path), episode.id, "--graph", "tests.test_unfinished:replay_graph"]) == 0
    assert "was truncated (max_llm_calls)" in capsys.readouterr().out


def replay_graph():
    return _judge_until_done(Unreachable(), Unreachable())


def test_model_error_fields_and_format_errors_round_trip_through_the_store(tmp_path):
    turns = [_turn(0, text="oops"), _turn(1, text="z")]
    turns[1] = dataclasses.replace(turns[1], format_error="not JSON")
    episode = Episode(turns=turns, model_error="turn 1 (agent 'a1', node 'n1'): InvalidReplyError: ...",
                      model_error_turn=1)
    with TraceStore(tmp_path / "t.db") as store:
        store.write_episode(episode)
        loaded = store.load_episode(episode.id)
        (summary,) = store.episodes(outcome="model_error")
    assert (loaded.model_error, loaded.model_error_turn) == (episode.model_error, 1)
    assert [t.format_error for t in loaded.turns] == [None, "not JSON"]
    assert summary.outcome == "model_error" and summary.model_error == episode.model_error
