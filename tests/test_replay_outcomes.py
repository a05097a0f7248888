"""Replay that does not lie (issue 28): live values compare in the store's form, a truncated recording replays
whatever branch reaches the limit first, a changed structured-output request is a divergence, recorded errors
(include_raw parsing errors, model errors, a later run that raised) are reproduced, and the CLI builds
factories and never prints an app's traceback."""

import enum
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.output_parsers import JsonOutputParser
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, interrupt
from pydantic import BaseModel

from drmas_graph import TraceStore, instrument
from drmas_graph.cli import main as cli_main
from drmas_graph.errors import RolloutError
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import comparable, replay, replay_episode
from drmas_graph.types import Segment
from tests.test_instrument import Unreachable


def _one_node(fn, state=None, checkpointer=None):
    g = StateGraph(state or MessagesState)
    g.add_node("solve", fn)
    g.add_edge(START, "solve")
    g.add_edge("solve", END)
    return g.compile(checkpointer=checkpointer)


def _unfinished(app, *args, **kwargs):
    with pytest.raises(RolloutError) as info:
        app.rollout(*args, **kwargs)
    return info.value.episode


# --- rev4_n: values compare as the store keeps them ---------------------------------------------------------


class Level(enum.Enum):
    EASY = "easy"


class Tagged(TypedDict, total=False):
    question: str
    answer: str
    tags: set
    level: Level


def test_sets_and_enums_compare_as_the_store_keeps_them(tmp_path):
    llm = Unreachable()
    graph = _one_node(lambda s: {"answer": llm.invoke(s["question"]).content, "tags": {"math", "easy"},
                                 "level": Level.EASY}, Tagged)
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, {"solve": scripted_policy(["4"])}, store=store).rollout({"question": "2+2?"})
        stored = replay(graph, store, episode.id)
    assert stored.recorded.final_state["tags"] in (["math", "easy"], ["easy", "math"])  # what the store keeps
    assert stored.divergences == [] and stored.state_matches and stored.state_diff == ""
    assert replay_episode(graph, episode).state_matches  # a recording never stored compares in the same form
    assert comparable({"level": Level.EASY, "t": (1, {2})}) == {"level": "easy", "t": [1, [2]]}


def test_an_interrupt_value_holding_a_set_is_the_recorded_interrupt(tmp_path):
    llm = Unreachable()

    def approve(state):
        return {"messages": [HumanMessage(f"editor: {interrupt({'checks': {'tone'}})}")]}

    g = StateGraph(MessagesState)
    g.add_node("draft", lambda s: {"messages": [llm.invoke(s["messages"])]})
    g.add_node("approve", approve)
    g.add_edge(START, "draft")
    g.add_edge("draft", "approve")
    g.add_edge("approve", END)
    graph = g.compile(checkpointer=InMemorySaver())
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, {"draft": scripted_policy(["a draft"])}, store=store).rollout(
            {"messages": [HumanMessage("write")]}, {"configurable": {"thread_id": "t"}}, resume=lambda ep, its: "ok")
        result = replay(graph, store, episode.id)
    assert episode.segments[0].interrupts[0]["value"] == {"checks": {"tone"}}
    assert result.divergences == [] and not result.stopped and result.state_matches
    assert result.final_state["messages"][-1].content == "editor: ok"


# --- rev4_o: a truncated recording, whichever branch reaches the limit first ----------------------------------


class Notes(TypedDict, total=False):
    notes: list


def _two_branches(first, calls=("a", "b")):
    """Branches a and b in parallel; the branch `first[0]` calls its model before the other one does."""
    llm, done = Unreachable(), threading.Event()

    def branch(name):
        def node(state):
            if name != first[0]:
                assert done.wait(10)
            try:
                return {"notes": [llm.invoke(f"summarise {name}").content] if name in calls else []}
            finally:
                done.set()
        return node

    g = StateGraph(Notes)
    for name in ("a", "b"):
        g.add_node(name, branch(name))
        g.add_edge(START, name)
    g.add_edge(["a", "b"], END)
    return g.compile()


