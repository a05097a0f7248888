"""Replay identifies every call by a key that is stable across runs, stops for good at a divergence, compares
states up to generated ids, runs async-only graphs, and starts from the thread checkpoint a rollout continued."""

import asyncio
import operator
import random
import time
import uuid
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Send

import drmas_graph
from drmas_graph import instrument
from drmas_graph.errors import ConfigError
from drmas_graph.instrumentation._segments import EpisodeInterruptedError
from drmas_graph.traces.replay import areplay, areplay_episode, comparable, replay, replay_episode
from drmas_graph.traces.store import TraceStore
from drmas_graph.testing import scripted_policy
from tests import _graphs
from tests.test_instrument import Unreachable


class Fan(TypedDict, total=False):
    question: Annotated[str, lambda a, b: b]
    item: Annotated[int, lambda a, b: b]
    sub: Annotated[int, lambda a, b: b]
    notes: Annotated[list, operator.add]


def _jitter():
    time.sleep(random.random() * 0.01)  # tool latency: Send tasks finish in a different order every run


def send_into_subgraph(llm, n=4, inner=0):
    """Send i -> subgraph 'research' (node 'search'); with inner > 0, 'research' itself Sends to 'leaf'."""

    def search(state):
        _jitter()
        return {"notes": [(state["item"], llm.invoke([HumanMessage(f"search item {state['item']}")]).content)]}

    def leaf(state):
        _jitter()
        text = f"leaf {state['item']}.{state['sub']}"
        return {"notes": [(state["item"], state["sub"], llm.invoke([HumanMessage(text)]).content)]}

    sub = StateGraph(Fan)
    if inner:
        sub.add_node("leaf", leaf)
        sub.add_conditional_edges(START, lambda s: [Send("leaf", {"item": s["item"], "sub": j}) for j in range(inner)],
                                  ["leaf"])
        sub.add_edge("leaf", END)
    else:
        sub.add_node("search", search)
        sub.add_edge(START, "search")
        sub.add_edge("search", END)
    g = StateGraph(Fan)
    g.add_node("research", sub.compile())
    g.add_conditional_edges(START, lambda s: [Send("research", {"item": i, "question": s["question"]})
                                             for i in range(n)], ["research"])
    g.add_edge("research", END)
    return g.compile()


def echo_policy(seed=0, name="echo"):
    """Replies 're <last user message>', so every call's answer names the call it answers."""
    return scripted_policy(lambda prompt: "re " + prompt.rsplit("user\n", 1)[-1].split("<|im_end|>")[0], seed=seed,
                           name=name)


# -- call_key carries every ancestor's Send index (repros rev_r.py, rev_r2.py, rev_r3.py) ----------------


def test_send_into_a_subgraph_replays_every_time():
    graph = send_into_subgraph(Unreachable())
    episode = instrument(graph, {"research/search": echo_policy()}).rollout({"question": "q"})
    assert sorted((t.call_key, t.node_call_index) for t in episode.turns) == [
        (f"research[{i}]/search", 0) for i in range(4)]
    for turn in episode.turns:  # each key names the Send instance whose prompt it recorded
        assert turn.messages[-1].content == f"search item {turn.call_key[9]}"
        assert turn.response_text.startswith(f"re search item {turn.call_key[9]}")
    outcomes = [replay_episode(graph, episode) for _ in range(12)]
    assert [r.divergences for r in outcomes] == [[]] * 12
    assert all(r.state_matches and not r.stopped for r in outcomes)


def test_nested_sends_carry_the_index_of_every_enclosing_task():
    graph = send_into_subgraph(Unreachable(), n=3, inner=2)
    episode = instrument(graph, {"research/leaf": echo_policy()}).rollout({"question": "q"})
    assert sorted(t.call_key for t in episode.turns) == [f"research[{i}]/leaf[{j}]" for i in range(3) for j in range(2)]
    for turn in episode.turns:
        i, j = turn.call_key[9], turn.call_key[-2]
        assert turn.messages[-1].content == f"leaf {i}.{j}"
    for _ in range(6):
        result = replay_episode(graph, episode)
        assert result.divergences == [] and result.state_matches


def test_send_to_a_plain_node_keeps_its_index():
    graph = _graphs.send_fanout(Unreachable(), n=4)
    episode = instrument(graph, {"worker": echo_policy()}).rollout({"question": "q", "notes": []})
    assert sorted(t.call_key for t in episode.turns) == [f"worker[{i}]" for i in range(4)]


# -- stop mode: after a divergence no call is answered or goes live ---------------------------------------


