"""with_structured_output and forced tool_choice: the request is in the prompt the policy sees, the node gets
what LangChain's parsers expect, the Turn records the request, and a reply that does not satisfy it fails
with an error naming the agent and node (issue 9 item 5, rev_so)."""

import json
from typing import TypedDict

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from drmas_graph import RolloutError, TraceStore, instrument
from drmas_graph.errors import StructuredOutputError
from drmas_graph.testing import scripted_policy
from tests.test_instrument import Unreachable


class Verdict(BaseModel):
    ok: bool


class S(TypedDict, total=False):
    q: str
    v: object


def judge_graph(make_runnable):
    def judge(state):
        return {"v": make_runnable().invoke([HumanMessage(state["q"])])}

    g = StateGraph(S)
    g.add_node("judge", judge)
    g.add_edge(START, "judge")
    g.add_edge("judge", END)
    return g.compile()


@pytest.fixture
def openai_llm(monkeypatch):
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    return ChatOpenAI(model="gpt-4o-mini", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)


def prompt_text(policy, turn):
    assert list(turn.prompt_ids) == policy.render(turn.messages, turn.tools, turn.response_format)
    return policy.tokenizer.decode(list(turn.prompt_ids))


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_chatopenai_structured_output_methods(openai_llm, method):
    """rev_so: json_schema used to fail ('no parsed field'), function_calling returned None."""
    policy = scripted_policy(['{"ok": true}'])
    app = instrument(judge_graph(lambda: openai_llm.with_structured_output(Verdict, method=method)),
                     {"judge": policy})
    episode = app.rollout({"q": "is 2+2=4?"})
    turn = episode.turns[0]
    assert episode.final_state["v"] == Verdict(ok=True)
    text = prompt_text(policy, turn)
    if method == "json_mode":
        assert turn.response_format == {"type": "json_object"} and "Reply with only a JSON object" in text
    else:
        kind = "json_schema" if method == "json_schema" else "tool"
        assert turn.response_format["type"] == kind and turn.response_format["name"] == "Verdict"
        assert turn.response_format["schema"]["properties"]["ok"]["type"] == "boolean"
        assert json.dumps(turn.response_format["schema"], sort_keys=True) in text  # the schema the model saw
    if method == "function_calling":
        assert [(c["name"], c["args"]) for c in turn.tool_calls] == [("Verdict", {"ok": True})]
        assert turn.finish_reason == "tool_calls"
    policy.close()


def test_base_chat_model_structured_output_and_forced_tool_choice():
    """BaseChatModel.with_structured_output binds tool_choice='any'; bind_tools(tool_choice=name) forces one
    tool. A reply in the policy's own tool-call format is accepted too."""

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    policy = scripted_policy(['{"ok": false}', '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'])
    model = Unreachable()
    app = instrument(judge_graph(lambda: model.with_structured_output(Verdict)), {"judge": policy})
    assert app.rollout({"q": "q"}).final_state["v"] == Verdict(ok=False)
    app = instrument(judge_graph(lambda: model.bind_tools([add, Verdict], tool_choice="add")), {"judge": policy})
    episode = app.rollout({"q": "q"})
    assert [(c["name"], c["args"]) for c in episode.final_state["v"].tool_calls] == [("add", {"a": 2, "b": 3})]
    assert episode.turns[0].response_format["type"] == "tool" and episode.turns[0].response_format["name"] == "add"
    assert model.calls == 0