def test_a_truncated_recording_replays_whichever_branch_calls_first(tmp_path):
    first = ["a"]
    graph = _two_branches(first)
    with TraceStore(tmp_path / "t.db") as store:
        policy = scripted_policy(["done"])
        episode = _unfinished(instrument(graph, {"a": policy, "b": policy}, store=store), {"notes": []},
                              metadata={"max_llm_calls": 1})
    assert episode.truncated_by == "max_llm_calls" and [t.agent for t in episode.turns] == ["a"]
    first[0] = "b"  # b's call now comes first: the limit would have let it through, and refused a's
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.stopped and result.error is None
    assert [t.call_key for t in result.turns] == ["a"]


def test_a_call_refused_as_the_limits_is_a_divergence_if_the_recording_is_not_used_up():
    first = ["a"]
    policy = scripted_policy(["done"])
    episode = _unfinished(instrument(_two_branches(first), {"a": policy, "b": policy}), {"notes": []},
                          metadata={"max_llm_calls": 1})
    first[0] = "b"
    result = replay_episode(_two_branches(first, calls=("b",)), episode)  # a no longer calls: b's call is new
    [d] = result.divergences
    assert (d.kind, d.agent, d.call_key, d.call_index) == ("unrecorded_call", "b", "b", 0) and result.stopped
    assert "+[human] summarise b" in d.diff


# --- rev4_s: the structured output a call asks for --------------------------------------------------------


class Verdict(TypedDict, total=False):
    question: str
    verdict: dict


def _judge(response_format):
    llm = Unreachable().bind(response_format=response_format) if response_format else Unreachable()
    return _one_node(lambda s: {"verdict": json.loads(llm.invoke([HumanMessage(s["question"])]).content)}, Verdict)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _verdict_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}}


def test_a_changed_structured_output_request_is_a_divergence(tmp_path):
    app = instrument(_judge(_verdict_format(SCHEMA)), {"solve": scripted_policy(['{"ok": true}'])})
    episode = app.rollout({"question": "is 2+2=4?"})
    assert episode.turns[0].response_format == {"type": "json_schema", "name": "Verdict", "schema": SCHEMA}
    same = replay_episode(_judge(_verdict_format(json.loads(json.dumps(SCHEMA)))), episode)
    assert same.divergences == [] and same.state_matches
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "reason": {"type": "string"}},
              "required": ["ok", "reason"]}
    [d] = replay_episode(_judge(_verdict_format(schema)), episode).divergences
    assert (d.kind, d.agent, d.node, d.call_index) == ("format_changed", "solve", "solve", 0)
    [old] = [line for line in d.diff.splitlines() if line.startswith("-[response_format]")]
    [new] = [line for line in d.diff.splitlines() if line.startswith("+[response_format]")]
    assert '"reason"' in new and '"reason"' not in old and "+[human]" not in d.diff
    [d] = replay_episode(_judge(None), episode).divergences  # the app dropped the request: free text
    assert d.kind == "format_changed" and d.diff.splitlines()[-1].startswith("-[response_format]")



def test_a_changed_schema_of_concurrent_calls_is_format_changed_whatever_arrives_first():
    """Found by the property suite: two structured calls of one node, made concurrently; the replay's first
    call is the recording's second. The divergence is judged against the recorded call with the same prompt
    (format_changed), not against the recording's first call (was: prompt_changed with the other question)."""
    first_done = threading.Event()

    def two_questions(response_format, late):
        llm = Unreachable().bind(response_format=response_format)

        def ask(question):
            if question == late:
                first_done.wait(5)
            out = llm.invoke([HumanMessage(question)]).content
            if question != late:
                first_done.set()
            return out

        def solve(state):
            first_done.clear()
            with ThreadPoolExecutor(2) as pool:
                return {"verdict": {"answers": list(pool.map(ask, ["q1", "q2"]))}}

        return _one_node(solve, Verdict)

    app = instrument(two_questions(_verdict_format(SCHEMA), late="q2"), {"solve": scripted_policy(['{"ok": true}'])})
    episode = app.rollout({"question": "two"})
    assert [(t.messages[-1].content, t.node_call_index) for t in episode.turns] == [("q1", 0), ("q2", 1)]
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "reason": {"type": "string"}},
              "required": ["ok", "reason"]}
    d = replay_episode(two_questions(_verdict_format(schema), late="q1"), episode).divergences[0]
    assert (d.kind, d.call_index) == ("format_changed", 1) and "[human] q2" in d.diff and "q1" not in d.diff


