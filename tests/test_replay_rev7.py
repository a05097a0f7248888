"""Replay of issue 58 (round 7): a reply is read again with the tool parser that read it when recorded (Mistral,
none), a store that predates that record replays as before; a changed stop or max_tokens of a call is a
`sampling_changed` divergence; an episode whose reward failed replays clean on the unchanged graph."""

import sqlite3

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph

from drmas_graph import SamplingParams, TraceStore, instrument
from drmas_graph.cli import main as cli_main
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import replay
from drmas_graph.train.loop.trainer import Trainer, evaluate
from tests._envs import ParityEnv
from tests.test_instrument import Unreachable
from tests.test_trainer import small_config


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _one_node(fn):
    g = StateGraph(MessagesState)
    g.add_node("solve", fn)
    g.add_edge(START, "solve")
    g.add_edge("solve", END)
    return g.compile()


def _tool_loop(**bind):
    """Asks, runs the tool calls of the reply, asks again: the second prompt holds the first reply's message."""
    llm = Unreachable().bind_tools([add], **bind)

    def solve(state):
        messages = [HumanMessage("What is 2+3?")]
        first = llm.invoke(messages)
        messages += [first, *(ToolMessage("5", tool_call_id=c["id"]) for c in first.tool_calls)]
        return {"messages": [*messages, llm.invoke(messages)]}

    return _one_node(solve)


CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
REPLIES = {  # the first reply in each parser's format, then the answer
    "hermes": ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."],
    "mistral": ['[{"name": "add", "arguments": {"a": 2, "b": 3}}]', "It is 5."],
    "none": ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."],
}


def _drop_new_turn_columns(path):
    """Make the store look written before `Turn.tool_parser` and `Turn.call_sampling` were recorded."""
    with sqlite3.connect(path) as conn:
        for column in ("tool_parser", "call_sampling"):
            conn.execute(f"ALTER TABLE turns DROP COLUMN {column}")
    conn.close()


@pytest.mark.parametrize("parser", ["hermes", "mistral", "none"])
def test_a_tool_loop_replays_with_the_parser_that_read_it(tmp_path, parser):
    """rev7_b: replay read every reply with Hermes. A Mistral policy's call list came back as the message's
    content (the second prompt changed: prompt_changed); a 'none' policy's <tool_call> text lost its markup."""
    graph = _tool_loop()
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, {"solve": scripted_policy(REPLIES[parser], tool_parser=parser)},
                             store=store).rollout({"messages": []})
    first = episode.final_state["messages"][1]
    if parser == "none":
        assert first.tool_calls == [] and first.content == REPLIES["none"][0]
    else:
        assert [c["args"] for c in first.tool_calls] == [CALL["arguments"]] and first.content == ""
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        assert [t.tool_parser for t in store.load_episode(episode.id).turns] == [parser, parser]
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.error is None and result.state_matches
    assert result.final_state["messages"][1].content == first.content


def test_a_forced_tool_call_of_a_mistral_policy_replays_without_an_error(tmp_path):
    """A forced tool_choice read with Hermes found no call in the Mistral reply and no JSON object: replay
    raised the StructuredOutputError the live run did not (an outcome_changed divergence)."""
    graph = _tool_loop(tool_choice="add")
    policy = scripted_policy([REPLIES["mistral"][0], REPLIES["mistral"][0]], tool_parser="mistral")
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, {"solve": policy}, store=store).rollout({"messages": []})
    assert episode.error is None and episode.turns[0].response_format["type"] == "tool"
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.error is None and result.divergences == [] and result.state_matches
    assert [len(m.tool_calls) for m in result.final_state["messages"] if m.type == "ai"] == [1, 1]


def test_a_store_from_before_tool_parsers_were_recorded_replays_as_before(tmp_path):
    """Turn.tool_parser NULL: Hermes, unless Hermes misses the recorded tool calls and another parser finds them
    (a Mistral policy's calls)."""
    graph = _tool_loop()
    with TraceStore(tmp_path / "t.db") as store:
        ids = {parser: instrument(graph, {"solve": scripted_policy(REPLIES[parser], tool_parser=parser)},
                                  store=store).rollout({"messages": []}).id for parser in ("hermes", "mistral")}
    _drop_new_turn_columns(tmp_path / "t.db")
    for parser, episode_id in ids.items():
        with TraceStore(tmp_path / "t.db", readonly=True) as store:
            turns = store.load_episode(episode_id).turns
        assert [(t.tool_parser, t.call_sampling) for t in turns] == [(None, None)] * 2
        result = replay(graph, tmp_path / "t.db", episode_id)
        assert result.divergences == [] and result.state_matches, parser


def _says(stop=None, max_tokens=None):
    llm = Unreachable() if max_tokens is None else Unreachable().bind(max_tokens=max_tokens)
    return _one_node(lambda s: {"messages": [llm.invoke("Say hello.", stop=stop)]})


