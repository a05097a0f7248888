"""Replay: a recorded episode re-runs offline with every LLM call answered from the recording."""

import pytest
from langchain_core.messages import HumanMessage

from drmas_graph import instrument
from drmas_graph.cli import main as cli_main
from drmas_graph.errors import ConfigError
from drmas_graph.traces.replay import replay, replay_episode
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import scripted_policy, tiny_policy
from tests import _graphs
from tests.test_instrument import Unreachable


def record(graph, policies, inputs, path, **kwargs):
    with TraceStore(path) as store:
        app = instrument(graph, policies, store=store, **kwargs)
        return [app.rollout(x) for x in inputs]


@pytest.mark.parametrize("name", ["sequential", "parallel", "send", "subgraph"])
def test_replay_reproduces_the_final_state(name, tmp_path, policy):
    llm = Unreachable()
    graph, policies, x = {
        "sequential": (_graphs.solver_verifier(llm).compile(), {"solver": policy, "verifier": policy},
                       {"question": "2+3?"}),
        "parallel": (_graphs.parallel_branches(llm), {"left": policy, "right": policy, "join": policy},
                     {"question": "q", "notes": []}),
        "send": (_graphs.send_fanout(llm, n=4), {"worker": policy}, {"question": "q", "notes": []}),
        "subgraph": (_graphs.with_subgraph(llm), {"plan": policy, "research/search_llm": policy, "judge": policy},
                     {"question": "who?", "notes": []}),
    }[name]
    agents = {"grade": "judge"} if name == "subgraph" else None
    [episode] = record(graph, policies, [x], tmp_path / "run.db", agents=agents)
    result = replay(graph, tmp_path / "run.db", episode.id)  # no policy, no model: answers come from the file
    assert result.divergences == [] and not result.stopped
    assert result.state_matches
    assert result.final_state == episode.final_state
    assert sorted((t.call_key, t.node_call_index, t.response_ids) for t in result.turns) == sorted(
        (t.call_key, t.node_call_index, t.response_ids) for t in episode.turns)
    assert llm.calls == 0


def test_replay_of_a_tool_calling_agent_reproduces_messages(tmp_path, monkeypatch):
    graph = _graphs.react_agent(Unreachable())
    policy = scripted_policy(['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."])
    [episode] = record(graph, {"agent": policy}, [{"messages": [HumanMessage("2 + 3?")]}], tmp_path / "r.db")
    result = replay(graph, tmp_path / "r.db", episode.id)
    assert result.divergences == [] and result.state_matches
    new, old = result.final_state["messages"], episode.final_state["messages"]
    assert [m.content for m in new] == [m.content for m in old] == ["2 + 3?", "", "5", "It is 5."]
    assert new[1].tool_calls == old[1].tool_calls and new[1].id == old[1].id  # same tool-call and message ids


def test_edited_prompt_is_reported_with_a_diff_and_replay_stops(tmp_path, policy):
    original = _graphs.solver_verifier(Unreachable()).compile()
    [episode] = record(original, {"solver": policy, "verifier": policy}, [{"question": "2+3?"}], tmp_path / "r.db")
    edited = _graphs.solver_verifier(Unreachable(), verifier_system="Check it very carefully.").compile()
    result = replay(edited, tmp_path / "r.db", episode.id)
    # the state as replay stopped it: after the solver's superstep (issue 58: None before)
    assert result.stopped and result.final_state == {"question": "2+3?", "answer": episode.final_state["answer"]}
    [d] = result.divergences
    assert (d.kind, d.agent, d.node, d.call_key, d.call_index) == ("prompt_changed", "verifier", "verifier",
                                                                   "verifier", 0)
    assert "-[system] Check it." in d.diff and "+[system] Check it very carefully." in d.diff
    assert [t.agent for t in result.turns] == ["solver"]


def test_after_a_divergence_replay_can_continue_live(tmp_path, policy):
    original = _graphs.solver_verifier(Unreachable()).compile()
    [episode] = record(original, {"solver": policy, "verifier": policy}, [{"question": "2+3?"}], tmp_path / "r.db")
    edited = _graphs.solver_verifier(Unreachable(), verifier_system="Be strict.").compile()
    live = tiny_policy(seed=7)
    result = replay(edited, tmp_path / "r.db", episode.id, policies={"verifier": live}, on_divergence="continue")
    assert not result.stopped and [d.kind for d in result.divergences] == ["prompt_changed"]
    solver, verifier = result.turns
    assert solver == episode.turns[0]  # answered from the recording
    assert verifier.policy == live.name and verifier.messages[0].content == "Be strict."
    assert result.final_state["answer"] == episode.final_state["answer"]
    assert result.final_state["verdict"] == verifier.response_text.strip()
    with pytest.raises(ConfigError, match="needs policies"):
        replay_episode(edited, episode, on_divergence="continue")


def test_added_and_removed_calls_are_divergences(policy, tmp_path):
    graph = _graphs.send_fanout(Unreachable(), n=3)
    [episode] = record(graph, {"worker": policy}, [{"question": "q", "notes": []}], tmp_path / "r.db")
    more = replay_episode(_graphs.send_fanout(Unreachable(), n=4), episode)
    assert [(d.kind, d.call_key) for d in more.divergences] == [("unrecorded_call", "worker[3]")]
    fewer = replay_episode(_graphs.send_fanout(Unreachable(), n=2), episode)
    assert not fewer.stopped and [(d.kind, d.call_key) for d in fewer.divergences] == [("missing_call", "worker[2]")]


def test_cli_replay(tmp_path, policy, capsys, monkeypatch):
    graph = _graphs.solver_verifier(Unreachable()).compile()
    [episode] = record(graph, {"solver": policy, "verifier": policy}, [{"question": "2+3?"}], tmp_path / "r.db")
    module = tmp_path / "my_app.py"
    module.write_text("from tests import _graphs\nfrom tests.test_instrument import Unreachable\n"
                      "graph = _graphs.solver_verifier(Unreachable()).compile()\n"
                      "edited = _graphs.solver_verifier(Unreachable(), verifier_system='Other.').compile()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["traces", "replay", str(tmp_path / "r.db"), episode.id, "--graph", "my_app:graph"]) == 0
    out = capsys.readouterr().out
    assert "matched all 2 calls and reproduced the recorded final state" in out
    assert cli_main(["traces", "replay", str(tmp_path / "r.db"), episode.id, "--graph", "my_app:edited"]) == 1
    out = capsys.readouterr().out
    assert "1 divergence(s)" in out and "prompt_changed at agent 'verifier'" in out and "+[system] Other." in out
    assert cli_main(["traces", "replay", str(tmp_path / "r.db"), "nope", "--graph", "my_app:graph"]) == 2
    assert "nope" in capsys.readouterr().err