# --- rev4_t and rev4_x: recorded errors are reproduced ----------------------------------------------------


class Ok(BaseModel):
    ok: bool


class Judged(TypedDict, total=False):
    question: str
    ok: bool


def _structured_judge(include_raw):
    llm = Unreachable().with_structured_output(Ok, include_raw=include_raw)

    def judge(state):
        out = llm.invoke([HumanMessage(state["question"])])
        parsed = out["parsed"] if include_raw else out
        return {"ok": parsed.ok if parsed is not None else False}

    return _one_node(judge, Judged)


def test_an_include_raw_parsing_error_replays_as_recorded(tmp_path):
    graph = _structured_judge(include_raw=True)
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(graph, {"solve": scripted_policy(["I think it is fine."])}, store=store).rollout(
            {"question": "is 2+2=4?"})
        result = replay(graph, store, episode.id)
    assert episode.outcome == "finished" and episode.turns[0].format_error
    assert result.divergences == [] and result.error is None and result.state_matches
    assert result.final_state == {"question": "is 2+2=4?", "ok": False}


def test_a_structured_output_model_error_is_reproduced(tmp_path):
    graph = _structured_judge(include_raw=False)
    episode = _unfinished(instrument(graph, {"solve": scripted_policy(["I think it is fine."])}),
                          {"question": "is 2+2=4?"})
    result = replay_episode(graph, episode)
    assert episode.outcome == "model_error" and result.error == episode.model_error
    assert result.error.startswith("turn 0 (agent 'solve', node 'solve'): InvalidReplyError: ")
    assert result.divergences == [] and not result.stopped and result.state_matches


def _parser_app(handles_errors):
    llm = Unreachable()

    def solve(state):
        try:
            return {"answer": (llm | JsonOutputParser()).invoke(state["question"])}
        except ValueError:
            if not handles_errors:
                raise
            return {"answer": {}}

    return _one_node(solve, TypedDict("S", {"question": str, "answer": dict}, total=False))


parser_app, forgiving_app = _parser_app(False), _parser_app(True)


def test_a_model_error_episode_is_reproduced_and_a_changed_outcome_diverges(tmp_path, capsys):
    with TraceStore(tmp_path / "t.db") as store:
        episode = _unfinished(instrument(parser_app, {"solve": scripted_policy(["not JSON"])}, store=store),
                              {"question": "answer in JSON"})
        finished = instrument(forgiving_app, {"solve": scripted_policy(["not JSON"])}, store=store).rollout(
            {"question": "answer in JSON"})
    path = str(tmp_path / "t.db")
    result = replay(parser_app, path, episode.id)
    assert result.error == episode.model_error and result.divergences == [] and result.state_matches
    assert result.error.startswith("turn 0 (agent 'solve', node 'solve'): OutputParserException: Invalid json")
    [d] = replay(forgiving_app, path, episode.id).divergences  # the app now handles the bad reply
    assert (d.kind, d.agent, d.call_key, d.call_index) == ("outcome_changed", "solve", "solve", 0)
    assert "-" + episode.model_error.splitlines()[0] in d.diff.splitlines() and d.diff.endswith("\n+finished")
    raised = replay(parser_app, path, finished.id)  # an error where the recording finished
    assert [d.kind for d in raised.divergences] == ["outcome_changed"] and raised.error.startswith("turn 0 ")

    graph = "tests.test_replay_outcomes:parser_app"
    assert cli_main(["traces", "replay", path, episode.id, "--graph", graph]) == 0
    out = capsys.readouterr().out
    assert "matched all 1 calls" in out and "raised the recorded error again: turn 0" in out
    assert cli_main(["traces", "replay", path, finished.id, "--graph", graph]) == 1
    captured = capsys.readouterr()
    assert "outcome_changed at agent 'solve'" in captured.out and "Traceback" not in captured.out + captured.err


# --- rev4_m: a multi-run episode whose last run raised ----------------------------------------------------