def test_a_changed_stop_or_max_tokens_is_a_sampling_divergence(tmp_path):
    """Recorded 'Hello. World.' without a stop string: the app that now passes stop=['.'] would get 'Hello', and
    replay answered 'Hello. World.' with no divergence. Now the request's stop strings and max_tokens compare."""
    policy = scripted_policy(["Hello. World."], sampling=SamplingParams(max_new_tokens=64))
    with TraceStore(tmp_path / "t.db") as store:
        plain = instrument(_says(), {"solve": policy}, store=store).rollout({"messages": []})
        cut = instrument(_says(stop=["."]), {"solve": policy}, store=store).rollout({"messages": []})
    assert plain.turns[0].call_sampling == {"stop": [], "max_tokens": None}
    assert cut.turns[0].call_sampling == {"stop": ["."], "max_tokens": None}
    assert cut.final_state["messages"][-1].content == "Hello"
    path = tmp_path / "t.db"

    [d] = replay(_says(stop=["."]), path, plain.id).divergences
    assert (d.kind, d.agent, d.call_key, d.call_index) == ("sampling_changed", "solve", "solve", 0)
    assert d.diff.splitlines()[-2:] == ["-[stop] []", '+[stop] ["."]']
    [d] = replay(_says(), path, cut.id).divergences  # the stop string dropped
    assert d.kind == "sampling_changed" and d.diff.splitlines()[-2:] == ['-[stop] ["."]', "+[stop] []"]
    [d] = replay(_says(max_tokens=3), path, plain.id).divergences
    assert d.kind == "sampling_changed" and d.diff.splitlines()[-2:] == ["-[max_tokens] none", "+[max_tokens] 3"]
    same = replay(_says(stop=["."]), path, cut.id)  # unchanged: the cut answer again
    assert same.divergences == [] and same.final_state["messages"][-1].content == "Hello"

    _drop_new_turn_columns(path)  # a store that predates the record: stop strings and max_tokens are not compared
    assert replay(_says(stop=["."]), path, plain.id).divergences == []


class FailingRewardEnv(ParityEnv):
    """ParityEnv whose env.reward raises for task test-0."""

    def reward(self, task, episode):
        if task.id == "test-0":
            raise ValueError("the reward broke")
        return super().reward(task, episode)


def test_an_episode_whose_reward_failed_replays_clean(tmp_path, capsys):
    """A user's report: an episode scoring left out (its env.reward raised: the store keeps 'BadRewardError:
    ...' as its error) replayed as outcome_changed when the run itself was truncated (or broken by the model):
    replay compared the re-run with the reward's error. Evaluated truncated episodes (rollout.truncated_reward
    null: env.reward scores them) and finished ones, replayed through the Python API and the CLI."""
    from drmas_graph.testing import tiny_policy
    from tests.test_trainer import graph

    policy = tiny_policy(seed=0, sampling=SamplingParams(max_new_tokens=6))
    for name, rollout in (("truncated", {"max_llm_calls": 1, "truncated_reward": None}), ("finished", {})):
        cfg = small_config(tmp_path / name, rollout=rollout, eval={"k": 2, "n_tasks": 2, "before_training": False})
        trainer = Trainer(graph(), FailingRewardEnv(n_train=2, n_test=2), cfg,
                          policies={"solver": policy, "verifier": policy}, train=False)
        try:
            evaluate(trainer, step=0)
        finally:
            trainer.close()
        path = tmp_path / name / "run" / "traces.db"
        with TraceStore(path, readonly=True) as store:
            failed = [store.load_episode(s.id) for s in store.episodes(failed=True)]
        assert len(failed) == 2 and all(ep.error.startswith("BadRewardError: env FailingRewardEnv.reward() raised")
                                        for ep in failed)
        assert all(bool(ep.truncated) == (name == "truncated") for ep in failed)
        for episode in failed:
            result = replay(graph(), path, episode.id)
            assert result.divergences == [] and result.error is None and result.state_matches, (name, result)
            assert cli_main(["traces", "replay", str(path), episode.id, "--graph", "tests.test_trainer:graph"]) == 0
            assert "replay matched all" in capsys.readouterr().out
        if name == "truncated":  # a graph that now finishes before the limit: still compared with the truncation
            [d] = replay(_solver_only(), path, failed[0].id).divergences
            assert d.kind == "outcome_changed" and d.diff.splitlines()[-2:] == [f"-{failed[0].truncated}",
                                                                               "+finished"]


def _solver_only():
    """The solver of `tests._graphs.solver_verifier`, without the verifier."""
    from langchain_core.messages import SystemMessage

    from tests._graphs import QA

    llm = Unreachable()
    g = StateGraph(QA)
    g.add_node("solver", lambda s: {"answer": llm.invoke([SystemMessage("Solve it."),
                                                          HumanMessage(s["question"])]).content})
    g.add_edge(START, "solver")
    g.add_edge("solver", END)
    return g.compile()


def test_a_model_error_episode_whose_reward_failed_reproduces_the_model_error(tmp_path):
    """The same for a run the policy's output broke (rollout.model_error_reward null): the model error is
    reproduced (`ReplayResult.error`), and the reward's error is not taken for how the run ended."""
    from tests.test_replay_outcomes import parser_app

    class Env(FailingRewardEnv):
        def __init__(self):
            from drmas_graph.env import Task

            self.train = self.test = [Task(id="test-0", input={"question": "answer in JSON"})]

    cfg = small_config(tmp_path, rollout={"model_error_reward": None},
                       eval={"k": 1, "n_tasks": 1, "before_training": False})
    trainer = Trainer(parser_app, Env(), cfg, policies={"solve": scripted_policy(["not JSON"])}, train=False)
    try:
        evaluate(trainer, step=0)
    finally:
        trainer.close()
    path = tmp_path / "run" / "traces.db"
    with TraceStore(path, readonly=True) as store:
        [episode] = [store.load_episode(s.id) for s in store.episodes(failed=True)]
    assert episode.error.startswith("BadRewardError: ") and episode.model_error.startswith("turn 0 ")
    result = replay(parser_app, path, episode.id)
    assert result.divergences == [] and result.error == episode.model_error
    graph = "tests.test_replay_outcomes:parser_app"
    assert cli_main(["traces", "replay", str(path), episode.id, "--graph", graph]) == 0
