"""Interrupts and conversations: an episode that is several runs of one thread (the environment answers
`interrupt()` and plays the user), in rollouts, training, evaluation, the trace store and replay."""

import asyncio
import operator
import re
import sqlite3
from typing import Annotated, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, Interrupt, interrupt

from drmas_graph import ConfigError, EpisodeInterruptedError, SamplingParams, TraceStore, instrument
from drmas_graph.testing import scripted_policy
from drmas_graph.traces.replay import comparable, replay, replay_episode
from drmas_graph.train.loop.trainer import train_graph
from graphs.support.env import SupportEnv
from graphs.support.graph import build_graph as support_graph
from tests import _graphs
from tests.test_instrument import Unreachable
from tests.test_trainer import small_config


def review_graph(llm, *, question="approve?"):
    """draft -> review (a human answers through interrupt()) -> final, as LangGraph's HITL docs build it."""

    def draft(state):
        return {"messages": [llm.invoke(state["messages"])]}

    def review(state):
        note = interrupt({"question": question, "draft": state["messages"][-1].content})
        return {"messages": [HumanMessage(f"reviewer: {note}")]}

    def final(state):
        return {"messages": [llm.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    for name, fn in (("draft", draft), ("review", review), ("final", final)):
        g.add_node(name, fn)
    g.add_edge(START, "draft")
    g.add_edge("draft", "review")
    g.add_edge("review", "final")
    g.add_edge("final", END)
    return g.compile(checkpointer=InMemorySaver())


def thread(name):
    return {"configurable": {"thread_id": name}}


def test_rollout_resumes_interrupts_on_the_same_thread():
    graph = review_graph(Unreachable())
    seen = []

    def resume(episode, interrupts):
        seen.append(([t.agent for t in episode.turns], episode.final_state["__interrupt__"] == interrupts,
                     [i.value["question"] for i in interrupts]))
        return "shorter please"

    app = instrument(graph, {"draft": scripted_policy(["a long draft"], name="d"),
                             "final": scripted_policy(["short"], name="f")}, strict=True)
    episode = app.rollout({"messages": [HumanMessage("write a haiku")]}, thread("t1"), resume=resume)
    assert seen == [(["draft"], True, ["approve?"])]  # the hook saw the paused run
    assert [(t.agent, t.segment, t.index, t.call_key, t.node_call_index) for t in episode.turns] == [
        ("draft", 0, 0, "draft", 0), ("final", 1, 1, "final", 0)]
    assert episode.turns[1].messages[-1].content == "reviewer: shorter please"
    assert [m.content for m in episode.final_state["messages"]] == [
        "write a haiku", "a long draft", "reviewer: shorter please", "short"]
    assert [(s.kind, s.input) for s in episode.segments] == [("start", None), ("resume", Command(resume="shorter please"))]
    assert [[(r["node"], r["value"]["question"]) for r in s.interrupts] for s in episode.segments] == [
        [("review", "approve?")], []]
    assert graph.get_state(thread("t1")).next == () and episode.error is None


class Two(TypedDict, total=False):
    notes: Annotated[list, operator.add]


def test_parallel_interrupts_are_answered_by_id_and_a_subgraph_interrupt_names_its_node():
    llm = Unreachable()

    def branch(name):
        def node(state):
            answer = interrupt(f"{name}?")
            return {"notes": [llm.invoke([HumanMessage(f"{name} got {answer}")]).content]}
        return node

    g = StateGraph(Two)
    g.add_node("a", branch("a"))
    g.add_node("b", branch("b"))
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge(["a", "b"], END)
    graph = g.compile(checkpointer=InMemorySaver())
    app = instrument(graph, {"a": scripted_policy(["A"], name="a"), "b": scripted_policy(["B"], name="b")}, strict=True)
    episode = app.rollout({"notes": []}, thread("p"), resume=lambda ep, its: {i.id: i.value.upper() for i in its})
    assert sorted(t.messages[-1].content for t in episode.turns) == ["a got A?", "b got B?"]
    assert sorted(r["node"] for r in episode.segments[0].interrupts) == ["a", "b"]

    outer = StateGraph(Two)
    outer.add_node("sub", graph.builder.compile())  # the same graph as a subgraph node
    outer.add_edge(START, "sub")
    outer.add_edge("sub", END)
    app = instrument(outer.compile(checkpointer=InMemorySaver()), {"sub/a": scripted_policy(["x"])})
    with pytest.raises(EpisodeInterruptedError, match=r"interrupted at node 'sub/a' \(value 'a\?'\), node 'sub/b'"):
        app.rollout({"notes": []}, thread("s"))


def loop_graph(llm):
    """Asks a human after every answer, forever (an app that needs a bound)."""

    def answer(state):
        return {"messages": [llm.invoke(state["messages"])]}

    def ask(state):
        return {"messages": [HumanMessage(interrupt("more?"))]}

    g = StateGraph(MessagesState)
    g.add_node("answer", answer)
    g.add_node("ask", ask)
    g.add_edge(START, "answer")
    g.add_edge("answer", "ask")
    g.add_edge("ask", "answer")
    return g.compile(checkpointer=InMemorySaver())


def test_an_episode_left_paused_fails_with_its_reason_and_is_stored(tmp_path):
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(review_graph(Unreachable()), {"draft": scripted_policy(["d"])}, store=store)
        with pytest.raises(EpisodeInterruptedError, match="interrupted at node 'review'.*nothing answers") as info:
            app.rollout({"messages": [HumanMessage("hi")]}, thread("a"))
        with pytest.raises(EpisodeInterruptedError, match=r"resume\(\) returned None"):
            app.rollout({"messages": [HumanMessage("hi")]}, thread("b"), resume=lambda ep, its: None)
        looping = instrument(loop_graph(Unreachable()), {"answer": scripted_policy(["a"])}, store=store)
        with pytest.raises(EpisodeInterruptedError, match=r"after 2 resume\(s\)/input\(s\).*rollout.max_resumes=2"
                           ) as bound:
            looping.rollout({"messages": [HumanMessage("hi")]}, thread("c"), resume=lambda ep, its: "go on",
                            max_resumes=2)
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        paused = store.load_episode(info.value.episode.id)
        capped = store.load_episode(bound.value.episode.id)
    assert paused.error.startswith("EpisodeInterruptedError: ") and "interrupted at node 'review'" in paused.error
    assert [t.agent for t in paused.turns] == ["draft"] and len(paused.segments) == 1
    assert paused.final_state["__interrupt__"][0]["value"] == {"question": "approve?", "draft": "d"}
    assert [(s.kind, len(s.interrupts)) for s in capped.segments] == [("start", 1), ("resume", 1), ("resume", 1)]
    assert [(t.agent, t.segment) for t in capped.turns] == [("answer", 0), ("answer", 1), ("answer", 2)]


def customer(prompt: str) -> str:
    """The support agent, scripted: it asks for the refund the customer wants, then reports the decision."""
    last = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
    if last.startswith("[supervisor]"):
        return "Your refund is " + last.split()[-1] + "."
    amount = re.search(r"\$(\d+)", prompt)
    return f"REFUND {amount.group(1)}" if "refund" in last.lower() and amount else "Happy to help."


def sqlite_saver(tmp_path):
    sqlite = pytest.importorskip("langgraph.checkpoint.sqlite")
    return sqlite.SqliteSaver(sqlite3.connect(tmp_path / "checkpoints.db", check_same_thread=False))


@pytest.mark.parametrize("saver", ["memory", "sqlite"])
def test_a_conversation_is_one_episode_and_replays_run_by_run(tmp_path, saver):
    env = SupportEnv()
    task = env.tasks("train")[0]  # broken order, $30: customer, customer asks refund, supervisor, customer
    graph = support_graph(Unreachable(), checkpointer=InMemorySaver() if saver == "memory" else sqlite_saver(tmp_path))
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, {"agent": scripted_policy(customer)}, strict=True, store=store)
        episode = app.rollout(task.input, thread("c1"), task_id=task.id, metadata={"seed": 7},
                              resume=lambda ep, its: env.resume(task, ep, its),
                              next_input=lambda ep: env.next_input(task, ep))
    assert [(t.segment, t.response_text) for t in episode.turns] == [
        (0, "Happy to help."), (1, "REFUND 30"), (2, "Your refund is approved."), (3, "Happy to help.")]
    assert [s.kind for s in episode.segments] == ["start", "input", "resume", "input"]
    assert [t.node_call_index for t in episode.turns] == [0, 1, 2, 3]  # one node instance, counted across runs
    assert len({t.sampling.seed for t in episode.turns}) == 4  # so every run's call samples with its own seed
    assert [m.content for m in episode.turns[3].messages[1:]] == [  # the agent sees the whole conversation
        "My order #12 arrived broken. I paid $30.", "Happy to help.", "Can you refund it?", "REFUND 30",
        "[supervisor] refund of $30 approved", "Your refund is approved.", "Thanks, bye."]
    assert env.reward(task, episode) == 1.0 and episode.final_state["refunds"] == [{"amount": 30, "approved": True}]
    with TraceStore(tmp_path / "t.db", readonly=True) as store:
        stored = store.load_episode(episode.id)
    assert stored.segments == episode.segments and [t.segment for t in stored.turns] == [0, 1, 2, 3]
    result = replay(graph, tmp_path / "t.db", episode.id)
    assert result.divergences == [] and result.state_matches and result.unreproducible is None
    assert [t.response_text for t in result.turns] == [t.response_text for t in episode.turns]


def test_the_user_simulator_s_own_llm_is_not_an_agent_of_the_episode():
    simulator = FakeListChatModel(responses=["second message", "third message"])
    graph = support_graph(Unreachable(), checkpointer=InMemorySaver())

    def next_input(episode):
        if len(episode.turns) == 3:
            return None
        return {"messages": [HumanMessage(simulator.invoke("play the customer").content)]}

    app = instrument(graph, {"agent": scripted_policy(["ok"])}, strict=True)  # strict: no unserved call passes
    episode = app.rollout({"messages": [HumanMessage("first message")]}, thread("u"), next_input=next_input)
    assert [t.agent for t in episode.turns] == ["agent"] * 3
    assert [m.content for m in episode.final_state["messages"] if m.type == "human"] == [
        "first message", "second message", "third message"]


def test_async_rollout_takes_async_hooks_and_a_conversation_needs_a_checkpointer():
    graph = review_graph(Unreachable())

    async def resume(episode, interrupts):
        await asyncio.sleep(0)
        return "ok"

    app = instrument(graph, {"draft": scripted_policy(["d"], name="d"), "final": scripted_policy(["f"], name="f")})
    episode = asyncio.run(app.arollout({"messages": [HumanMessage("hi")]}, thread("x"), resume=resume))
    assert [(t.agent, t.segment) for t in episode.turns] == [("draft", 0), ("final", 1)]
    no_saver = review_graph(Unreachable()).builder.compile()
    with pytest.raises(ConfigError, match="next_input continues a conversation.*needs a checkpointer"):
        instrument(no_saver, {"draft": scripted_policy(["d"])}).rollout(
            {"messages": [HumanMessage("hi")]}, next_input=lambda ep: None)


class SilentSupervisor(SupportEnv):
    """Nobody answers refund requests: those conversations stay paused."""

    resume = None


def test_training_runs_whole_conversations_and_counts_paused_ones_as_failed(tmp_path):
    policy = scripted_policy(customer, sampling=SamplingParams(max_new_tokens=16))
    graph = support_graph(Unreachable(), checkpointer=InMemorySaver())
    cfg = small_config(tmp_path / "answered", steps=1, tasks_per_step=4, group_size=1,
                       eval={"k": 1, "before_training": False})
    result = train_graph(graph, SupportEnv(), cfg, policies={"agent": policy})
    record = result.history[0]
    assert (record["episodes"], record["failed_episodes"], record["interrupted_episodes"]) == (4, 0, 0)
    assert record["reward/team_mean"] == 1.0 and record["agent/agent/calls"] == 4 + 3 + 4 + 2
    with TraceStore(tmp_path / "answered" / "run" / "traces.db", readonly=True) as store:
        trained = [store.load_episode(s.id) for s in store.episodes(step=0)]
    assert sorted(len(ep.segments) for ep in trained) == [2, 3, 4, 4]
    assert all([t.index for t in ep.turns] == list(range(len(ep.turns))) for ep in trained)

    cfg = small_config(tmp_path / "silent", steps=1, tasks_per_step=4, group_size=1,
                       eval={"k": 1, "before_training": False})
    result = train_graph(graph, SilentSupervisor(), cfg, policies={"agent": policy})
    record, evaluation = result.history[0], result.evals[-1]
    assert (record["episodes"], record["failed_episodes"], record["interrupted_episodes"]) == (2, 2, 2)
    assert evaluation["failed_episodes"] == 2 and evaluation["avg@k"] == 0.5
    with TraceStore(tmp_path / "silent" / "run" / "traces.db", readonly=True) as store:
        errors = sorted(s.error for s in store.episodes() if s.error)
    assert len(errors) == 4 and all("interrupted at node 'approve' (value {'refund': " in e for e in errors)


def test_replay_of_a_paused_episode_matches_and_a_changed_interrupt_diverges(tmp_path):
    graph = review_graph(Unreachable())
    with TraceStore(tmp_path / "t.db") as store:
        app = instrument(graph, {"draft": scripted_policy(["d"], name="d"), "final": scripted_policy(["f"], name="f")}, store=store)
        with pytest.raises(EpisodeInterruptedError) as info:
            app.rollout({"messages": [HumanMessage("hi")]}, thread("a"))
        resumed = app.rollout({"messages": [HumanMessage("hi")]}, thread("b"),
                              resume=lambda ep, its: {its[0].id: "fine"})  # a resume map keyed by interrupt id
    paused = replay(graph, tmp_path / "t.db", info.value.episode.id)
    assert paused.divergences == [] and paused.state_matches  # the stored Interrupt is a dict with another id
    again = replay(graph, tmp_path / "t.db", resumed.id)  # the id map is translated to the new thread's ids
    assert again.divergences == [] and again.state_matches and [t.segment for t in again.turns] == [0, 1]
    changed = replay_episode(review_graph(Unreachable(), question="publish?"), resumed)
    assert [(d.kind, d.node, d.call_index) for d in changed.divergences] == [("interrupt_changed", "review", 0)]
    assert changed.stopped and "-review: " in changed.divergences[0].diff and "publish?" in changed.divergences[0].diff


def test_states_compare_interrupts_by_value():
    live = {"messages": [], "__interrupt__": [Interrupt(value={"q": "approve?"}, id="abc")]}
    stored = {"messages": [], "__interrupt__": [{"value": {"q": "approve?"}, "id": "xyz", "response_schema": None}]}
    assert comparable(live) == comparable(stored)
    assert comparable(live) != comparable({"messages": [], "__interrupt__": [{"value": {"q": "other"}, "id": "xyz"}]})


def test_ordinary_runs_record_no_segments_and_a_static_breakpoint_is_answered_like_an_interrupt(policy):
    app = instrument(support_graph(Unreachable(), checkpointer=InMemorySaver()), {"agent": policy})
    episode = app.rollout({"messages": [HumanMessage("hello")]}, thread("o"))
    assert episode.segments == [] and [t.segment for t in episode.turns] == [0]

    graph = _graphs.solver_verifier(Unreachable()).compile(checkpointer=InMemorySaver(), interrupt_before=["verifier"])
    app = instrument(graph, {"solver": policy, "verifier": policy})
    with pytest.raises(EpisodeInterruptedError, match="interrupted at a breakpoint before node 'verifier'"):
        app.rollout({"question": "1+1?"}, thread("b1"))
    asked = []
    episode = app.rollout({"question": "1+1?"}, thread("b2"), resume=lambda ep, its: asked.append(its) or "go on")
    assert asked == [[]] and [(t.agent, t.segment) for t in episode.turns] == [("solver", 0), ("verifier", 1)]
    assert episode.segments[0].interrupts == ({"node": "verifier", "id": None, "value": None},)