def _review(final_raises):
    llm = Unreachable()

    def final(state):
        first = llm.invoke(state["messages"])
        if final_raises:
            JsonOutputParser().invoke(first)
        second = llm.invoke(state["messages"] + [first])
        return {"messages": [first, second]}

    g = StateGraph(MessagesState)
    g.add_node("draft", lambda s: {"messages": [llm.invoke(s["messages"])]})
    g.add_node("approve", lambda s: {"messages": [HumanMessage(f"editor: {interrupt('approve?')}")]})
    g.add_node("final", final)
    g.add_edge(START, "draft")
    g.add_edge("draft", "approve")
    g.add_edge("approve", "final")
    g.add_edge("final", END)
    return g.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("stop", ["truncated", "model_error"])
def test_the_last_run_of_a_multi_run_episode_stops_where_the_recording_did(stop):
    graph = _review(final_raises=stop == "model_error")
    app = instrument(graph, {"draft": scripted_policy(["a draft"]), "final": scripted_policy(["a", "b"], name="f")})
    episode = _unfinished(app, {"messages": [HumanMessage("write")]}, {"configurable": {"thread_id": "t1"}},
                          resume=lambda ep, its: "shorter", metadata={"max_llm_calls": 2})
    assert episode.outcome == stop and [t.segment for t in episode.turns] == [0, 1]
    # both runs, as the recording side keeps them (rev4_m): the second resumed the interrupt and raised
    episode.segments = [episode.segments[0], Segment(kind="resume", input=Command(resume="shorter"))]
    result = replay_episode(graph, episode)
    assert result.divergences == [] and [t.segment for t in result.turns] == [0, 1]
    # the state as the second run left it, after its last completed superstep (`approve` answered; issue 58: it
    # was the first run's output, the state before the resume)
    assert result.state_matches and result.final_state["messages"][-1].content == "editor: shorter"
    assert episode.final_state["messages"][-1].content == "editor: shorter"
    assert (result.stopped, result.error) == ((True, None) if stop == "truncated" else (False, episode.model_error))


# --- rev4_r: the CLI builds a factory's graph --------------------------------------------------------------


def build_solver(llm):
    return _one_node(lambda s: {"answer": llm.invoke(s["question"]).content}, Tagged)


def build_needing(llm, rounds):
    return build_solver(llm)


def test_cli_replay_builds_a_factory_with_a_stand_in_model(tmp_path, capsys):
    with TraceStore(tmp_path / "t.db") as store:
        episode = instrument(build_solver(Unreachable()), {"solve": scripted_policy(["4"])}, store=store).rollout(
            {"question": "2+2?"})
    path = str(tmp_path / "t.db")
    assert cli_main(["traces", "replay", path, episode.id, "--graph", "tests.test_replay_outcomes:build_solver"]) == 0
    assert "reproduced the recorded final state" in capsys.readouterr().out
    assert cli_main(["traces", "replay", path, episode.id, "--graph", "tests.test_replay_outcomes:build_needing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tests.test_replay_outcomes:build_needing' cannot be called with ['llm']" in err


def test_a_one_run_episode_replayed_into_a_run_that_stops_at_an_interrupt_diverges():
    """Found by the property suite: an episode that ran once (no segments) replayed into an edited app whose
    node now calls interrupt() was reported as `missing_call` at the next call, never as the new interrupt."""
    llm = Unreachable()

    def draft(state):
        return {"draft": llm.invoke(f"draft about {state['topic']}").content}

    def asks_first(state):
        return {"draft": llm.invoke(f"revise per {interrupt({'draft': state['draft']})}").content}

    def write(state):
        return {"draft": llm.invoke(f"polish {state['draft']}").content}

    def build(write_node):
        g = StateGraph(dict)
        g.add_node("draft", draft)
        g.add_node("write", write_node)
        g.add_edge(START, "draft")
        g.add_edge("draft", "write")
        g.add_edge("write", END)
        return g.compile(checkpointer=InMemorySaver())

    policy = scripted_policy(["short draft", "polished"])
    episode = instrument(build(write), {"draft": policy, "write": policy}).rollout(
        {"topic": "cats"}, {"configurable": {"thread_id": "t"}})
    assert [t.node for t in episode.turns] == ["draft", "write"] and episode.segments == []
    result = replay_episode(build(asks_first), episode)
    first = result.divergences[0]
    assert (first.kind, first.node) == ("interrupt_changed", "write") and result.stopped
    assert '+write: {"draft": "short draft"}' in first.diff
    assert replay_episode(build(write), episode).divergences == []  # the unchanged app: no divergence