def test_a_reply_that_ignores_the_request_fails_naming_agent_and_node(openai_llm):
    policy = scripted_policy(["I think it is fine."])
    app = instrument(judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="function_calling")),
                     {"judge": policy})
    with pytest.raises(RolloutError) as info:
        app.rollout({"q": "q"})
    error = info.value.__cause__
    assert isinstance(error, StructuredOutputError)
    assert "agent 'judge' (node 'judge')" in str(error) and "'Verdict'" in str(error)
    turn, = info.value.episode.turns  # the reply is recorded (a training sample the reward can penalise)
    assert turn.trainable and turn.response_text.strip() == "I think it is fine." and turn.tool_calls == ()
    app = instrument(judge_graph(lambda: openai_llm.bind_tools([Verdict], tool_choice="nope")), {"judge": policy})
    with pytest.raises(RolloutError, match="not bound") as info:  # ChatOpenAI passes unknown names through
        app.rollout({"q": "q"})


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_include_raw_returns_the_parsing_error_instead_of_raising(openai_llm, method):
    """issue 16: with include_raw=True LangChain returns {raw, parsed, parsing_error}; a reply that is not the
    JSON asked for used to raise StructuredOutputError out of the model call instead."""
    policy = scripted_policy(["I think it is fine.", '{"ok": true}'])
    app = instrument(judge_graph(lambda: openai_llm.with_structured_output(Verdict, method=method, include_raw=True)),
                     {"judge": policy})
    bad, good = app.rollout({"q": "q"}), app.rollout({"q": "q"})
    out = bad.final_state["v"]
    assert out["parsed"] is None and isinstance(out["parsing_error"], Exception)
    assert out["raw"].content == "I think it is fine."
    assert "not one: 'I think it is fine.'" in bad.turns[0].format_error  # recorded: training penalises it
    assert good.final_state["v"]["parsed"] in (Verdict(ok=True), {"ok": True})
    assert good.final_state["v"]["parsing_error"] is None and good.turns[0].format_error is None
    from drmas_graph import PolicyChatModel  # outside instrumented runs: BaseChatModel's forced-tool form

    model = PolicyChatModel(policy=scripted_policy(["not a tool call"]))
    out = model.with_structured_output(Verdict, include_raw=True).invoke("is 2+2=4?")
    assert out["parsed"] is None and out["raw"].content == "not a tool call"  # LangChain: no call, no error


def test_response_format_round_trips_through_the_trace_store(openai_llm, tmp_path):
    policy = scripted_policy(['{"ok": true}'])
    store = TraceStore(tmp_path / "t.db")
    app = instrument(judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema")),
                     {"judge": policy}, store=store)
    episode = app.rollout({"q": "q"})
    loaded = store.load_episode(episode.id)
    assert loaded.turns[0].response_format == episode.turns[0].response_format
    assert loaded.turns[0].response_format["name"] == "Verdict"
    assert policy.render(loaded.turns[0].messages, loaded.turns[0].tools,
                         loaded.turns[0].response_format) == list(episode.turns[0].prompt_ids)
    store.close()


def test_policy_chat_model_honours_structured_output_outside_runs():
    """A trained checkpoint run as a plain chat model (no instrumented run) answers structured requests too."""
    from drmas_graph import PolicyChatModel

    policy = scripted_policy(['{"ok": true}', "not json"])
    model = PolicyChatModel(policy=policy)
    assert model.with_structured_output(Verdict).invoke("is 2+2=4?") == Verdict(ok=True)
    with pytest.raises(StructuredOutputError, match=r"PolicyChatModel\(policy 'scripted-s0'\).*'Verdict'"):
        model.with_structured_output(Verdict).invoke("again?")
    policy.close()


def test_replay_returns_the_recorded_structured_answer(openai_llm):
    from drmas_graph.traces.replay import replay_episode

    policy = scripted_policy(['{"ok": true}'])
    graph = judge_graph(lambda: openai_llm.with_structured_output(Verdict, method="json_schema"))
    episode = instrument(graph, {"judge": policy}).rollout({"q": "q"})
    result = replay_episode(graph, episode)
    assert not result.divergences and result.final_state["v"] == Verdict(ok=True)


def test_output_spec_reads_each_providers_form_and_names_what_it_cannot_honour():
    from drmas_graph._structured import output_spec

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}]
    where = "agent 'a' (node 'n')"
    tool = {"type": "tool", "name": "add", "schema": {"type": "object"}}
    assert output_spec({"tool_choice": {"type": "function", "function": {"name": "add"}}}, tools, where)[0] == tool
    assert output_spec({"tool_choice": {"type": "tool", "name": "add"}}, tools, where)[0] == tool  # Anthropic
    assert output_spec({"tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": [
        "add"]}}}, tools, where)[0] == tool  # Google
    assert output_spec({"tool_choice": "required"}, tools, where)[0] == {"type": "any_tool", "names": ["add", "mul"]}
    assert output_spec({"tool_choice": "auto", "response_format": {"type": "text"}}, tools, where) == (None, None)
    assert output_spec({"format": "json"}, [], where)[0] == {"type": "json_object"}  # Ollama
    assert output_spec({"response_format": Verdict}, [], where)[1] is Verdict
    with pytest.raises(StructuredOutputError, match=r"agent 'a' \(node 'n'\).*response_schema"):
        output_spec({"response_schema": {"type": "object"}}, [], where)
    with pytest.raises(StructuredOutputError, match="no tool is bound"):
        output_spec({"tool_choice": "any"}, [], where)