def test_after_a_divergence_in_stop_mode_every_later_call_stops():
    llm = Unreachable()
    recorded = instrument(_graphs.send_fanout(llm, n=4), {"worker": echo_policy()}).rollout(
        {"question": "q", "notes": []})

    def worker(state):  # edited prompt; the app catches its model's errors and carries on
        try:
            return {"notes": [llm.invoke([HumanMessage(f"ITEM {state['item']}")]).content]}
        except Exception:
            return {"notes": ["fallback"]}

    g = StateGraph(Fan)
    g.add_node("worker", worker)
    g.add_conditional_edges(START, lambda s: [Send("worker", {"item": i}) for i in range(4)], ["worker"])
    g.add_edge("worker", END)
    result = replay_episode(g.compile(), recorded)  # before the fix: ConfigError from the calls that went live
    assert result.stopped and [d.kind for d in result.divergences] == ["prompt_changed"]
    assert result.turns == [] and llm.calls == 0
    assert result.final_state["notes"] == ["fallback"] * 4  # every call was refused, none answered


# -- final states compared up to generated ids ------------------------------------------------------------


def handoff_graph(llm):
    """An agent, then handoff-back messages whose tool-call id is a fresh uuid4 each run (what
    langgraph-supervisor's `create_handoff_back_messages` does)."""

    def agent(state):
        return {"messages": [llm.invoke(state["messages"])]}

    def handoff_back(state):
        call_id = str(uuid.uuid4())
        return {"messages": [
            AIMessage("Transferring back to supervisor", name="agent",
                      tool_calls=[{"name": "transfer_back_to_supervisor", "args": {}, "id": call_id}]),
            ToolMessage("Successfully transferred back to supervisor", tool_call_id=call_id,
                        name="transfer_back_to_supervisor")]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("handoff_back", handoff_back)
    g.add_edge(START, "agent")
    g.add_edge("agent", "handoff_back")
    g.add_edge("handoff_back", END)
    return g.compile()


def test_state_matches_up_to_generated_tool_call_ids(tmp_path):
    graph = handoff_graph(Unreachable())
    with TraceStore(tmp_path / "r.db") as store:
        episode = instrument(graph, {"agent": echo_policy()}, store=store).rollout(
            {"messages": [HumanMessage("hi")]})
    result = replay(graph, tmp_path / "r.db", episode.id)
    new, old = result.final_state["messages"][-1], episode.final_state["messages"][-1]
    assert new.tool_call_id != old.tool_call_id  # drawn again, as the third-party code does
    assert result.divergences == [] and result.state_matches and result.state_diff == ""


def test_state_comparison_keeps_which_tool_call_a_message_answers():
    def state(answer_first):
        a, b = str(uuid.uuid4()), str(uuid.uuid4())
        calls = [{"name": "f", "args": {}, "id": a}, {"name": "g", "args": {}, "id": b}]
        answers = [ToolMessage("F", tool_call_id=a), ToolMessage("G", tool_call_id=b)]
        return {"messages": [AIMessage("", tool_calls=calls), answers[0 if answer_first else 1]]}

    assert comparable(state(True)) == comparable(state(True))
    assert comparable(state(True)) != comparable(state(False))  # same ids, answering the other call
    assert comparable({"task": {"id": "a"}}) != comparable({"task": {"id": "b"}})  # the app's own ids count


def test_state_diff_shows_what_differs():
    graph = handoff_graph(Unreachable())
    episode = instrument(graph, {"agent": echo_policy()}).rollout({"messages": [HumanMessage("hi")]})
    episode.final_state["messages"][-1].content = "Transferred somewhere else"
    result = replay_episode(graph, episode)
    assert not result.state_matches
    changed = [line for line in result.state_diff.splitlines()[2:] if line[:1] in "+-"]
    assert [(line[0], line[1:].strip()) for line in changed] == [
        ("-", '"content": "Transferred somewhere else",'),
        ("+", '"content": "Successfully transferred back to supervisor",')]


# -- async-only graphs ---------------------------------------------------------------------------------


def test_areplay_runs_async_only_graphs(tmp_path):
    graph = _graphs.async_solver_verifier(Unreachable())
    with TraceStore(tmp_path / "r.db") as store:
        app = instrument(graph, {"solver": echo_policy(name="solver"), "verifier": echo_policy(name="verifier")},
                         store=store)
        episode = asyncio.run(app.arollout({"question": "2+3?"}))
    result = asyncio.run(areplay(graph, tmp_path / "r.db", episode.id))
    assert result.divergences == [] and result.state_matches
    assert [t.response_ids for t in result.turns] == [t.response_ids for t in episode.turns]
    with pytest.raises(ConfigError, match="areplay"):
        replay(graph, tmp_path / "r.db", episode.id)
    assert drmas_graph.areplay is areplay


def test_areplay_keys_async_sends_into_subgraphs():
    llm = Unreachable()

    async def search(state):
        await asyncio.sleep(random.random() * 0.01)
        return {"notes": [(await llm.ainvoke([HumanMessage(f"search item {state['item']}")])).content]}

    sub = StateGraph(Fan)
    sub.add_node("search", search)
    sub.add_edge(START, "search")
    sub.add_edge("search", END)
    g = StateGraph(Fan)
    g.add_node("research", sub.compile())
    g.add_conditional_edges(START, lambda s: [Send("research", {"item": i}) for i in range(4)], ["research"])
    g.add_edge("research", END)
    graph = g.compile()
    episode = asyncio.run(instrument(graph, {"research/search": echo_policy()}).arollout({"question": "q"}))
    assert sorted(t.call_key for t in episode.turns) == [f"research[{i}]/search" for i in range(4)]
    for _ in range(4):
        result = asyncio.run(areplay_episode(graph, episode))
        assert result.divergences == [] and result.state_matches


# -- episodes that continued a checkpointed thread --------------------------------------------------------


def chat_graph(llm, checkpointer):
    def agent(state):
        return {"messages": [llm.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    return g.compile(checkpointer=checkpointer)


def test_replay_starts_from_the_thread_checkpoint_the_rollout_continued(tmp_path):
    saver = InMemorySaver()
    graph = chat_graph(Unreachable(), saver)
    thread = {"configurable": {"thread_id": "user-7"}}
    with TraceStore(tmp_path / "r.db") as store:
        app = instrument(graph, {"agent": echo_policy()}, store=store)
        first = app.rollout({"messages": [HumanMessage("first question")]}, thread)
        after_first = saver.get_tuple(thread).config["configurable"]["checkpoint_id"]
        second = app.rollout({"messages": [HumanMessage("second question")]}, thread)
    assert first.metadata["thread_start"]["checkpoint_id"] is None  # a new thread: the input is everything
    assert second.metadata["thread_start"] == {"thread_id": "user-7", "checkpoint_ns": "",
                                               "checkpoint_id": after_first, "writes": []}  # none pending
    assert [m.content for m in second.turns[0].messages][:1] == ["first question"]
    latest = saver.get_tuple(thread).config

    result = replay(graph, tmp_path / "r.db", second.id)
    assert result.divergences == [] and result.state_matches and result.unreproducible is None
    assert saver.get_tuple(thread).config == latest  # the recorded thread is left alone

    elsewhere = chat_graph(Unreachable(), InMemorySaver())  # a new process: the saver lost the thread
    lost = replay(elsewhere, tmp_path / "r.db", second.id)
    assert "user-7" in lost.unreproducible and "does not hold" in lost.unreproducible
    assert lost.stopped and lost.divergences[0].kind == "prompt_changed"
    fresh = replay(elsewhere, tmp_path / "r.db", first.id)
    assert fresh.unreproducible is None and fresh.divergences == [] and fresh.state_matches


def test_cli_replays_async_graphs_and_says_what_cannot_be_reproduced(tmp_path, capsys, monkeypatch):
    from drmas_graph.cli import main as cli_main

    with TraceStore(tmp_path / "r.db") as store:
        app = instrument(_graphs.async_solver_verifier(Unreachable()),
                         {"solver": echo_policy(name="solver"), "verifier": echo_policy(name="verifier")},
                         store=store)
        async_episode = asyncio.run(app.arollout({"question": "2+3?"}))
        chat = instrument(chat_graph(Unreachable(), InMemorySaver()), {"agent": echo_policy()}, store=store)
        thread = {"configurable": {"thread_id": "t1"}}
        chat.rollout({"messages": [HumanMessage("one")]}, thread)
        continued = chat.rollout({"messages": [HumanMessage("two")]}, thread)
    (tmp_path / "my_graphs.py").write_text(
        "from langgraph.checkpoint.memory import InMemorySaver\nfrom tests import _graphs\n"
        "from tests.test_instrument import Unreachable\nfrom tests.test_replay_identity import chat_graph\n"
        "solver = _graphs.async_solver_verifier(Unreachable())\nchat = chat_graph(Unreachable(), InMemorySaver())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["traces", "replay", str(tmp_path / "r.db"), async_episode.id, "--graph", "my_graphs:solver"]) == 0
    assert "matched all 2 calls and reproduced the recorded final state" in capsys.readouterr().out
    assert cli_main(["traces", "replay", str(tmp_path / "r.db"), continued.id, "--graph", "my_graphs:chat"]) == 1
    out = capsys.readouterr().out
    assert f"episode {continued.id} cannot be reproduced exactly: the episode continued thread 't1'" in out


def test_concurrent_calls_inside_one_node_are_matched_by_prompt():
    llm = Unreachable()

    async def ask(text):
        await asyncio.sleep(random.random() * 0.01)
        return (await llm.ainvoke([HumanMessage(text)])).content

    async def panel(state):  # three calls at once from one node instance: they arrive in any order
        return {"notes": list(await asyncio.gather(*(ask(f"expert {k}: {state['question']}") for k in range(3))))}

    g = StateGraph(Fan)
    g.add_node("panel", panel)
    g.add_edge(START, "panel")
    g.add_edge("panel", END)
    graph = g.compile()
    episode = asyncio.run(instrument(graph, {"panel": echo_policy()}).arollout({"question": "q"}))
    for _ in range(8):
        result = asyncio.run(areplay_episode(graph, episode))
        assert result.divergences == [] and result.state_matches
        assert result.final_state["notes"] == [f"re expert {k}: q" for k in range(3)]


class AsyncOnlySaver(InMemorySaver):
    """A checkpointer with only the async API working (like AsyncSqliteSaver read from its event loop)."""

    def get_tuple(self, config):
        raise asyncio.InvalidStateError("use the async API")

    async def aget_tuple(self, config):
        return InMemorySaver.get_tuple(self, config)


def test_async_rollouts_record_the_thread_start_of_async_only_checkpointers():
    llm = Unreachable()

    async def agent(state):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    graph = g.compile(checkpointer=AsyncOnlySaver())
    app = instrument(graph, {"agent": echo_policy()})
    thread = {"configurable": {"thread_id": "a1"}}

    async def two_turns():
        await app.arollout({"messages": [HumanMessage("one")]}, thread)
        return await app.arollout({"messages": [HumanMessage("two")]}, thread)

    second = asyncio.run(two_turns())
    assert "error" not in second.metadata["thread_start"] and second.metadata["thread_start"]["checkpoint_id"]
    result = asyncio.run(areplay_episode(graph, second))
    assert result.unreproducible is None and result.divergences == [] and result.state_matches
    from drmas_graph.instrumentation._threads import fork_config

    forked, reason = fork_config(graph, second.metadata["thread_start"])  # the sync API cannot read it: said
    assert forked is None and "could not read" in reason and "areplay" in reason


def test_functional_api_task_calls_are_keyed_by_call_order():
    from langgraph.func import entrypoint, task

    llm = Unreachable()

    @task
    def work(i):
        _jitter()
        return llm.invoke([HumanMessage(f"work {i}")]).content

    @entrypoint()
    def main(n):
        return [f.result() for f in [work(i) for i in range(n)]]

    episode = instrument(main, {"worker": echo_policy()}, agents={"main*": "worker"}).rollout(3)
    assert sorted((t.call_key, t.messages[-1].content) for t in episode.turns) == [
        (f"main/work[{i}]", f"work {i}") for i in range(3)]
    for _ in range(6):
        result = replay_episode(main, episode)
        assert result.divergences == [] and result.final_state == [f"re work {i}" for i in range(3)]


def test_replay_of_a_run_that_resumed_an_interrupt(tmp_path):
    from langgraph.types import Command

    from tests.test_interrupts import review_graph

    graph = review_graph(Unreachable())  # draft -> review (interrupt) -> final
    thread = {"configurable": {"thread_id": "review-1"}}
    with TraceStore(tmp_path / "r.db") as store:
        app = instrument(graph, {"draft": echo_policy(name="draft"), "final": echo_policy(name="final")}, store=store)
        with pytest.raises(EpisodeInterruptedError, match="interrupted at node 'review' \\(value {'question': 'approve"):
            app.rollout({"messages": [HumanMessage("write a haiku")]}, thread)  # a paused episode is no finished one
        resumed = app.rollout(Command(resume="shorter please"), thread)  # a person answers, as in a chat UI
    assert [t.agent for t in resumed.turns] == ["final"]
    assert resumed.turns[0].messages[-1].content == "reviewer: shorter please"
    with TraceStore(tmp_path / "r.db", readonly=True) as store:
        assert store.load_episode(resumed.id).input == Command(resume="shorter please")
    result = replay(graph, tmp_path / "r.db", resumed.id)
    assert result.unreproducible is None and result.divergences == [] and result.state_matches
